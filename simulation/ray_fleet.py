"""Fleet simulation on Ray: the simulated agents live in Ray actors, so their client-side
training runs in parallel on several cores or machines.

Only the transport changes. The engine, the virtual clock and the messages stay those of
the serial simulation (:mod:`simulation.inprocess`). Each actor hosts a group of agents
and trains them one after another; the actors run side by side.

- Messages cross to an actor as the protocol's own encoded bytes, and come back the same
  way, so byte counts are those of the serial run. Ray moves only each agent's shard, once,
  when the actor starts.
- While an answer is still on its way, :meth:`RayTransport.poll` waits for it and keeps the
  liveness clock still. Silence is measured in virtual time, and a slow host is not a silent
  agent.
- The session gathers each step's messages in the round's agent order, not in arrival
  order, so merged batches and aggregation sums come out the same as in the serial run.

Ray is an optional dependency (``pip install 'sfl-edge[ray]'``). This module imports it
only when a Ray fleet is built.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from sfl_core.config.run import RunConfig
from sfl_core.data.builtin import Dataset
from sfl_core.wire.protocol import Message
from simulation.inprocess import InProcessTransport, SimAgent, answer, fleet_agents

log = logging.getLogger("sfl.sim")

RAY_MISSING = "--ray needs Ray: pip install 'sfl-edge[ray]'"


class AgentHost:
    """One Ray actor's agents. A plain class: it becomes an actor in :func:`build_ray_fleet`."""

    def __init__(self, run_id: str, agents: list[SimAgent], threads: int = 1,
                 user_model: Optional[dict] = None) -> None:
        """``user_model``: a user's model to register in this worker first (its file, at the same
        path on every machine of the cluster, or its layer list: ``describe_source``)."""
        import torch

        from sfl_core.model.user_models import register_described

        # one core per actor: several actors share a machine, and intra-op threads would fight
        torch.set_num_threads(max(1, threads))
        register_described(user_model or {})
        self.run_id = run_id
        self.cores = {a.agent_id: a.core(run_id) for a in agents}

    def ready(self) -> int:
        """How many agents this actor hosts; called once so that start-up is not a round's time."""
        return len(self.cores)

    def handle(self, agent_id: str, payload: bytes) -> list[bytes]:
        return answer(self.cores[agent_id], self.run_id, payload)


class RayTransport(InProcessTransport):
    """The in-process transport with the agents in Ray actors: :meth:`send` returns at once, and
    :meth:`poll` gathers the answers (see the module docstring)."""

    def __init__(self, run_id: str, hosts: dict[str, Any]) -> None:
        """``hosts``: agent id -> the actor handle that hosts it."""
        import ray

        super().__init__(run_id, {})
        self._ray = ray
        self.hosts = hosts
        self._pending: dict[Any, str] = {}   # object ref -> agent id, in submission order

    def send(self, agent_id: str, msg: Message) -> int:
        payload = msg.encode()
        host = self.hosts.get(agent_id)
        if host is not None:
            self._pending[host.handle.remote(agent_id, payload)] = agent_id
        return len(payload)

    def poll(self, timeout: float) -> Optional[Message]:
        if not self._inbox and self._pending:
            refs = list(self._pending)
            self._ray.wait(refs, num_returns=1)           # wait for work in flight: no virtual time passes
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
            done = set(ready)
            for ref in refs:                               # every answer that is in, in the order sent
                if ref in done:
                    del self._pending[ref]
                    for payload in self._ray.get(ref):
                        self.deliver(payload)
            if not self._inbox:
                return None   # those answers were empty; others are still on their way
        return super().poll(timeout)

    def close(self) -> None:
        for host in set(self.hosts.values()):
            self._ray.kill(host)


def build_ray_fleet(cfg: RunConfig, data: Dataset, address: Optional[str] = None,
                    workers: Optional[int] = None) -> RayTransport:
    """Start (or join, with ``address``) Ray, place the config's agents round-robin on
    ``workers`` actors (default: the CPUs Ray reports, at most one per agent) and queue their
    registrations."""
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(RAY_MISSING) from exc
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, runtime_env=_runtime_env(address))
    agents, registrations = fleet_agents(cfg, data)
    n = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    n = max(1, min(n, len(agents)))
    actor = ray.remote(num_cpus=1)(AgentHost)
    groups = [agents[i::n] for i in range(n)]
    from sfl_core.model.user_models import describe_source
    handles = [actor.remote(cfg.run_id, group, user_model=describe_source(cfg.model)) for group in groups]
    ray.get([h.ready.remote() for h in handles])  # type: ignore[attr-defined]  # actors up and holding their shards
    hosts = {a.agent_id: h for h, group in zip(handles, groups) for a in group}
    transport = RayTransport(cfg.run_id, hosts)
    for msg in registrations:
        transport.deliver_from_agent(msg)
    log.info("Ray: %d agents on %d actors", len(agents), n)
    return transport


def _runtime_env(address: Optional[str]) -> Optional[dict]:
    """A cluster's workers may not have this package's checkout on their path: ship it when
    joining a cluster from a source tree (an installed package must be installed there too)."""
    if address is None:
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.exists(os.path.join(root, "pyproject.toml")):
        return {"py_modules": [os.path.join(root, m) for m in ("sfl_core", "coordinator", "edge_agent")]}
    return None
