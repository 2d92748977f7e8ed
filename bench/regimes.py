"""Which method reaches a target accuracy first, and in which system regime: FedAvg, SFL, S2FL,
HeteroSFL, MergeSFL and FedFC over two axes.

    python bench/regimes.py                 # full: real training on 2 cores (~8 min idle) + the sweep
    python bench/regimes.py --quick         # smoke test (numbers not meaningful)
    python bench/regimes.py --rounds-from bench/results/regimes.json   # re-sweep from stored runs

The two axes:

(a) **model against activations**, one panel per workload (a model, its input shape and the
    split the fixed-split methods use): ``rho = |Wc| / (p·q)``, the client portion's weight
    bytes against one round's activation bytes (``p = batch·tau`` samples of ``q`` bytes; both
    move twice a round: weights down and up, activations up and gradients down). ``rho_full =
    |W| / (p·q)`` is the same with the whole model, what FedAvg moves. The panels are real
    models of ``sfl_core.model.zoo`` at a CIFAR-10 input (3x32x32; small_cnn at Fashion-MNIST's
    1x28x28), chosen so ``rho`` spans four decades: MobileNet cut early (activations
    dominate), ResNet-8, VGG-16, VGG-11, and small_cnn cut after its big fully connected
    layer (weights dominate). ``--panels model@split`` picks others.
(b) **compute heterogeneity against link heterogeneity**: a fleet of ``--agents`` (10) agents
    whose FLOP/s are log-spaced over a max/min ratio in ``--ratios`` (1, 4, 16, 64) around
    ``--centre-compute`` (1e10 FLOP/s, the S2FL paper's 'mid' class) and whose link rates are
    log-spaced over the same ratios around ``--centre-link`` (2e6 B/s, 'mid'). Geometric
    centring keeps the fleet's typical device fixed, so a cell differs from its neighbours
    only in spread. Compute rank and link rank are paired by a fixed permutation with
    (almost) zero rank correlation (``--pairing``; also ``aligned`` or ``opposed``).

What is MEASURED and what is MODELLED:

- Rounds to a target accuracy are measured: short real training runs (``--rounds`` 20,
  ``--seeds`` 2) through the product's engine (``simulation.run_simulation``: real data,
  real models, real aggregation) of every method on ``small_cnn`` cut after conv2 (its
  default split), Fashion-MNIST, ``--agents`` agents all selected every round, Dirichlet
  label skew a = 0.5, on one fleet of the grid (compute and link ratio 16, written as device
  profiles in ``--work``). The target is ``--target-fraction`` (0.95) of the worst method's
  best seed-mean accuracy, so every method reaches it; a method's rounds to target is the
  first round whose seed-mean accuracy reaches it, and its seeds' own first rounds give a
  spread. HeteroSFL trains twice: with the widths the product derives from the link rates,
  and with the slow group at 1/16 of the full width; a cell's HeteroSFL rounds are
  interpolated in log(compression) between the two and held constant outside them.
- Per-round times are modelled: the time model of the S2FL paper (Eq. 1) via
  ``sfl_core.timing.agent_round_time``, ``T = (2|Wc| + 2·p·q)/R + p·F_c/C + p·F_s/C_server``,
  with each panel model's FLOPs (torch's flop counter) and fp32 bytes
  (``sfl_core.model.accounting.model_costs``), no latency, no server contention; a synchronous
  round lasts as long as its slowest agent. Time to target = rounds x round time (S2FL: its
  K warm-up rounds at each candidate split for everybody, then the steady split plan).
- Transfers of the measured rounds, i.e. the assumptions: the rounds measured on small_cnn
  hold for every panel's model (the methods' relative convergence carries over, not the
  absolute numbers); and they hold on every fleet of the grid, although MergeSFL's batch
  spread, S2FL's and FedFC's split mixes and HeteroSFL's widths (beyond the interpolation)
  were trained on the 16x16 fleet only. A cell's winner is marked ``*`` when its plan lies
  well outside the trained one (MergeSFL: fewer than half the trained run's effective
  contributors ``(sum d)^2 / sum d^2``; HeteroSFL: more compression than trained), and
  hatched when the seeds' spread of rounds could change the winner (its slowest seed is
  not faster than every other method's fastest seed). With 2 seeds that spread is wide
  (10 to 14 rounds for FedAvg): differences of a few rounds between methods are noise.
- Check of the model against the engine: ``engine_check`` in the JSON puts the modelled
  round time of the training configuration (small_cnn, its split, the training fleet) next
  to the engine's virtual round times, which charge the real encoded message bytes.

Methods (the training runs use the same switches):

- ``FedAvg`` (McMahan et al., 2017): the whole model on every agent; moves ``2|W|``.
- ``SFL``: SplitFed v1 (Thapa et al., AAAI 2022), the panel's split for everybody, one server
  copy per agent. Each cell also records the best single candidate split for reference
  (``sfl_best_candidate_split``): where S2FL beats SFL on an even fleet, it is because a
  cheaper split is among its candidates, not because of the sliding.
- ``S2FL`` (Yan et al., 2023, 'Have Your Cake and Eat It Too: Toward Efficient and Accurate
  Split Federated Learning'): sliding split + data-balance groups. Each agent takes the
  candidate split whose round time is closest to the median of all agents x candidates times
  (``sfl_core.methods.s2fl.sliding_split.median_rule``; the model's candidates in
  ``sfl_core.model.zoo.CANDIDATE_SPLITS``). The median rule equalises, it does not
  minimise: on an even fleet everybody gets the median candidate.
- ``HeteroSFL`` (HeteroSFL: Split Federated Learning with Heterogeneous Clients and Non-IID
  Data, ICLR 2024 submission; Chen et al., IEEE IoT Journal 2025): two link-rate groups, the
  bottleneck width of a group proportional to its slowest member's rate, the fastest group
  at the full channel count (``sfl_core.methods.heterosfl.groups``); activation bytes scale by width/full.
  The 1x1 encoder/decoder's weights and FLOPs are added; BDKS (on in training) doubles the
  server FLOPs of the wider group; logit-calibrated loss.
- ``MergeSFL`` (Liao et al., 2023, 'MergeSFL: Split Federated Learning with Feature Merging
  and Batch Size Regulation'): feature merging + batch regulation, worker selection off.
  Modelled as batches ``d_i`` in ``[1, --merge-cap x batch]`` (the paper's largest batch D;
  4 x 32 = 128) that make every agent finish together, weight transfer included
  (water-filling), with the same total samples per round as the others (``agents x
  batch``). In training: the product's Eq. 9 regulation, ``max_batch`` set so the first
  round's batches sum to about that total.
- ``FedFC`` (Chung et al., 2023, 'Federated Feature Concatenate Method for Heterogeneous
  Computing in Federated Learning'): a split per device class, deeper for faster devices:
  agents are binned by log FLOP/s into as many classes as the model has candidate splits,
  slowest class at the shallowest candidate (links are not considered); with equal devices,
  everybody at the panel's split. One merged server pass.

Outputs: ``regimes.json`` (every cell's fleet and, per method, the round time, the split /
width / batch plan, rounds and time to target with its seed range; the measured rounds with
their source runs: config and curve; the engine check; win counts) and ``regimes.png`` (one
panel per workload: x compute ratio, y link ratio, each cell coloured by the method that
reaches the target first and annotated with its speed-up over the runner-up and over FedAvg).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

import common  # noqa: E402  (puts the repo root on sys.path)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sfl_core.model.accounting import SplitCost, model_costs  # noqa: E402
from sfl_core.methods.heterosfl.groups import group_by_link_rate, widths_for_groups  # noqa: E402
from sfl_core.model.zoo import CANDIDATE_SPLITS
from sfl_core.estimates import ClientTimeTable  # noqa: E402
from sfl_core.methods.s2fl.sliding_split import median_rule  # noqa: E402
from sfl_core.timing import agent_round_time, round_time  # noqa: E402

METHODS = ("FedAvg", "SFL", "S2FL", "HeteroSFL", "MergeSFL", "FedFC")
COLOURS = {"FedAvg": "#8c8c8c", "SFL": "#1f77b4", "S2FL": "#2ca02c", "HeteroSFL": "#d62728",
           "MergeSFL": "#ff7f0e", "FedFC": "#9467bd"}
RATIOS = (1, 4, 16, 64)
CIFAR = (3, 32, 32)
FMNIST = (1, 28, 28)
# model@split; sorted by rho at batch 32 x tau 5 (see the module docstring)
DEFAULT_PANELS = ("mobilenet_v1@3", "resnet8@4", "vgg16@7", "vgg11@6", "small_cnn@3")
QUICK_PANELS = ("resnet8@4", "small_cnn@3")
TRAIN_MODEL, TRAIN_SPLIT = "small_cnn", 2
HETERO_NARROW = 16          # the second HeteroSFL run: slow group at full width / 16
TRAIN_RATIO = 16            # the training fleet: compute ratio = link ratio = 16
BENCH_METHODS = METHODS + ("HeteroSFL-narrow",)


# ============================================================================ fleets


def log_spaced(centre: float, ratio: float, n: int) -> list[float]:
    """``n`` values whose max/min is ``ratio``, log-spaced, geometric mean ``centre``."""
    if n == 1:
        return [float(centre)]
    return [float(centre) * float(ratio) ** (j / (n - 1) - 0.5) for j in range(n)]


@functools.lru_cache(maxsize=None)
def _pairing(n: int, kind: str) -> tuple[int, ...]:
    if kind == "aligned" or n < 3:
        return tuple(range(n))
    if kind == "opposed":
        return tuple(range(n - 1, -1, -1))
    if kind != "independent":
        raise ValueError(f"pairing {kind!r}: expected independent, aligned or opposed")
    rng = np.random.default_rng(0)
    idx = np.arange(n)
    upper = np.triu_indices(n, 1)
    best, best_key = list(range(n)), math.inf
    for _ in range(2000):
        p = rng.permutation(n)
        rho = float(np.corrcoef(idx, p)[0, 1])
        tau = float(np.sign(p[None, :] - p[:, None])[upper].mean())
        key = abs(rho) + abs(tau)
        if key < best_key - 1e-12:
            best, best_key = p.tolist(), key
    return tuple(best)


def pairing(n: int, kind: str = "independent") -> list[int]:
    """Link rank of the agent with compute rank ``j``. ``independent``: a fixed permutation
    with (almost) zero Spearman and Kendall correlation (best of 2,000 seeded draws)."""
    return list(_pairing(int(n), kind))


def make_fleet(compute_ratio: float, link_ratio: float, n: int, centre_compute: float, centre_link: float,
               kind: str = "independent") -> list[tuple[float, float]]:
    """(FLOP/s, link B/s) per agent, agents in ascending compute order."""
    comp = log_spaced(centre_compute, compute_ratio, n)
    link = log_spaced(centre_link, link_ratio, n)
    perm = pairing(n, kind)
    return [(comp[j], link[perm[j]]) for j in range(n)]


# ============================================================================ workloads


def parse_panel(spec: str) -> tuple[str, int, tuple[int, ...]]:
    """``model@split`` or ``model@split@C,H,W``; default input 3x32x32 (small_cnn 1x28x28)."""
    parts = spec.split("@")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"panel {spec!r}: expected model@split or model@split@C,H,W")
    shape = common.parse_shape(parts[2]) if len(parts) == 3 else (FMNIST if parts[0] == "small_cnn" else CIFAR)
    return parts[0], int(parts[1]), shape


class Workload:
    """One panel: model costs at every split, the fixed split, candidates, samples per round."""

    def __init__(self, model: str, split: int, input_shape: Sequence[int], *, batch: int, tau: int,
                 server_flops: float, num_classes: int = 10, merge_max_batch: float | None = None):
        self.model, self.split, self.input_shape = model, int(split), tuple(input_shape)
        self.costs: dict[int, SplitCost] = model_costs(model, self.input_shape, num_classes)
        self.whole = max(self.costs)
        if self.split not in self.costs or self.split == self.whole:
            raise ValueError(f"{model}: split {split} is not a proper split point {sorted(self.costs)[:-1]}")
        self.candidates = tuple(CANDIDATE_SPLITS.get(model, (self.split,)))
        self.batch, self.tau, self.server_flops = int(batch), int(tau), float(server_flops)
        self.samples = self.batch * self.tau
        self.merge_max_batch = merge_max_batch   # MergeSFL's largest batch D (None: no cap)

    def describe(self) -> dict[str, Any]:
        c, w = self.costs[self.split], self.costs[self.whole]
        pq = self.samples * c.activation_bytes
        return {"name": f"{self.model}@{self.split}", "model": self.model, "input_shape": list(self.input_shape),
                "split": self.split, "candidates": list(self.candidates), "samples_per_round": self.samples,
                "model_bytes": w.client_param_bytes, "client_bytes": c.client_param_bytes,
                "activation_bytes_per_sample": c.activation_bytes, "activation_shape": list(c.activation_shape),
                "activation_bytes_per_round": pq,
                "rho": c.client_param_bytes / pq, "rho_full": w.client_param_bytes / pq,
                "model_flops_per_sample": w.client_flops, "client_flops_per_sample": c.client_flops,
                "server_flops_per_sample": c.server_flops}


def agent_time(w: Workload, split: int, compute: float, link: float, *, samples: float | None = None,
               act_scale: float = 1.0, extra_bytes: float = 0.0, extra_client_flops: float = 0.0,
               extra_server_flops: float = 0.0, server_mult: float = 1.0) -> float:
    """One agent's round (S2FL Eq. 1) at ``split``: weights down and up, activations up and
    gradients down for ``samples`` samples, client compute, server compute."""
    c = w.costs[split]
    p = w.samples if samples is None else samples
    one_way = c.client_param_bytes + extra_bytes + p * c.activation_bytes * act_scale
    return agent_round_time(
        client_flops=p * (c.client_flops + extra_client_flops),
        server_flops=p * (c.server_flops + extra_server_flops) * server_mult,
        bytes_up=one_way, bytes_down=one_way, client_flops_per_s=compute, server_flops_per_s=w.server_flops,
        uplink_bytes_per_s=link, downlink_bytes_per_s=link).total_s


# ============================================================================ the methods' round times


def fedavg_round(w: Workload, fleet: Sequence[tuple[float, float]]) -> dict[str, Any]:
    return {"round_s": round_time(agent_time(w, w.whole, c, r) for c, r in fleet)}


def sfl_round(w: Workload, fleet: Sequence[tuple[float, float]], split: int | None = None) -> dict[str, Any]:
    s = w.split if split is None else split
    return {"round_s": round_time(agent_time(w, s, c, r) for c, r in fleet), "split": s}


def s2fl_round(w: Workload, fleet: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Median rule over the model's candidates (steady state) and the K warm-up rounds."""
    ids = [f"a{i}" for i in range(len(fleet))]
    table = ClientTimeTable()
    for a, (c, r) in zip(ids, fleet):
        for s in w.candidates:
            table.set_estimate(a, s, agent_time(w, s, c, r))
    plan = median_rule(table, ids, w.candidates)
    times = [table.get(a, plan[a]).seconds for a in ids]
    return {"round_s": round_time(times), "splits": [plan[a] for a in ids],
            "warmup_round_s": [sfl_round(w, fleet, s)["round_s"] for s in w.candidates]}


def hetero_plan(w: Workload, fleet: Sequence[tuple[float, float]], groups: int = 2,
                fixed: Sequence[int] | None = None) -> tuple[list[int], list[int], int]:
    """Per agent (group index, width), and the full width, as the product's planner does."""
    c = w.costs[w.split]
    full = int(c.activation_shape[0])
    ids = [f"a{i}" for i in range(len(fleet))]
    rates = {a: r for a, (_, r) in zip(ids, fleet)}
    grouped = group_by_link_rate(rates, groups=groups)
    widths = widths_for_groups([min(rates[a] for a in g) for g in grouped], full, fixed=fixed)
    gi = {a: i for i, g in enumerate(grouped) for a in g}
    wi = {a: wd for g, wd in zip(grouped, widths) for a in g}
    return [gi[a] for a in ids], [wi[a] for a in ids], full


def hetero_round(w: Workload, fleet: Sequence[tuple[float, float]], bdks: bool = True) -> dict[str, Any]:
    c = w.costs[w.split]
    group, width, full = hetero_plan(w, fleet)
    spatial = math.prod(c.activation_shape[1:]) if len(c.activation_shape) > 1 else 1
    times = []
    for (comp, link), g, wd in zip(fleet, group, width):
        coder_flops = 6.0 * full * wd * spatial          # 1x1 conv / linear, forward + backward
        times.append(agent_time(w, w.split, comp, link, act_scale=wd / full, extra_bytes=4.0 * (full * wd + wd),
                                extra_client_flops=coder_flops, extra_server_flops=coder_flops,
                                server_mult=2.0 if bdks and g > 0 else 1.0))
    return {"round_s": round_time(times), "widths": width, "full_width": full,
            "compression": full / min(width)}


def effective_agents(batches: Sequence[float]) -> float:
    """How many equal contributors a batch split amounts to: ``(sum d)^2 / sum d^2``."""
    return sum(batches) ** 2 / sum(d * d for d in batches)


def mergesfl_round(w: Workload, fleet: Sequence[tuple[float, float]], min_batch: float = 1.0,
                   max_batch: float | None = None) -> dict[str, Any]:
    """Batches in ``[min_batch, max_batch]`` that make every agent finish together (weights
    included; water-filling), summing to agents x batch."""
    c = w.costs[w.split]
    total = w.batch * len(fleet)
    cap = float(max_batch if max_batch is not None else w.merge_max_batch or total)
    fixed = [2 * c.client_param_bytes / r for _, r in fleet]
    per_batch = [w.tau * (c.client_flops / comp + c.server_flops / w.server_flops + 2 * c.activation_bytes / r)
                 for comp, r in fleet]

    def batches(t: float) -> list[float]:
        return [min(cap, max(float(min_batch), (t - f) / a)) for f, a in zip(fixed, per_batch)]
    lo, hi = 0.0, max(fixed) + total * max(per_batch)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if sum(batches(mid)) < total else (lo, mid)
    d = batches(hi)
    times = [agent_time(w, w.split, comp, r, samples=w.tau * b) for (comp, r), b in zip(fleet, d)]
    return {"round_s": round_time(times), "batches": [round(b, 3) for b in d], "max_batch": cap,
            "effective_agents": effective_agents(d)}


def fedfc_splits(computes: Sequence[float], candidates: Sequence[int], default: int) -> list[int]:
    """Device classes by log FLOP/s, one per candidate, slowest at the shallowest cut; with equal
    devices everybody keeps ``default``."""
    lo, hi = min(computes), max(computes)
    if hi <= lo * (1 + 1e-9):
        return [default] * len(computes)
    k = len(candidates)
    return [candidates[min(k - 1, int(k * math.log(c / lo) / math.log(hi / lo)))] for c in computes]


def fedfc_round(w: Workload, fleet: Sequence[tuple[float, float]]) -> dict[str, Any]:
    splits = fedfc_splits([c for c, _ in fleet], w.candidates, w.split)
    return {"round_s": round_time(agent_time(w, s, c, r) for s, (c, r) in zip(splits, fleet)), "splits": splits}


ROUND_FNS = {"FedAvg": fedavg_round, "SFL": sfl_round, "S2FL": s2fl_round, "HeteroSFL": hetero_round,
             "MergeSFL": mergesfl_round, "FedFC": fedfc_round}


def time_to_target(method: str, plan: Mapping[str, Any], rounds: float) -> float:
    """Rounds x round time; S2FL's first K rounds run each candidate split for everybody."""
    if method == "S2FL":
        warm = plan["warmup_round_s"]
        k = min(len(warm), int(rounds))
        return sum(warm[:k]) + max(0.0, rounds - len(warm)) * plan["round_s"]
    return rounds * plan["round_s"]


def hetero_rounds(compression: float, measured: Mapping[str, Any], key: str = "rounds") -> float:
    """HeteroSFL's rounds at a slow-group compression: log-linear between the two measured runs,
    held constant outside them (``key``: ``rounds``, or ``rounds_lo`` / ``rounds_hi`` for the seeds' spread)."""
    (c0, n0), (c1, n1) = sorted((float(v["compression"]), float(v.get(key) or v["rounds"]))
                                for v in measured.values())
    if compression <= c0 or c1 <= c0:
        return n0
    if compression >= c1:
        return n1
    f = math.log(compression / c0) / math.log(c1 / c0)
    return n0 + f * (n1 - n0)


def sweep_panel(w: Workload, rounds: Mapping[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Every cell of one panel: each method's plan, round time, rounds and time to target."""
    cells = []
    for cr in args.ratios:
        for lr in args.ratios:
            fleet = make_fleet(cr, lr, args.agents, args.centre_compute, args.centre_link, args.pairing)
            methods: dict[str, Any] = {}
            for m in METHODS:
                plan = ROUND_FNS[m](w, fleet)
                n = {k: (hetero_rounds(plan["compression"], rounds["heterosfl_runs"], k) if m == "HeteroSFL"
                         else rounds["methods"][m].get(k) or rounds["methods"][m]["rounds"])
                     for k in ("rounds", "rounds_lo", "rounds_hi")}
                methods[m] = {**plan, "rounds": n["rounds"], "time_to_target_s": time_to_target(m, plan, n["rounds"]),
                              "time_to_target_range_s": [time_to_target(m, plan, n["rounds_lo"]),
                                                         time_to_target(m, plan, n["rounds_hi"])]}
            order = sorted(METHODS, key=lambda m: methods[m]["time_to_target_s"])
            best, second = order[0], order[1]
            t = {m: methods[m]["time_to_target_s"] for m in METHODS}
            # robust: the winner stays first even at its slowest seed against everybody's fastest seed
            robust = all(methods[best]["time_to_target_range_s"][1] < methods[m]["time_to_target_range_s"][0]
                         for m in METHODS if m != best)
            sfl_best = min(w.candidates, key=lambda s: sfl_round(w, fleet, s)["round_s"])
            # the winner's plan beyond what the training runs measured (their rounds are extrapolated)
            eff = rounds["methods"]["MergeSFL"].get("effective_agents")
            beyond = {"MergeSFL": bool(eff) and methods["MergeSFL"]["effective_agents"] < 0.5 * eff,
                      "HeteroSFL": methods["HeteroSFL"]["compression"] > max(
                          float(v["compression"]) for v in rounds["heterosfl_runs"].values()) * (1 + 1e-9)}
            cells.append({"compute_ratio": cr, "link_ratio": lr, "fleet": [[c, r] for c, r in fleet],
                          "winner": best, "runner_up": second,
                          "speedup_vs_runner_up": t[second] / t[best], "speedup_vs_fedavg": t["FedAvg"] / t[best],
                          "robust": robust, "winner_beyond_measured": beyond.get(best, False),
                          "ranking": order, "methods": methods,
                          "sfl_best_candidate_split": {
                              "split": sfl_best, "round_s": sfl_round(w, fleet, sfl_best)["round_s"],
                              "time_to_target_s": time_to_target("SFL", sfl_round(w, fleet, sfl_best),
                                                                 rounds["methods"]["SFL"]["rounds"])}})
    return {**w.describe(), "cells": cells}


# ============================================================================ real training


def train_fleet_profiles(work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The training fleet (compute and link ratio TRAIN_RATIO) as device-profile YAML files."""
    fleet = make_fleet(TRAIN_RATIO, TRAIN_RATIO, args.agents, args.centre_compute, args.centre_link, args.pairing)
    folder = work / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (c, r) in enumerate(fleet):
        name = f"regimes-{i:02d}"
        path = folder / f"{name}.yaml"
        path.write_text(f"name: {name}\ncompute_flops: {c:.6g}\nlink_bytes_per_s: {r:.6g}\nlatency_s: 0.0\n"
                        f"description: 'bench/regimes.py training fleet, agent {i} (compute and link ratio "
                        f"{TRAIN_RATIO} over the fleet)'\nsource: 'synthetic: log-spaced around the S2FL mid class'\n")
        out.append({"name": name, "path": str(path), "compute_flops": c, "link_bytes_per_s": r})
    return out


def merge_max_batch(w: Workload, fleet: Sequence[Mapping[str, Any]], target_total: int) -> int:
    """``max_batch`` D whose Eq. 9 batches (first-round estimates, as the coordinator makes them)
    sum closest to ``target_total``."""
    from sfl_core.methods.mergesfl import control as mergesfl
    c = w.costs[w.split]
    states = {f["name"]: mergesfl.AgentState(mu=c.client_flops / f["compute_flops"],
                                             beta=2 * c.activation_bytes / f["link_bytes_per_s"]) for f in fleet}
    best, best_gap = w.batch, math.inf
    for d in range(w.batch, 4097):
        total = sum(mergesfl.regulate_batches(states, d).values())
        if abs(total - target_total) < best_gap:
            best, best_gap = d, abs(total - target_total)
        if total > target_total:
            break
    return best


def run_configs(args: argparse.Namespace, fleet: Sequence[Mapping[str, Any]], w: Workload) -> dict[str, dict[str, Any]]:
    """Run config (YAML keys) per bench method, same data, fleet and hyper-parameters."""
    base = {"model": TRAIN_MODEL, "split": TRAIN_SPLIT,
            "data": {"dataset": args.dataset, "root": args.root, "partition": "dirichlet", "alpha": args.alpha},
            "fleet": [{"profile": f["path"], "count": 1} for f in fleet], "rounds": args.rounds,
            "per_round": args.agents, "batch_size": args.batch, "lr": args.lr, "momentum": args.momentum,
            "local_iters": args.tau, "eval_samples": args.eval_samples, "codec": "fp32", "zstd_level": 0,
            "server_flops": args.server_flops, "strategy": "sfl", "server_mode": "merged"}
    full = int(w.costs[w.split].activation_shape[0])
    fedfc = fedfc_splits([f["compute_flops"] for f in fleet], w.candidates, w.split)
    return {
        "FedAvg": {**base, "strategy": "fedavg", "split": None},
        "SFL": {**base, "server_mode": "per_agent"},
        "S2FL": {**base, "strategy": "s2fl", "split": None,
                 "s2fl": {"sliding": True, "balance": True, "group_size": 5}},
        "HeteroSFL": {**base, "loss": "calibrated", "hetero": {"width": full, "groups": 2, "bdks": True}},
        "HeteroSFL-narrow": {**base, "loss": "calibrated",
                             "hetero": {"width": full, "groups": 2, "bdks": True,
                                        "widths": [max(1, full // HETERO_NARROW), full]}},
        "MergeSFL": {**base, "mergesfl": {"regulate": True, "select": False,
                                          "max_batch": merge_max_batch(w, fleet, args.batch * args.agents)}},
        "FedFC": {**base, "profile_splits": {f["name"]: s for f, s in zip(fleet, fedfc)}},
    }


CURVE_KEYS = ("round", "accuracy", "round_time_s", "elapsed_s", "bytes_up", "bytes_down")


def run_one(job: tuple[str, int, dict[str, Any], int]) -> dict[str, Any]:
    """One training run through the product's engine (virtual clock)."""
    name, seed, cfg, threads = job
    torch.set_num_threads(threads)
    from simulation import run_simulation
    from sfl_core.config.run import run_config_from_dict
    out = Path(cfg["output_dir"])
    if out.exists():
        shutil.rmtree(out)
    t0 = time.time()
    history, _ = run_simulation(run_config_from_dict(cfg), device="cpu", quiet=True)
    wall = time.time() - t0
    curve = [{k: r.get(k) for k in CURVE_KEYS} for r in history]
    last = history[-1].get("agents") or {}
    plan = {a: {k: v.get(k) for k in ("split", "width", "batch_size")} for a, v in sorted(last.items())}
    print(f"{name:>16} seed {seed}: acc {history[-1]['accuracy']:.4f}  virtual {history[-1]['elapsed_s']:.0f} s  "
          f"({wall:.0f} s wall)", flush=True)
    return {"method": name, "seed": seed, "config": cfg, "wall_s": wall, "curve": curve, "last_round_plan": plan}


def train(args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    """The real runs; returns them with the rounds to target they give."""
    fleet = train_fleet_profiles(args.work, args)
    cfgs = run_configs(args, fleet, w)
    jobs = []
    for m in BENCH_METHODS:
        for seed in range(args.seeds):
            cfg = {**cfgs[m], "run": f"regimes-{m}".replace("+", "p"), "seed": seed,
                   "data": {**cfgs[m]["data"], "seed": seed}, "output_dir": str(args.work / f"{m}-s{seed}")}
            jobs.append((m, seed, {k: v for k, v in cfg.items() if v is not None}, args.threads or 1))
    t0 = time.time()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(run_one, jobs))
    else:
        results = [run_one(j) for j in jobs]
    wall = time.time() - t0
    runs: dict[str, list[dict[str, Any]]] = {}
    for res in results:
        runs.setdefault(res["method"], []).append(res)
    return {"fleet": fleet, "train_ratio": TRAIN_RATIO, "wall_s": wall,
            **rounds_to_target(runs, args.target_fraction, w, fleet), "runs": runs}


def rounds_to_target(runs: Mapping[str, list[dict[str, Any]]], fraction: float, w: Workload,
                     fleet: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    def mean_curve(rs: list[dict[str, Any]]) -> list[float]:
        n = min(len(r["curve"]) for r in rs)
        return [statistics.mean(r["curve"][i]["accuracy"] for r in rs) for i in range(n)]

    def first(curve: Sequence[float], rounds: Sequence[int], target: float) -> int | None:
        return next((rd for a, rd in zip(curve, rounds) if rd >= 1 and a >= target), None)

    curves = {m: mean_curve(rs) for m, rs in runs.items()}
    best = {m: max(c[1:]) for m, c in curves.items()}
    target = fraction * min(best.values())
    out: dict[str, Any] = {"target_accuracy": target, "target_fraction": fraction, "methods": {}}
    for m, rs in runs.items():
        rounds = [rec["round"] for rec in rs[0]["curve"]][:len(curves[m])]
        per_seed = [first([rec["accuracy"] for rec in r["curve"]], [rec["round"] for rec in r["curve"]], target)
                    for r in rs]
        ok = [n for n in per_seed if n is not None]
        out["methods"][m] = {"rounds": first(curves[m], rounds, target), "rounds_per_seed": per_seed,
                             "rounds_lo": min(ok) if len(ok) == len(per_seed) else None,
                             "rounds_hi": max(ok) if len(ok) == len(per_seed) else None,
                             "best_seed_mean_accuracy": best[m],
                             "final_seed_mean_accuracy": statistics.mean(curves[m][-3:]),
                             "source_runs": [f"{m}-s{r['seed']}" for r in rs]}
    if "MergeSFL" in runs:
        last = [v["batch_size"] for v in runs["MergeSFL"][0]["last_round_plan"].values() if v.get("batch_size")]
        out["methods"]["MergeSFL"]["last_round_batches"] = last
        out["methods"]["MergeSFL"]["effective_agents"] = effective_agents(last) if last else None
    profiles = [(f["compute_flops"], f["link_bytes_per_s"]) for f in fleet]
    out["heterosfl_runs"] = {}
    for m in ("HeteroSFL", "HeteroSFL-narrow"):
        fixed = None if m == "HeteroSFL" else [max(1, int(w.costs[w.split].activation_shape[0]) // HETERO_NARROW),
                                               int(w.costs[w.split].activation_shape[0])]
        _, widths, full = hetero_plan(w, profiles, fixed=fixed)
        out["heterosfl_runs"][m] = {"compression": full / min(widths), "widths": widths,
                                    **{k: out["methods"][m][k] for k in ("rounds", "rounds_lo", "rounds_hi")}}
    return out


def engine_check(training: Mapping[str, Any], w: Workload) -> dict[str, Any]:
    """Modelled round time of the training configuration against the engine's virtual round times."""
    fleet = [(f["compute_flops"], f["link_bytes_per_s"]) for f in training["fleet"]]
    w.merge_max_batch = training["runs"]["MergeSFL"][0]["config"].get("mergesfl", {}).get("max_batch")
    out = {}
    for m in METHODS:
        plan = ROUND_FNS[m](w, fleet)
        skip = len(w.candidates) if m == "S2FL" else (1 if m == "MergeSFL" else 0)
        engine = [rec["round_time_s"] for r in training["runs"][m] for rec in r["curve"]
                  if rec["round"] > skip and rec.get("round_time_s") is not None]
        e = statistics.mean(engine) if engine else None
        out[m] = {"model_round_s": plan["round_s"], "engine_round_s_mean": e,
                  "engine_over_model": e / plan["round_s"] if e else None,
                  "rounds_compared": f"rounds > {skip}"}
    return out


def synthetic_rounds(n: int = 10) -> dict[str, Any]:
    """Equal rounds for every method (``--no-train``): the map then compares round times only."""
    return {"target_accuracy": None, "note": "--no-train: every method assumed to need the same rounds",
            "methods": {m: {"rounds": n} for m in BENCH_METHODS},
            "heterosfl_runs": {"HeteroSFL": {"compression": 1.0, "rounds": n},
                               "HeteroSFL-narrow": {"compression": float(HETERO_NARROW), "rounds": n}}}


# ============================================================================ report


def plot(panels: Sequence[Mapping[str, Any]], ratios: Sequence[float], path: Path, subtitle: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    n = len(panels)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 4.7 * rows + 1.0), squeeze=False)
    cmap = ListedColormap([COLOURS[m] for m in METHODS])
    k = len(ratios)
    for ax, panel in zip(axes.flat, panels):
        grid = np.zeros((k, k))
        for cell in panel["cells"]:
            i, j = list(ratios).index(cell["link_ratio"]), list(ratios).index(cell["compute_ratio"])
            grid[i, j] = METHODS.index(cell["winner"])
            fa = "" if cell["winner"] == "FedAvg" else f"\nFedAvg {cell['speedup_vs_fedavg']:.2g}x"
            star = "*" if cell.get("winner_beyond_measured") else ""
            ax.text(j, i, f"{cell['winner']}{star}\n{cell['speedup_vs_runner_up']:.2f}x {cell['runner_up']}{fa}",
                    ha="center", va="center", fontsize=6.3, color="white" if cell["winner"] != "MergeSFL" else "black")
            if not cell.get("robust", True):
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="////", edgecolor="white",
                                       linewidth=0, alpha=0.45))
        ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(METHODS) - 0.5, origin="lower")
        ax.set_xticks(range(k), [f"{r:g}" for r in ratios])
        ax.set_yticks(range(k), [f"{r:g}" for r in ratios])
        ax.set_xlabel("compute max/min")
        ax.set_ylabel("link max/min")
        ax.set_title(f"{panel['name']} ({'x'.join(map(str, panel['input_shape']))})\n"
                     f"|Wc|/pq = {panel['rho']:.2g}, |W|/pq = {panel['rho_full']:.2g}", fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles = [Patch(color=COLOURS[m], label=m) for m in METHODS]
    handles.append(Patch(facecolor="#bbbbbb", hatch="////", edgecolor="white",
                         label="hatched: winner changes within the seeds' spread of rounds"))
    handles.append(Patch(facecolor="none", edgecolor="none",
                         label="*: winner's batch or width plan beyond the measured runs"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7.5, frameon=False)
    fig.suptitle("First to the target accuracy (cell text: winner, its speed-up over the runner-up, over FedAvg)\n"
                 + subtitle, fontsize=9)
    fig.tight_layout(rect=(0, 0.035, 1, 1), h_pad=2.0)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--panels", nargs="*", default=None,
                   help=f"model@split[@C,H,W] (default {' '.join(DEFAULT_PANELS)})")
    p.add_argument("--ratios", nargs="*", type=float, default=list(RATIOS), help="max/min ratios of both axes")
    p.add_argument("--agents", type=int, default=10)
    p.add_argument("--pairing", default="independent", choices=["independent", "aligned", "opposed"],
                   help="how compute rank and link rank go together in a fleet")
    p.add_argument("--centre-compute", type=float, default=1e10, help="geometric-mean FLOP/s of a fleet")
    p.add_argument("--centre-link", type=float, default=2e6, help="geometric-mean link B/s of a fleet")
    p.add_argument("--server-flops", type=float, default=5e10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tau", type=int, default=5)
    p.add_argument("--rounds", type=int, default=20, help="rounds of each training run")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew of the training runs")
    p.add_argument("--eval-samples", type=int, default=1000)
    p.add_argument("--target-fraction", type=float, default=0.95)
    p.add_argument("--merge-cap", type=float, default=4.0,
                   help="MergeSFL's largest batch in the sweep, as a multiple of --batch (the paper's D)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="training runs in parallel, one core each (default: 2, or 1 on a 1-core machine)")
    p.add_argument("--work", type=Path, default=Path("/tmp/sfl-bench-regimes"), help="run directories, profiles")
    p.add_argument("--no-train", action="store_true", help="skip training: equal rounds for every method")
    p.add_argument("--rounds-from", type=Path, default=None,
                   help="reuse the measured rounds (and runs) of an earlier regimes JSON instead of training")
    args = p.parse_args(argv)
    if args.quick:
        args.agents, args.rounds, args.seeds, args.tau, args.batch, args.eval_samples = 4, 2, 1, 2, 8, 200
        args.jobs = 1
        args.panels = args.panels or list(QUICK_PANELS)
        args.ratios = [1.0, 16.0]
    args.panels = args.panels or list(DEFAULT_PANELS)
    common.apply_threads(args)
    args.dataset, args.root = ("fashion-mnist", args.data) if Path(args.data).is_dir() else (args.data, None)
    t_start = time.time()
    data = common.load_data(args.data)
    train_w = Workload(TRAIN_MODEL, TRAIN_SPLIT, data.input_shape, batch=args.batch, tau=args.tau,
                       server_flops=args.server_flops, num_classes=data.num_classes)
    del data
    training: dict[str, Any] | None = None
    if args.rounds_from:
        training = json.loads(args.rounds_from.read_text()).get("training")
        if not training or "runs" not in training:
            raise SystemExit(f"{args.rounds_from}: no training runs in it")
        # recomputed from the stored curves, so --target-fraction applies
        training.update(rounds_to_target(training["runs"], args.target_fraction, train_w, training["fleet"]))
        rounds = training
    elif args.no_train:
        rounds = synthetic_rounds()
    else:
        training = train(args, train_w)
        rounds = training
    panels = [sweep_panel(Workload(m, s, shape, batch=args.batch, tau=args.tau, server_flops=args.server_flops,
                                   merge_max_batch=args.merge_cap * args.batch),
                          rounds, args) for m, s, shape in map(parse_panel, args.panels)]
    panels.sort(key=lambda pn: pn["rho"])
    check = engine_check(training, train_w) if training is not None else None

    r_rows = [[m, v.get("rounds"), str(v.get("rounds_per_seed", "")), common.fmt(v.get("best_seed_mean_accuracy", "-"))]
              for m, v in rounds["methods"].items()]
    target = rounds.get("target_accuracy")
    common.print_table("Rounds to target (measured)", ["method", "rounds", "per seed", "best acc"], r_rows,
                       caption=f"target {target:.3f}" if target else "no training (--no-train)")
    rows = []
    for pn in panels:
        for cell in pn["cells"]:
            t = {m: cell["methods"][m]["time_to_target_s"] for m in METHODS}
            rows.append([pn["name"], f"{cell['compute_ratio']:g}", f"{cell['link_ratio']:g}", cell["winner"],
                         f"{cell['speedup_vs_runner_up']:.2f}x {cell['runner_up']}",
                         f"{cell['speedup_vs_fedavg']:.2f}", *(t[m] for m in METHODS)])
    common.print_table("Time to target (s) by regime", ["panel", "comp", "link", "winner", "vs runner-up",
                                                         "vs FedAvg", *METHODS], rows,
                       caption=f"{args.agents} agents, batch {args.batch} x tau {args.tau}; "
                               f"wall {time.time() - t_start:.0f} s")
    if check:
        common.print_table("Time model against the engine (training configuration)",
                           ["method", "model s/round", "engine s/round", "engine/model"],
                           [[m, v["model_round_s"], v["engine_round_s_mean"], v["engine_over_model"]]
                            for m, v in check.items()])
    wins = {pn["name"]: {m: {"cells": sum(c["winner"] == m for c in pn["cells"]),
                             "robust": sum(c["winner"] == m and c["robust"] for c in pn["cells"])}
                         for m in METHODS} for pn in panels}
    payload = {
        "benchmark": "regimes", "config": common.config_record(args),
        "modelled": "per-round times: S2FL Eq. 1 via sfl_core.timing.agent_round_time with each panel model's "
                    "torch-counted FLOPs and fp32 bytes; synchronous rounds, no latency, no server contention",
        "measured": "rounds to target: real training through simulation.run_simulation on "
                    f"{TRAIN_MODEL}@{TRAIN_SPLIT}, {args.data}, one fleet (compute and link ratio {TRAIN_RATIO})",
        "axes": {"ratios": list(args.ratios), "agents": args.agents, "centre_compute_flops": args.centre_compute,
                 "centre_link_bytes_per_s": args.centre_link, "server_flops": args.server_flops,
                 "pairing": args.pairing, "link_rank_of_compute_rank": pairing(args.agents, args.pairing),
                 "samples_per_round": args.batch * args.tau},
        "rounds_to_target": {k: v for k, v in rounds.items() if k not in ("runs", "fleet")},
        "training": training, "engine_check": check, "wins": wins, "panels": panels,
        "wall_s": time.time() - t_start,
    }
    name = "regimes-quick" if args.quick else "regimes"
    path = common.write_result(args.out, name, payload)
    plot(panels, args.ratios, Path(args.out) / f"{name}.png",
         f"{args.agents} agents, batch {args.batch} x tau {args.tau}; rounds measured on {TRAIN_MODEL}, "
         f"per-round times modelled")
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
