"""The time model (docs/methods/time-model.md): what one agent's round costs, for every part that asks.

One equation (:func:`agent_round_time`, S2FL's Eq. 1 with the transfer split by direction) and
one entry point to it for every prediction: :func:`price_option`, an agent's round at a cut,
codec and width from what is known of the agent (its registration measurements, else its
profile), as a line in the batch size (:class:`Option`). The virtual clock charges the
equation with the bytes and FLOPs a round really moved; the joint planner, S2FL's estimates
for cuts never measured, the previews, the round deadline and the fleet's fastest cut
(:func:`fleet_round_time`) all predict with :func:`price_option`. Keeping one entry point is what
makes simulated time-to-accuracy comparable with a real deployment: the virtual clock charges
exactly what the planners predict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import special

from sfl_core import option_registry
from sfl_core.wire.codec import nominal_ratio
from sfl_core.fleet import compute_s_per_sample, downlink_rate, uplink_rate

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig
    from sfl_core.fleet import AgentInfo
    from sfl_core.methods.base import RoundPlan
    from sfl_core.model.accounting import SplitCost


@dataclass(frozen=True)
class AgentTime:
    """One agent's share of a round: compute on the agent, transfer, compute on the server, and
    the coordinator's own handling of the round's step messages (:func:`step_overhead_s`)."""

    client_compute_s: float
    transfer_s: float
    server_compute_s: float
    coordinator_s: float = 0.0
    overlap_s: float = 0.0
    """Seconds of the parts above that a window of steps in flight runs at the same time as
    others (:func:`pipeline_overlap_s`; 0 in lock-step, window 1)."""

    @property
    def total_s(self) -> float:
        return self.client_compute_s + self.transfer_s + self.server_compute_s + self.coordinator_s - self.overlap_s


def agent_round_time(
    *,
    client_flops: float,
    server_flops: float,
    bytes_up: float,
    bytes_down: float,
    client_flops_per_s: float,
    server_flops_per_s: float,
    uplink_bytes_per_s: float,
    downlink_bytes_per_s: float,
    latency_s: float = 0.0,
    messages: int = 0,
    coordinator_s: float = 0.0,
) -> AgentTime:
    """S2FL Eq. 1 with the transfer split by direction: ``T = bytes/R + F_c/Comp_c + F_s/Comp_s``,
    plus ``coordinator_s``, the seconds the coordinator's handling of the round's step messages
    adds (:func:`step_overhead_s`; 0 for the equation as published).

    ``bytes_up``/``bytes_down`` are the real encoded bytes (weights, activations, gradients),
    so codec choices show up in the virtual clock; ``messages`` one-way latencies are added.
    """
    return AgentTime(
        client_compute_s=client_flops / client_flops_per_s,
        transfer_s=transfer_time(bytes_up, bytes_down, uplink_bytes_per_s, downlink_bytes_per_s,
                                 latency_s=latency_s, messages=messages),
        server_compute_s=server_flops / server_flops_per_s if server_flops else 0.0,
        coordinator_s=coordinator_s,
    )


def step_overhead_s(per_agent_step_s: float, *, steps: int, split_agents: int) -> float:
    """What the coordinator's own work adds to each split agent's round: ``tau · n · h``.

    Feature merging steps in lock-step: at each of the ``steps`` local steps the coordinator
    receives, validates and decodes the ``split_agents`` agents' activations, runs the merged
    server step, and encodes and publishes their gradients, one agent after another, while
    every agent waits; and the step ends only when its slowest agent's activations are in.
    None of that is the agent's compute or its link, and it grows with the agents in the
    round, so it is charged as ``h`` seconds per agent per step (``per_agent_step_s``, the run's
    ``agent_step_overhead_s``, or under ``strategy: auto`` as a deployment measures it). An agent
    training the whole model exchanges no step messages and pays none.
    """
    return per_agent_step_s * steps * split_agents


def transfer_time(bytes_up: float, bytes_down: float, uplink_bytes_per_s: float, downlink_bytes_per_s: float, *,
                  latency_s: float = 0.0, messages: int = 0) -> float:
    """The link part of :func:`agent_round_time`: ``up/R_up + down/R_down + messages·latency``
    (what MergeSFL's batch-independent and per-sample link estimates are made of too)."""
    return bytes_up / uplink_bytes_per_s + bytes_down / downlink_bytes_per_s + messages * latency_s


def lockstep_slack_s(step_s: Sequence[float], jitter_s: Sequence[float], *, steps: int) -> float:
    """What lock-step adds to a round beyond its slowest agent: ``tau · (E[max_i X_i] − max_i μ_i)``.

    Feature merging waits at every step for the last agent's activations, so a round lasts
    the sum over steps of the slowest response, not the slowest agent's sum. With agent ``i``'s
    step response ``X_i ~ N(μ_i, σ_i²)`` (``step_s`` the means, ``jitter_s`` the standard
    deviations, as a deployment measured them), agents whose means are close each lose the
    step to the other's bad luck: two equal agents add ``σ/√π`` per step, more agents more.
    A planner that equalises its agents' times makes exactly that case. ``E[max]`` is
    integrated numerically (``∫ (1 − Π_i Φ((x − μ_i)/σ_i)) dx`` above a point every agent is
    almost surely past), over the agents that can still be the slowest. 0 without jitter
    (a virtual clock's rounds), so the time model as published is unchanged there.
    """
    pairs = [(float(m), float(s)) for m, s in zip(step_s, jitter_s)]
    if not pairs or not any(s > 0 for _, s in pairs):
        return 0.0
    top = max(m for m, _ in pairs)
    widest = max(s for _, s in pairs)
    lo = top - 8.0 * widest
    contenders = [(m, s) for m, s in pairs if m + 8.0 * s > lo]
    hi = max(m + 8.0 * s for m, s in contenders)
    x = np.linspace(lo, hi, 2001)
    below = np.ones_like(x)                  # P(every agent's step is done by x)
    for m, s in contenders:
        below *= special.ndtr(torch.from_numpy((x - m) / s)).numpy() if s > 0 else (x >= m)
    above = 1.0 - below
    expected_max = lo + float(np.sum((above[1:] + above[:-1]) * np.diff(x)) / 2)   # trapezoid rule
    return max(0.0, float(steps * (expected_max - top)))


def lockstep_phases_s(down_s: Sequence[float], up_s: Sequence[float], total_s: Sequence[float], *,
                      steps: int) -> float:
    """What lock-step adds to a round where its agents divide their time differently.

    Agent ``i``'s round ``total_s[i]`` is its client portion's download ``d_i`` (``down_s``),
    ``tau`` steps of ``s_i = (T_i − d_i − u_i) / tau`` and the upload ``u_i`` (``up_s``). The
    first phase (the download and half a step), each step between and the last phase (half a
    step and the upload) wait for their own slowest agent, so the round lasts

        max_i (d_i + s_i/2) + (tau − 1) · max_i s_i + max_i (s_i/2 + u_i)

    rather than ``max_i T_i``; returns the difference (0 where one agent is the slowest in every
    phase). A device on a slow link holding a deep cut beside one with slow steps is the
    slowest in different phases, and the round outlasts both.
    """
    if not total_s:
        return 0.0
    step = [max(0.0, t - d - u) / steps for d, u, t in zip(down_s, up_s, total_s)]
    lockstep = (max(d + s / 2 for d, s in zip(down_s, step)) + (steps - 1) * max(step)
                + max(u + s / 2 for u, s in zip(up_s, step)))
    return max(0.0, lockstep - max(total_s))


AUTO_WINDOWS = (1, 2, 4)
"""The windows ``window: auto`` chooses from: past 4 the staleness bench/pipeline.py measured
cost accuracy on the shipped fleets, for little more time hidden."""
WINDOW_SLACK = 0.05
"""``window: auto`` takes the smallest window whose predicted round is within this fraction of
the deepest one's: every step in flight beyond it buys staleness for under 5 % of the round."""


def pipelined_step_s(*, client_s: float, up_s: float, down_s: float, server_s: float, latency_s: float,
                     window: int, half_duplex: bool = False, both_ways: tuple[float, float] = (1.0, 1.0)) -> float:
    """One step's share of a round once ``window`` steps are in flight (steady state).

    A step is a chain: client forward, activations up, the server's step, gradients down,
    client backward: ``s = c + u + v + d + 2·latency`` seconds in lock-step (window 1). With
    ``W`` steps in flight the device computes step ``k + 1`` while step ``k``'s activations
    travel and the server works, so each resource (the device's processor ``c``, the uplink
    ``u``, the server ``v``, the downlink ``d``) is busy for its own part of every step and
    the chain repeats every

        max(s / W, c, u, v, d)

    seconds: ``W`` steps per round trip when the round trip dominates, else the busiest
    resource's share (the pipeline's bound). ``c``, ``u``, ``v``, ``d`` are per-step seconds;
    latency occupies no resource. Window 1 gives ``s``.

    ``both_ways``: on a full-duplex link, the share of its one-way rate the uplink and the
    downlink each keep while both carry data at once (a profile's ``bidir_*`` rates over its
    one-way ones): each direction's segments and acknowledgements queue behind the other's, so
    a pipeline that keeps both busy is bounded by ``u / e_up`` and ``d / e_down``:
    ``max(s / W, c, u / e_up, v, d / e_down)``. ``u`` and ``d`` are one-way seconds.

    ``half_duplex``: the uplink and the downlink are one medium that carries one direction at
    a time (a WiFi cell), one resource busy ``u + d`` of every step:
    ``max(s / W, c, u + d, v)``.
    """
    if window <= 1:
        return client_s + up_s + down_s + server_s + 2 * latency_s
    return max(pipeline_bounds(client_s=client_s, up_s=up_s, down_s=down_s, server_s=server_s, latency_s=latency_s,
                               window=window, half_duplex=half_duplex, both_ways=both_ways))


def pipeline_bounds(*, client_s: float, up_s: float, down_s: float, server_s: float, latency_s: float,
                    window: int, half_duplex: bool = False, both_ways: tuple[float, float] = (1.0, 1.0)
                    ) -> tuple[float, ...]:
    """The terms :func:`pipelined_step_s` takes the largest of: the round trip over the window,
    then each resource's seconds per step (the links as one resource where ``half_duplex``,
    else each at its rate while both are busy, ``both_ways``). The planners price a window as
    the largest of these, each a line in the batch."""
    serial = client_s + up_s + down_s + server_s + 2 * latency_s
    links = (up_s + down_s,) if half_duplex else (up_s / both_ways[0], down_s / both_ways[1])
    return (serial / window, client_s, server_s, *links)


def pipeline_overlap_s(*, steps: int, window: int, client_s: float, up_s: float, down_s: float,
                       server_s: float, latency_s: float, half_duplex: bool = False,
                       both_ways: tuple[float, float] = (1.0, 1.0)) -> float:
    """What a window of ``window`` steps in flight hides of a round of ``steps`` lock-step steps
    whose totals are ``client_s`` (compute), ``up_s`` / ``down_s`` (the activations' and
    gradients' bytes over the links, one way at a time), ``server_s`` (the server and
    coordinator for this agent's rows): the first step runs alone, the other ``steps - 1`` each
    take :func:`pipelined_step_s` instead of the whole chain (on a ``half_duplex`` link, or at
    ``both_ways``' shares of the link's rates, as it says). 0 for window 1 or a single step.
    """
    if window <= 1 or steps <= 1:
        return 0.0
    per: dict[str, Any] = dict(client_s=client_s / steps, up_s=up_s / steps, down_s=down_s / steps,
                               server_s=server_s / steps, latency_s=latency_s)
    serial = pipelined_step_s(**per, window=1)
    return (steps - 1) * max(0.0, serial - pipelined_step_s(**per, window=window, half_duplex=half_duplex,
                                                            both_ways=both_ways))


def round_time(times: Iterable[float]) -> float:
    """A synchronous round lasts as long as its slowest agent."""
    return max(times, default=0.0)


def waiting_time(times: Iterable[float]) -> float:
    """MergeSFL's waiting time: mean over agents of (slowest - own)."""
    ts = list(times)
    if not ts:
        return 0.0
    slowest = max(ts)
    return sum(slowest - t for t in ts) / len(ts)


# ====================================================================== pricing one agent's round


@dataclass(frozen=True)
class Option:
    """One way an agent can train a round: cut ``split``, wire ``codec`` and bottleneck ``width``;
    its round time and memory as lines in the batch size (per-sample terms already include
    the ``tau`` steps)."""

    split: int
    codec: str
    fixed_s: float
    per_sample_s: float
    compute_per_sample_s: float = 0.0
    """The client-compute part of ``per_sample_s`` (what a compute slowdown scales)."""
    mem_fixed: float = 0.0
    mem_per_sample: float = 0.0
    width: int = 0
    """Bottleneck width at the cut (0: none)."""
    weights_down_s: float = 0.0
    weights_up_s: float = 0.0
    """The client portion's download and upload (a latency each) by the time model, before the
    measured factors: they open and close the round, outside the lock-stepped steps."""
    window: int = 1
    """Steps in flight (:func:`pipelined_step_s`)."""
    lines: tuple[tuple[float, float], ...] = ()
    """With a window over 1: the round is the largest of these (fixed, per-sample) lines, one per
    resource that can bound the pipeline (a maximum of lines in the batch is still exact for
    :meth:`largest_batch`); ``fixed_s`` and ``per_sample_s`` stay the lock-step round."""

    def serial_time(self, batch: int) -> float:
        """The round in lock-step (window 1): what the measured factors divide."""
        return self.fixed_s + self.per_sample_s * batch

    def time(self, batch: int) -> float:
        if self.lines:
            return max(f + p * batch for f, p in self.lines)
        return self.serial_time(batch)

    def memory(self, batch: int) -> float:
        return self.mem_fixed + self.mem_per_sample * batch

    def largest_batch(self, deadline: float, memory: float | None, hi: int) -> int:
        """The largest batch in ``[0, hi]`` that finishes by ``deadline`` and fits ``memory`` (-1: none)."""
        b = hi
        for fixed, per in self.lines or ((self.fixed_s, self.per_sample_s),):
            room = deadline - fixed
            if room < 0:
                return -1
            b = b if per <= 0 or math.isinf(room) else min(b, math.floor(room / per + 1e-9))
        if memory is not None:
            if self.mem_fixed > memory:
                return -1
            if self.mem_per_sample > 0:
                b = min(b, math.floor((memory - self.mem_fixed) / self.mem_per_sample))
        return b


def option_for(*, split: int, codec: str, tau: int, client_flops: float, server_flops: float,
               weight_bytes: float, activation_bytes: float, compute_flops_per_s: float,
               server_flops_per_s: float, uplink_bytes_per_s: float, downlink_bytes_per_s: float,
               latency_s: float, messages: int, compute_scale: float = 1.0, link_scale: float = 1.0,
               mem_fixed: float = 0.0, mem_per_sample: float = 0.0, width: int = 0,
               coordinator_s: float = 0.0, weight_bytes_down: float | None = None, window: int = 1,
               up_share: float = 0.5, half_duplex: bool = False, both_ways: tuple[float, float] = (1.0, 1.0)
               ) -> Option:
    """An :class:`Option` from the time model itself (:func:`sfl_core.agent_round_time`, the
    function the virtual clock charges), evaluated at batch 0 and 1 (it is linear in the batch).

    Per-sample FLOPs and bytes are per training sample; ``tau`` steps per round; weights go
    down and up once (``weight_bytes`` each way; ``weight_bytes_down`` down where the download
    carries more, e.g. SCAFFOLD's correction), activations up and gradients down
    (``activation_bytes`` each way, on the wire). ``compute_scale`` and ``link_scale`` are the
    measured-over-predicted corrections the planner learns from finished rounds;
    ``coordinator_s`` the round's :func:`step_overhead_s` (independent of the batch).
    ``window``: steps in flight; over 1 the round is the maximum of :func:`pipelined_step_s`'s
    lines (:attr:`Option.lines`), each linear in the batch; ``up_share`` of the steps' bytes go up
    (gradients often compress less than activations: the busier direction bounds a window, at
    its ``both_ways`` share of its rate; on a ``half_duplex`` link both directions together do).
    """
    weights_down = weight_bytes if weight_bytes_down is None else weight_bytes_down

    def parts(batch: int) -> AgentTime:
        samples = tau * batch
        return agent_round_time(
            client_flops=client_flops * samples, server_flops=server_flops * samples,
            bytes_up=weight_bytes + samples * activation_bytes, bytes_down=weights_down + samples * activation_bytes,
            client_flops_per_s=compute_flops_per_s, server_flops_per_s=server_flops_per_s,
            uplink_bytes_per_s=uplink_bytes_per_s, downlink_bytes_per_s=downlink_bytes_per_s, latency_s=latency_s,
            messages=messages, coordinator_s=coordinator_s)

    def scaled(t: AgentTime) -> float:
        return t.client_compute_s * compute_scale + t.transfer_s * link_scale + t.server_compute_s + t.coordinator_s

    zero, one = parts(0), parts(1)
    down = transfer_time(0, weights_down, uplink_bytes_per_s, downlink_bytes_per_s, latency_s=latency_s, messages=1)
    up = transfer_time(weight_bytes, 0, uplink_bytes_per_s, downlink_bytes_per_s, latency_s=latency_s, messages=1)
    lines: tuple[tuple[float, float], ...] = ()
    if window > 1 and tau > 1 and activation_bytes > 0:
        def stages(batch: int) -> tuple[float, list[float]]:
            """(the round without its last tau - 1 steps, each resource's and the window's per-step seconds)."""
            t, n = parts(batch), tau * batch
            step: dict[str, Any] = dict(
                client_s=t.client_compute_s * compute_scale / tau,
                up_s=2 * up_share * n * activation_bytes / uplink_bytes_per_s * link_scale / tau,
                down_s=2 * (1 - up_share) * n * activation_bytes / downlink_bytes_per_s * link_scale / tau,
                server_s=(t.server_compute_s + t.coordinator_s) / tau, latency_s=latency_s * link_scale)
            serial = pipelined_step_s(**step, window=1)
            bounds = pipeline_bounds(**step, window=window, half_duplex=half_duplex, both_ways=both_ways)
            return scaled(t) - (tau - 1) * serial, [(tau - 1) * x for x in bounds]
        (head0, at0), (head1, at1) = stages(0), stages(1)
        lines = tuple((head0 + a0, (head1 + a1) - (head0 + a0)) for a0, a1 in zip(at0, at1))
    return Option(split=split, codec=codec, fixed_s=scaled(zero), per_sample_s=scaled(one) - scaled(zero),
                  compute_per_sample_s=(one.client_compute_s - zero.client_compute_s) * compute_scale,
                  mem_fixed=mem_fixed, mem_per_sample=mem_per_sample, width=width,
                  weights_down_s=down, weights_up_s=up, window=window if lines else 1, lines=lines)


def price_option(cfg: "RunConfig", cost: "SplitCost", codec: str, info: "AgentInfo", *, ratio: float,
                 compute_scale: float = 1.0, link_scale: float = 1.0, width: int = 0,
                 split_agents: int = 1, per_agent_step_s: float | None = None,
                 window: int | str | None = None, up_share: float = 0.5) -> Option:
    """One agent's round at one cut and codec, by the time model, from what is known of it: its
    registration measurements (compute seconds per sample at that cut, link rates) where it
    measured them, else its profile. ``ratio``: activation bytes on the wire over fp32 (the
    codec's); a bottleneck ``width`` sends that many of the cut's channels. Memory: weights,
    gradients (and momentum, and what the training options hold: drift correction's copy) plus
    every client activation and its gradient per sample, for every step in flight (and a copy of
    the client portion's weights for each step beyond the first); the download carries what the
    options add (SCAFFOLD's correction).
    A cut (not the whole model) pays the coordinator's :func:`step_overhead_s` for a round of
    ``split_agents`` split agents at ``per_agent_step_s`` (default: the run's
    ``agent_step_overhead_s``), with ``window`` steps in flight (default: the run's ``window``;
    'auto': :func:`choose_window`), ``up_share`` of the steps' bytes going up (measured: the
    method's ``up_share``). The planners (auto), ``sfl-coord plan`` and
    every method's preview price with this."""
    ratio = wire_fraction(ratio, width, cost.activation_shape[0] if width else 1)
    seconds = compute_s_per_sample(info, cost.split)
    speed = cost.client_flops / seconds if seconds and cost.client_flops > 0 else info.profile.compute_flops
    options = option_registry.wanted(cfg)
    copies = (3 if cfg.momentum > 0 else 2) + sum(o.portions_held(cfg) for o in options)
    whole = cost.activation_bytes == 0   # the whole model on the agent: weights only, no per-step exchange
    h = cfg.agent_step_overhead_s if per_agent_step_s is None else per_agent_step_s

    def at(w: int) -> Option:
        return option_for(
            split=cost.split, codec=codec, tau=cfg.local_iters, client_flops=cost.client_flops,
            server_flops=cost.server_flops, weight_bytes=cost.client_param_bytes,
            weight_bytes_down=cost.client_param_bytes * (1 + sum(o.portions_down(cfg) for o in options)),
            activation_bytes=cost.activation_bytes * ratio, compute_flops_per_s=speed,
            server_flops_per_s=cfg.server_flops, uplink_bytes_per_s=uplink_rate(info),
            downlink_bytes_per_s=downlink_rate(info),
            latency_s=info.profile.latency_s, messages=2 if whole else 2 * cfg.local_iters + 2,
            compute_scale=compute_scale, link_scale=link_scale, mem_fixed=(copies + w - 1) * cost.client_param_bytes,
            mem_per_sample=2 * cost.client_activation_bytes * w, width=width,
            coordinator_s=0.0 if whole else step_overhead_s(h, steps=cfg.local_iters, split_agents=split_agents),
            window=w, up_share=up_share, half_duplex=info.profile.half_duplex, both_ways=info.profile.both_ways)

    w = cfg.window if window is None else window
    if whole or w == 1 or keeps_lockstep(info):
        return at(1)
    if w == "auto":
        return choose_window([at(x) for x in AUTO_WINDOWS], cfg.batch_size)
    return at(int(w))


def window_for(cfg: "RunConfig", costs: Mapping[int, "SplitCost"], plan: "RoundPlan", agent: str,
               info: "AgentInfo") -> int:
    """An agent's steps in flight: its method's plan's, else the run's ``window`` as
    :func:`price_option` reads it at the agent's cut, codec and width ('auto': the time model's
    choice; 1 for an agent whose defenses keep it in lock-step, or the whole model). A run in
    lock-step (``window: 1``) prices nothing: every agent's window is 1."""
    if agent in plan.windows:
        return plan.windows[agent]
    if cfg.window == 1:
        return 1
    split, width = plan.splits[agent], plan.widths.get(agent, 0)
    codec = plan.codecs.get(agent) or cfg.codec
    return price_option(cfg, costs[split], codec, info, ratio=nominal_ratio(codec), width=width).window


def keeps_lockstep(info: "AgentInfo") -> bool:
    """Whether an agent trains one step at a time whatever its window: withheld labels (its
    logits come back for the step just sent) and DP-SGD (per-sample gradients of that step)
    are its declared defenses (:mod:`sfl_core.privacy`)."""
    declared = info.privacy or {}
    return bool(declared.get("withhold_labels")) or "dp_sgd" in declared


def choose_window(options: Sequence[Option], batch: int) -> Option:
    """Of one choice priced at several windows (smallest first), the smallest window whose round
    at ``batch`` is within :data:`WINDOW_SLACK` of the fastest: a step in flight costs staleness
    (each gradient lands up to ``window - 1`` updates late), so it must buy time."""
    best = min(o.time(batch) for o in options)
    return next(o for o in options if o.time(batch) <= best * (1 + WINDOW_SLACK))


def profile_agent(profile: Any) -> "AgentInfo":
    """An agent known only by its device profile (nothing measured): what a prediction before
    any registration prices."""
    from sfl_core.fleet import AgentInfo
    return AgentInfo(agent_id=profile.name, index=0, profile=profile, measured={}, label_counts=[], num_samples=0)


def fleet_round_time(cfg: "RunConfig", cost: "SplitCost", profiles: Sequence[Any]) -> float:
    """A synchronous round of ``cfg`` at one cut for a fleet of device ``profiles``: the slowest
    device's :func:`price_option` at the run's codec and batch. What "the fastest cut for this
    fleet" means."""
    ratio = nominal_ratio(cfg.codec)
    return max(price_option(cfg, cost, cfg.codec, profile_agent(p), ratio=ratio).time(cfg.batch_size)
               for p in profiles)


def wire_fraction(codec_ratio: float, width: int, channels: int) -> float:
    """Activation bytes on the wire over fp32: the codec's ratio, times ``width / channels`` where a
    bottleneck of ``width`` channels (0: none) crosses instead of the cut's ``channels``."""
    return codec_ratio * (width / channels if width else 1.0)


def cut_wire_fraction(cost: "SplitCost", codec: str, width: int) -> float:
    """:func:`wire_fraction` of ``codec``'s nominal ratio at the cut ``cost`` describes."""
    channels = cost.activation_shape[0] if cost.activation_shape else 1
    return wire_fraction(nominal_ratio(codec), width, channels)
