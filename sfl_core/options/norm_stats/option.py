"""The global model's BatchNorm statistics as a training option (``norm_stats:``):

- ``mode: federated``: after aggregation, a phase of its own in which the asked agents run
  local batches through the new client portion and report each BatchNorm layer's input
  moments and the activations; the coordinator adds its server portion's and sets the global
  statistics (:mod:`.stats`, :mod:`.exchange`). Between passes (``every``) the last pass's
  statistics stay;
- ``freeze_after``: from then on every BatchNorm layer, on the devices (``assign.freeze_norm``)
  and the server's copies, normalises with the global statistics and keeps them (FixBN);
- ``local``: FedBN; each device keeps its own BatchNorm layers (``assign.local_norm``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Sequence

import torch

from sfl_core import timing
from sfl_core.options.base import (
    AssignField,
    DeviceOption,
    Phase,
    Recommendation,
    RoundContext,
    RoundOption,
    ServerTerms,
)
from sfl_core.options.norm_stats import exchange
from sfl_core.options.norm_stats import stats as norm_stats
from sfl_core.options.norm_stats.config import NormStatsConfig
from sfl_core.options.norm_stats.device import NormStatsOnDevice

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig
    from sfl_core.evidence import Evidence
    from sfl_core.fleet import AgentInfo
    from sfl_core.methods.base import RoundPlan
    from sfl_core.model.accounting import SplitCost
    from sfl_core.model.zoo import SplitModel
    from sfl_core.wire.assignment import Assignment

__all__ = ["NormStats", "pass_agents", "predict_pass"]

_NUM = (int, float)


def predict_pass(cfg: "RunConfig", cost: "SplitCost", info: "AgentInfo", *, ratio: float) -> tuple[float, float]:
    """One agent's statistics pass by the time model: its client portion down, ``batches ×
    batch_size`` forward passes (a third of a training step's FLOPs) on the agent and on the
    server, those activations up (``ratio``: their bytes on the wire over fp32). The seconds and
    bytes (what the virtual clock charges for the pass, as a phase after the round's slowest agent)."""
    samples = NormStatsConfig.of(cfg).batches * cfg.batch_size
    seconds = timing.compute_s_per_sample(info, cost.split)
    speed = cost.client_flops / seconds if seconds and cost.client_flops > 0 else info.profile.compute_flops
    up = samples * cost.activation_bytes * ratio
    t = timing.agent_round_time(
        client_flops=cost.client_flops * samples / 3, server_flops=cost.server_flops * samples / 3, bytes_up=up,
        bytes_down=cost.client_param_bytes, client_flops_per_s=speed, server_flops_per_s=cfg.server_flops,
        uplink_bytes_per_s=timing.uplink_rate(info), downlink_bytes_per_s=timing.downlink_rate(info),
        latency_s=info.profile.latency_s, messages=2)
    return t.total_s, up + cost.client_param_bytes


def pass_agents(cfg: "RunConfig", costs: Mapping[int, "SplitCost"], infos: Mapping[str, "AgentInfo"],
                plans: Mapping[str, tuple[int, str, int]]) -> list[str]:
    """Who runs a round's statistics pass: every agent of ``plans`` (agent -> its split, codec
    and bottleneck width this round, in round order), or the ``norm_stats.agents`` whose pass
    :func:`predict_pass` prices shortest: a pass lasts as long as its slowest agent."""
    ids = list(plans)
    k = NormStatsConfig.of(cfg).agents
    if not k or k >= len(ids):
        return ids

    def seconds(a: str) -> float:
        split, codec, width = plans[a]
        return predict_pass(cfg, costs[split], infos[a], ratio=timing.cut_wire_fraction(costs[split], codec, width))[0]
    chosen = set(sorted(ids, key=seconds)[:k])
    return [a for a in ids if a in chosen]


class NormStats(RoundOption):
    SECTION: ClassVar[type[NormStatsConfig]] = NormStatsConfig
    ASSIGN_FIELDS: ClassVar[Mapping[str, AssignField]] = {
        "freeze_norm": AssignField(bool),   # freeze_after: BatchNorm uses its statistics, frozen
        "local_norm": AssignField(bool),    # local (FedBN): keep the device's own BatchNorm layers
    }
    MESSAGES: ClassVar[Mapping[str, tuple[str, Mapping[str, Any]]]] = {
        # the new global client portion, run without training
        "norm_pass": ("coordinator", {"model": str, "split": int, "width": int, "weights": dict, "batches": int,
                                      "batch_size": int, "codec": str, "zstd_level": int, "activation_shape": list}),
        # per BatchNorm layer <layer>.mean/<layer>.m2 tensors and counts, and the activations of the
        # same passes (null where the agent holds the whole model)
        "norm_sums": ("agent", {"moments": dict, "counts": dict, "x": (dict, type(None)), "compute_s": _NUM}),
    }
    RUN_INFO = ("norm_stats",)
    STEP_AFTER_ROUND = 1
    """The pass's step number: after the round's last training step and federated evaluation's."""

    @classmethod
    def wanted(cls, cfg: "RunConfig") -> bool:
        ns = cls.settings(cfg)
        return ns.federated or ns.freeze_after > 0 or ns.local

    @classmethod
    def recommend(cls, cfg: "RunConfig", evidence: "Evidence", on: bool) -> Recommendation:
        """Federated statistics where a model with BatchNorm layers trains on label-skewed
        devices: averaging each device's batch statistics gives the global model statistics of
        no real batch (each device saw its own classes), which the pass replaces with the
        statistics of the new model on the devices' data. Its phase is priced by the time model."""
        if not evidence.batch_norm:
            return Recommendation(None, "the model has no BatchNorm layers")
        if cfg.privacy.dp_sgd is not None:
            return Recommendation(None, "DP-SGD's accounting does not cover the statistics the devices would report")
        if not evidence.strongly_skewed:
            return Recommendation(None, f"devices' label mixes close enough (mean KL {evidence.label_skew:.2f} "
                                        f"nats): averaged statistics serve")
        return Recommendation({"mode": "federated"},
                              f"BatchNorm layers on label-skewed devices (mean KL {evidence.label_skew:.2f} nats): "
                              f"the devices recompute the statistics after aggregation")

    @classmethod
    def run_info(cls, cfg: "RunConfig") -> dict[str, Any]:
        ns = cls.settings(cfg)   # an agent that cannot run statistics passes does not join
        return {"norm_stats": {"every": ns.every}} if ns.federated else {}

    @classmethod
    def phase_cost(cls, cfg: "RunConfig", costs: Mapping[int, "SplitCost"], infos: Mapping[str, "AgentInfo"],
                   plans: Mapping[str, tuple[int, str, int]]) -> tuple[float, float]:
        """The statistics pass a round adds (its slowest asked agent; bytes of all), per round: a
        pass every ``every`` rounds costs ``1/every`` of it, and only the rounds before a freeze
        (``freeze_after``) have one. (0, 0) without ``mode: federated``."""
        ns = cls.settings(cfg)
        if not ns.federated:
            return 0.0, 0.0
        priced = [predict_pass(cfg, costs[plans[a][0]], infos[a], ratio=timing.cut_wire_fraction(costs[plans[a][0]], plans[a][1], plans[a][2]))
                  for a in pass_agents(cfg, costs, infos, plans)]
        share = (min(ns.freeze_after, cfg.rounds) / cfg.rounds if ns.freeze_after else 1.0) / ns.every
        return max((t for t, _ in priced), default=0.0) * share, sum(b for _, b in priced) * share

    def __init__(self, cfg: "RunConfig", model: "SplitModel"):
        super().__init__(cfg, model)
        self.pass_stats: dict[str, torch.Tensor] = {}   # the last pass's statistics

    def frozen(self, r: int) -> bool:
        return norm_stats.frozen(self.section.freeze_after, r)

    def server_terms(self, ctx: RoundContext, r: int, plan: "RoundPlan", split_agents: Sequence[str],
                     assignments: Mapping[str, "Assignment"], terms: ServerTerms) -> None:
        terms.frozen_norms = terms.frozen_norms or self.frozen(r)
        terms.devices_own_norms = terms.devices_own_norms or self.section.local

    def assign_fields(self, ctx: RoundContext, r: int, agent: str, split: int, width: int) -> dict[str, Any]:
        return {**({"freeze_norm": True} if self.frozen(r) else {}),
                **({"local_norm": True} if self.section.local else {})}

    def phase(self, ctx: RoundContext, r: int, done: Mapping[str, "Assignment"]) -> Optional[Phase]:
        """The statistics pass. An agent that does not answer is dropped as in any step; without
        any valid answer the averaged statistics stay."""
        ns, cfg = self.section, self.cfg
        if not ns.federated or not norm_stats.batch_norm_layers(ctx.model):
            return None
        if self.frozen(r):   # no agent or server copy changed the statistics
            return None
        if r % ns.every:   # between passes, the last pass's statistics describe the model better than averages
            if self.pass_stats:
                ctx.model.load_state_dict(self.pass_stats, strict=False)
            return None
        t0 = time.monotonic()
        asked = pass_agents(cfg, ctx.costs, ctx.fleet, {a: (x.split, x.codec, x.width) for a, x in done.items()})
        bodies: dict[tuple[int, int], dict] = {}
        requests = {}
        for a in asked:
            d = done[a]
            if (d.split, d.width) not in bodies:
                bodies[d.split, d.width] = ctx.encode_state(ctx.client_state(d.split, d.width))
            requests[a] = (d, "norm_pass", exchange.request_body(
                cfg.model, d.split, d.width, bodies[d.split, d.width], batches=ns.batches,
                batch_size=cfg.batch_size, codec=d.codec, zstd_level=cfg.zstd_level,
                activation_shape=d.activation_shape))
        step = cfg.local_iters + self.STEP_AFTER_ROUND
        replies, agents = ctx.exchange(r, step, requests, "norm_sums")
        parts = []
        samples = ns.batches * cfg.batch_size
        for a, msg in replies.items():
            split = agents[a].assignment.split
            try:
                moments, x = exchange.check_reply(msg.body, ctx.model, split, samples,
                                                  agents[a].assignment.activation_shape)
            except ValueError as exc:   # wire.WireError
                ctx.reject(f"normalisation statistics from {a}: {exc}")
                continue
            parts.append(moments)
            if x is not None:
                t1 = time.monotonic()
                parts.append(exchange.server_moments(ctx.model, split, x, cfg.batch_size))
                agents[a].server_s = time.monotonic() - t1
        if parts:
            layers = norm_stats.apply(ctx.model, norm_stats.combine(parts))
            self.pass_stats = norm_stats.running_stats(ctx.model)
            ctx.log(f"round {r}: BatchNorm statistics of {len(layers)} layer(s) from {len(replies)} agent(s)")
        else:
            ctx.log(f"round {r}: no agent returned valid normalisation statistics; the averaged ones stay",
                    warning=True)
        return Phase({a: agents[a] for a in replies}, time.monotonic() - t0, samples)

    def load_state(self, tensors: Mapping[str, torch.Tensor], last_round: int, model: "SplitModel") -> None:
        if self.section.federated and last_round >= self.section.every:
            self.pass_stats = norm_stats.running_stats(model)   # what the rounds between passes keep

    @classmethod
    def device(cls) -> DeviceOption:
        return NormStatsOnDevice()
