"""How the engine turns the round's uploads into the next global model: decode each agent's
client portion, let the options screen them (a robust rule, :mod:`sfl_core.options.robust`),
and average layer by layer (S2FL Alg. 2, :mod:`sfl_core.aggregation`) or by an option's rule."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from coordinator.session import RoundAgent
from sfl_core.aggregation import participants, weighted_average
from sfl_core.model.bottleneck import slice_state
from sfl_core.wire import codec as wire
from sfl_core.wire.protocol import Message

if TYPE_CHECKING:
    from coordinator.registry import Registry
    from coordinator.server_trainer import ServerTrainer
    from coordinator.session import FleetSession
    from sfl_core.methods.base import Method, RoundPlan
    from sfl_core.model.zoo import SplitModel
    from sfl_core.options.base import RoundContext, RoundOption, ServerTerms


class RoundVoid(Exception):
    """A round in which fewer agents completed than it needs: it must not count."""


class RoundAverage:
    """Aggregation (a part of :class:`coordinator.engine.RoundEngine`)."""

    model: "SplitModel"
    method: "Method"
    registry: "Registry"
    server: "ServerTrainer"
    session: "FleetSession"
    options: "list[RoundOption]"
    device: torch.device
    _round_start: dict[str, torch.Tensor]
    _refused: dict[str, str]
    _terms: "ServerTerms"

    if TYPE_CHECKING:   # the engine's
        def _needed(self, selected: int) -> int: ...

        def client_state(self, split: int, width: int) -> dict[str, torch.Tensor]: ...

    def _aggregate(self, r: int, plan: "RoundPlan", agents: dict[str, RoundAgent],
                   uploads: dict[str, Message]) -> tuple[list[str], list[float]]:
        """Layer-wise aggregation (S2FL Alg. 2): every layer of the full model is averaged over the
        round's agents, from the agent's client portion if it held the layer, else from the server
        copy of its group; weight = the method's (the agent's data size by default), as the
        options let each state in (:meth:`~sfl_core.options.base.RoundOption.screen`) and unless
        an option averages otherwise (:meth:`~sfl_core.options.base.RoundOption.aggregate`). With
        one split and one group this is exactly FedAvg of the client portions plus the trained
        server portion. Returns the agents that completed the round and the losses they reported."""
        ctx = cast("RoundContext", self)   # the engine is the options' context
        clients, servers, weights, fed_losses, done = {}, {}, {}, [], []
        held: dict[tuple[int, int], dict[str, torch.Tensor]] = {}   # (split, width) -> what such an agent holds
        for a, msg in uploads.items():
            split, width = agents[a].assignment.split, agents[a].assignment.width
            if (split, width) not in held:
                held[split, width] = self.client_state(split, width)
            try:
                clients[a] = wire.decode_state(msg.body["weights"], held[split, width])
            except wire.WireError as exc:
                self.session.rejections.reject("invalid", f"weights from {a}: {exc}")
                self._refused[a] = "invalid weights"
                continue
            weights[a] = self.method.aggregation_weight(self.registry.agents[a], agents[a].assignment.batch_size)
            done.append(a)
            if msg.body["loss"] == msg.body["loss"]:  # not NaN
                fed_losses.append(float(msg.body["loss"]))
        for a, server in self.server.member_states({a: agents[a].assignment.split for a in done}).items():
            split, width = agents[a].assignment.split, agents[a].assignment.width
            # HetBL: an agent of width w trained only the first w decoder input channels
            servers[a] = {**server, **slice_state(server, f"bottlenecks.{split}.", width)} if width else server
        need = self._needed(len(plan.splits))
        if len(done) < need:
            raise RoundVoid(f"{len(done)} of {len(plan.splits)} selected agent(s) completed it, {need} needed")
        for option in self.options:
            clients, weights = option.screen(ctx, r, self._round_start, clients, weights,
                                             {a: agents[a].assignment for a in clients}, self._refused)
        servers = {a: s for a, s in servers.items() if a in clients}
        for option in self.options:
            option.observe_updates(ctx, self._round_start, clients, servers,
                                   {a: agents[a].assignment for a in clients}, self._terms, self.server.member_steps)
        if clients:
            copy_of = {a: i for i, g in enumerate(plan.groups) for a in g}
            states, ws = participants(clients, servers, weights, server_groups=copy_of if plan.server_once else None)
            defaults = self.model.state_dict()
            avg = next((x for x in (o.aggregate(ctx, states, ws, defaults) for o in self.options) if x is not None),
                       None)
            if avg is None:
                avg = weighted_average(states, ws, defaults)
            for option in self.options:
                avg = option.transform_average(ctx, self._round_start, avg, clients, servers, copy_of)
            self.model.load_state_dict({k: v.to(self.device) for k, v in avg.items()})
        return done, fed_losses

    def _option_metrics(self) -> dict[str, Any]:
        """What the options record of the round, each under its key."""
        return {o.SECTION.KEY: m for o in self.options for m in (o.round_metrics(),) if m}
