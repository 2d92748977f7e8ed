"""In-process transport: agents live in the coordinator's process (fleet simulation).

Messages still go through the real encoder and validator, so byte counts and codec costs
are exactly those of a deployment; only the broker and the network are absent.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from coordinator.transport import LocalTransport
from edge_agent.agent import AgentCore, LocalData
from sfl_core.config.run import RunConfig, load_profile
from sfl_core.data.builtin import Dataset, DatasetError
from sfl_core.data.partition import label_counts, partition_indices
from sfl_core.privacy import AgentPrivacy
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.protocol import Message
from simulation.adversary import Attack, MaliciousCore, claimed_counts, poison_data

log = logging.getLogger("sfl.sim")


class InProcessTransport(LocalTransport):
    """The simulation's transport: agents answer synchronously inside :meth:`send`.

    Its liveness clock (:meth:`live_time`, what the engine measures silence and resend
    timers on) is virtual: an empty :meth:`poll` means nothing can ever arrive, so it
    advances by the poll's timeout instead of sleeping. An agent that rejects a message is
    then dropped after ``step_timeout_s`` of that clock, at once in real time.
    """

    def __init__(self, run_id: str, agents: dict[str, AgentCore]):
        self.run_id = run_id
        self.agents = agents
        self._inbox: deque[Message] = deque()
        self._live = 0.0

    def live_time(self) -> float:
        return self._live

    def deliver_from_agent(self, msg: Message) -> None:
        """Queue a message as if it had arrived from the broker (encoded, then validated)."""
        self.deliver(msg.encode())

    def deliver(self, payload: bytes) -> None:
        """Queue an agent's encoded message, validated as the coordinator validates any."""
        self._inbox.append(protocol.decode(payload, run=self.run_id, allowed=protocol.AGENT_TYPES))

    def send(self, agent_id: str, msg: Message) -> int:
        payload = msg.encode()
        agent = self.agents.get(agent_id)
        if agent is not None:
            for reply in answer(agent, self.run_id, payload):
                self.deliver(reply)
        return len(payload)

    def poll(self, timeout: float) -> Optional[Message]:
        if self._inbox:
            return self._inbox.popleft()
        self._live += timeout
        return None


def answer(agent: AgentCore, run_id: str, payload: bytes) -> list[bytes]:
    """A simulated agent's replies to one encoded coordinator message, validated as a device
    validates it; a message the agent rejects gets no reply (and the engine's timers act)."""
    try:
        replies = agent.handle(protocol.decode(payload, run=run_id, allowed=protocol.COORD_TYPES))
    except wire.WireError as exc:
        log.warning("agent %s rejected a message: %s", agent.agent_id, exc)
        return []
    return [reply.encode() for reply in replies]


@dataclass
class SimAgent:
    """What one simulated agent is made of: enough to build its :class:`AgentCore` anywhere
    (in this process, or in a Ray worker on another machine)."""

    agent_id: str
    index: int
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    seed: int
    privacy: AgentPrivacy = AgentPrivacy()
    standardise: bool = False
    """Its own data (a task run): scaled, standardised with the run's constants when they come."""
    x_val: Optional[torch.Tensor] = None
    y_val: Optional[torch.Tensor] = None
    """Its held-out split (a task run), for federated evaluation."""
    attack: Optional[Attack] = None
    """What it lies about (a bench or a test of the defenses, :mod:`simulation.adversary`)."""

    def core(self, run_id: str, device: str | torch.device = "cpu") -> AgentCore:
        held_out = LocalData(self.x_val, self.y_val, self.num_classes) \
            if self.x_val is not None and self.y_val is not None else None
        data = LocalData(self.x, self.y, self.num_classes)
        if self.attack is not None:
            return MaliciousCore(self.agent_id, run_id, data, self.input_shape, seed=self.seed, device=device,
                                 privacy=self.privacy, standardise=self.standardise, held_out=held_out,
                                 attack=self.attack)
        return AgentCore(self.agent_id, run_id, data, self.input_shape, seed=self.seed, device=device,
                         privacy=self.privacy, standardise=self.standardise, held_out=held_out)


def own_data_agents(cfg: RunConfig) -> tuple[list[SimAgent], list[Message]]:
    """A task run's simulated devices, each reading its own ``data`` as an agent does."""
    from edge_agent.own_data import prepare_device
    from sfl_core.model.fingerprint import architecture
    from sfl_core.model.zoo import build_model

    task = cfg.task
    assert task is not None
    lines = architecture(build_model(cfg.model, task.input_shape, task.num_classes))
    agents, registrations = [], []
    for i, (profile_name, path) in enumerate(zip(cfg.agent_profiles(), cfg.agent_data())):
        if path is None:
            raise DatasetError(f"fleet: agent {i} ({profile_name}) has no 'data': simulating a run on the devices' "
                               f"own data needs each fleet entry's data path")
        device = prepare_device(path, task, cfg.data.bad_files, lines)
        train, val = device.local(task.num_classes)
        agent = SimAgent(f"sim-{i:03d}", i, train.x, train.y, task.num_classes, tuple(task.input_shape),
                         seed=cfg.seed * 1000 + i, privacy=cfg.privacy.agent(), standardise=True,
                         x_val=val.x if val is not None else None, y_val=val.y if val is not None else None)
        agents.append(agent)
        registrations.append(Message(
            "register", cfg.run_id, agent.agent_id, round=0, seq=1,
            body=protocol.register_body(index=i, profile=load_profile(profile_name), measured={},
                                        label_counts=train.label_counts(), num_samples=len(train), emulate=True,
                                        resume={}, privacy=agent.privacy.describe(), extra=device.extra)))
    return agents, registrations


def fleet_agents(cfg: RunConfig, data: Dataset, attacks: Optional[Mapping[str, Attack]] = None
                 ) -> tuple[list[SimAgent], list[Message]]:
    """Every agent of the config with its shard (or, in a task run, its own data), and the
    registration each one sends first; ``attacks``: the agents (by id) that lie, and how."""
    attacks = attacks or {}
    if cfg.task is not None:
        if attacks:
            raise ValueError("attacks are simulated on a data set's shards, not on devices' own data")
        return own_data_agents(cfg)
    shards = partition_indices(data.y_train.numpy(), cfg.num_agents, cfg.data.partition, alpha=cfg.data.alpha,
                               seed=cfg.data.seed, num_classes=data.num_classes)
    agents, registrations = [], []
    for i, profile_name in enumerate(cfg.agent_profiles()):
        profile = load_profile(profile_name)
        idx = torch.as_tensor(shards[i], dtype=torch.long)
        local = LocalData(data.x_train[idx], data.y_train[idx], data.num_classes)
        agent_id, attack = f"sim-{i:03d}", None
        x, y = local.x, local.y
        if agent_id in attacks:
            attack = attacks[agent_id]
            x, y = poison_data(x, y, data.num_classes, attack, torch.Generator().manual_seed(cfg.seed * 1000 + i))
        agent = SimAgent(agent_id, i, x, y, data.num_classes, tuple(data.input_shape),
                         seed=cfg.seed * 1000 + i, privacy=cfg.privacy.agent(), attack=attack)
        agents.append(agent)
        # an attacker registers the mix of the labels it trains on (a claim its labels would
        # refute is an attack of its own: ``even_mix``)
        counts = claimed_counts(label_counts(y.numpy(), data.num_classes), attacks, agent_id)
        registrations.append(Message(
            "register", cfg.run_id, agent.agent_id, round=0, seq=1,
            body=protocol.register_body(index=i, profile=profile, measured={}, label_counts=counts,
                                        num_samples=sum(counts), emulate=True, resume={},
                                        privacy=agent.privacy.describe())))
    return agents, registrations


def build_fleet(cfg: RunConfig, data: Dataset, device: str | torch.device = "cpu",
                attacks: Optional[Mapping[str, Attack]] = None) -> InProcessTransport:
    """Create every agent of the config with its own shard and queue their registrations
    (``attacks``: the agents that lie, :mod:`simulation.adversary`)."""
    agents, registrations = fleet_agents(cfg, data, attacks)
    transport = InProcessTransport(cfg.run_id, {a.agent_id: a.core(cfg.run_id, device) for a in agents})
    for msg in registrations:
        transport.deliver_from_agent(msg)
    return transport
