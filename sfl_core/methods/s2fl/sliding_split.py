"""S2FL adaptive sliding split (docs/methods.md §5; S2FL paper, Yan et al. 2023): candidate splits,
client time table, median rule.

Why: with one split for everybody, fast agents wait for slow ones. S2FL keeps K candidate
split points and gives each agent the one whose recorded round time is closest to the
median of all the selected agents' times, so per-agent round times bunch together.

The model has a fixed *client part* (``blocks[:min(candidates)]``, always on the agent), a
*shared part* the split slides over, and a fixed *server part* (``blocks[max(candidates):]``,
always on the coordinator). The paper uses three split layers per model; so do we. The
candidates are chosen so client FLOPs (and, mostly, activation bytes) change meaningfully
from one to the next: an early cut suits a slow processor, a late one (small activations)
a slow link. Numbers from :func:`sfl_core.model.accounting.model_costs` (10 classes): client
forward+backward FLOPs per sample | activation bytes per sample | ratio of consecutive
client FLOPs:

| model | candidates (cut after) | 1x28x28 FLOPs | 1x28x28 act | ratios | 3x32x32 FLOPs | 3x32x32 act | ratios |
|---|---|---|---|---|---|---|---|
| small_cnn | 1, 2, 3 (conv1, conv2, fc1) | 0.45M / 22.1M / 24.5M | 49K / 24K / 256B | 49 / 1.11 | 1.77M / 30.1M / 33.2M | 64K / 32K / 256B | 17 / 1.10 |
| resnet8 | 2, 3, 4 (layer1, layer2, layer3) | 22.1M / 39.0M / 55.8M | 49K / 24K / 12K | 1.76 / 1.43 | 30.1M / 52.1M / 74.1M | 64K / 32K / 16K | 1.73 / 1.42 |
| vgg_mini | 1, 2, 4 (conv1, conv2, conv4) | 0.45M / 5.87M / 32.4M | 12K / 6K / 2.2K | 13 / 5.5 | 1.77M / 8.85M / 43.5M | 16K / 8K / 4K | 5.0 / 4.9 |
| vgg11 | 2, 4, 6 (conv2, conv4, conv6) | 88.5M / 349M / 540M | 24K / 9K / 2K | 3.94 / 1.55 | 120M / 460M / 800M | 32K / 16K / 8K | 3.82 / 1.74 |
| vgg16 | 2, 4, 7 (conv2, conv4, conv7) | 175M / 435M / 869M | 49K / 24K / 9K | 2.48 / 2.00 | 234M / 573M / 1140M | 64K / 32K / 16K | 2.45 / 1.99 |
| alexnet | 2, 4, 5 (conv2, conv4, conv5) | 132M / 587M / 760M | 37K / 49K / 9K | 4.45 / 1.30 | 177M / 771M / 998M | 48K / 64K / 16K | 4.36 / 1.29 |
| mobilenet_v1 | 3, 5, 7 (dw2, dw4, dw6) | 50.4M / 153M / 262M | 98K / 49K / 32K | 3.03 / 1.71 | 68.2M / 202M / 335M | 128K / 64K / 32K | 2.96 / 1.66 |
| cnn1d (9x128) | 1, 2, 3 (conv1, conv2, conv3) | 1.47M / 17.2M / 26.6M | 16K / 16K / 8K | 11.7 / 1.55 | | | |

(K = 1024 bytes.) small_cnn has only four blocks, so its last step is small in FLOPs
(1.1x) but cuts the activations 100-fold; alexnet's last step is 1.3x in FLOPs and 4-5x in
bytes. Run configs may override the candidates (``s2fl.candidates``).

Time table semantics: a *measured* entry (:meth:`ClientTimeTable.record`) replaces an
estimate and any earlier measurement of the same (agent, split) — the paper updates the
table with every round, and the newest measurement reflects the device's current load.
An *estimate* (:meth:`ClientTimeTable.set_estimate`, from :func:`estimate_round_time`)
only fills a gap and never overwrites a measurement.
"""

from __future__ import annotations

import math
import numbers
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence

from sfl_core.model.accounting import SplitCost
from sfl_core.model.zoo import candidate_splits
from sfl_core.timing import agent_round_time

__all__ = ["TimeEntry", "ClientTimeTable", "warmup_split",
           "median_rule", "estimate_round_time", "fleet_round_time"]

# ====================================================================== client time table


@dataclass
class TimeEntry:
    """One cell of the client time table."""

    seconds: float
    estimated: bool
    round: int
    """Round in which the time was measured (0 for estimates)."""


def _check_seconds(seconds: float, what: str) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what}: round time must be a finite number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def _check_split(split: int, what: str) -> int:
    if isinstance(split, bool) or not isinstance(split, numbers.Integral) or split < 1:
        raise ValueError(f"{what}: split must be an integer >= 1, got {split!r}")
    return int(split)


class ClientTimeTable:
    """Per agent and per candidate split, the round time (S2FL's client time table).

    Measured entries replace estimates and earlier measurements; estimates only fill gaps.
    JSON-safe (:meth:`to_json` / :meth:`from_json`) so the coordinator keeps it across restarts.
    """

    def __init__(self) -> None:
        self._t: dict[str, dict[int, TimeEntry]] = {}

    def record(self, agent: str, split: int, seconds: float, round: int) -> None:
        """A measured round time (replaces whatever was there)."""
        what = f"time table record({agent!r}, {split!r})"
        s, sec = _check_split(split, what), _check_seconds(seconds, what)
        if isinstance(round, bool) or not isinstance(round, numbers.Integral) or round < 0:
            raise ValueError(f"{what}: round must be an integer >= 0, got {round!r}")
        self._t.setdefault(str(agent), {})[s] = TimeEntry(sec, False, int(round))

    def set_estimate(self, agent: str, split: int, seconds: float) -> None:
        """An estimated round time; ignored when a measured entry exists."""
        what = f"time table set_estimate({agent!r}, {split!r})"
        s, sec = _check_split(split, what), _check_seconds(seconds, what)
        row = self._t.setdefault(str(agent), {})
        old = row.get(s)
        if old is None or old.estimated:
            row[s] = TimeEntry(sec, True, 0)

    def get(self, agent: str, split: int) -> Optional[TimeEntry]:
        return self._t.get(str(agent), {}).get(int(split))

    def agents(self) -> list[str]:
        """Agents with at least one entry, sorted."""
        return sorted(a for a, row in self._t.items() if row)

    def splits(self) -> list[int]:
        """Every split with at least one entry, ascending."""
        return sorted({s for row in self._t.values() for s in row})

    def times(self, agents: Sequence[str], splits: Sequence[int]) -> list[float]:
        """All known entries (measured or estimated) of ``agents`` x ``splits``, row by row."""
        return [e.seconds for a in agents for s in splits if (e := self.get(a, s)) is not None]

    def __len__(self) -> int:
        return sum(len(row) for row in self._t.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClientTimeTable) and self._t == other._t

    def to_json(self) -> dict[str, Any]:
        """``{agent: {str(split): {"seconds", "estimated", "round"}}}`` (JSON object keys are strings)."""
        return {a: {str(s): asdict(e) for s, e in sorted(row.items())} for a, row in sorted(self._t.items())}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ClientTimeTable":
        """Inverse of :meth:`to_json`; raises ``ValueError`` on a malformed table."""
        if not isinstance(d, Mapping):
            raise ValueError(f"client time table: expected a JSON object, got {type(d).__name__}")
        table = cls()
        for a, row in d.items():
            if not isinstance(row, Mapping):
                raise ValueError(f"client time table: row of agent {a!r} must be an object, got {row!r}")
            for s, e in row.items():
                try:
                    split = int(s)
                    entry = TimeEntry(_check_seconds(e["seconds"], f"agent {a!r} split {s}"),
                                      bool(e["estimated"]), int(e["round"]))
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"client time table: bad entry for agent {a!r} split {s!r}: {e!r} ({exc})") from None
                table._t.setdefault(str(a), {})[_check_split(split, f"agent {a!r}")] = entry
        return table

    def format(self, splits: Sequence[int]) -> str:
        """Text table: one row per agent, one column per split; ``*`` marks estimates, ``-`` gaps."""
        width = max(12, *(len(f"split {s}") + 2 for s in splits)) if splits else 12
        name_w = max([5, *(len(a) for a in self.agents())]) + 2
        lines = [f"{'agent':<{name_w}}" + "".join(f"{'split ' + str(s):>{width}}" for s in splits)]
        for a in self.agents():
            cells = []
            for s in splits:
                e = self.get(a, s)
                cells.append(f"{'-':>{width - 1}} " if e is None
                             else f"{e.seconds:>{width - 1}.3f}{'*' if e.estimated else ' '}")
            lines.append(f"{a:<{name_w}}" + "".join(cells))
        lines.append("(seconds per round; * = estimated, - = unknown)")
        return "\n".join(lines)


# ====================================================================== the S2FL rules


def warmup_split(round_index: int, candidates: Sequence[int]) -> Optional[int]:
    """Rounds ``1..K`` use ``candidates[round_index - 1]`` for every agent (so each column of
    the table fills); ``None`` once the warm-up is over (or for round 0 / negative rounds)."""
    if 1 <= round_index <= len(candidates):
        return candidates[round_index - 1]
    return None


def median_rule(table: ClientTimeTable, agents: Sequence[str], candidates: Sequence[int]) -> dict[str, int]:
    """S2FL: each selected agent gets the candidate whose time is closest to the median of the
    selected agents' x·K times.

    Only known entries (measured or estimated) count; a split an agent has no entry for is
    skipped for that agent. Ties (equal distance to the median, within 1e-9 relative) go
    to the *smaller* split: less work and memory on the device, and the server copy — which
    has the GPU — takes the extra layers. Raises ``ValueError`` for no candidates or an
    agent with no entry at all (the caller must :meth:`~ClientTimeTable.set_estimate` first).
    """
    if not candidates:
        raise ValueError("median_rule: no candidate splits")
    agents = list(dict.fromkeys(agents))                 # a duplicate must not weigh twice
    cands = sorted(set(int(s) for s in candidates))
    missing = [a for a in agents if all(table.get(a, s) is None for s in cands)]
    if missing:
        raise ValueError(f"median_rule: agent(s) {missing} have no time-table entry for candidates {cands}; "
                         f"estimate them first")
    times = table.times(agents, cands)
    if not times:
        return {}
    median = statistics.median(times)
    tol = 1e-9 * max(1.0, abs(median))
    out: dict[str, int] = {}
    for a in agents:
        best_split, best_gap = None, math.inf
        for s in cands:                                  # ascending: a tie keeps the smaller split
            e = table.get(a, s)
            if e is not None and abs(e.seconds - median) < best_gap - tol:
                best_split, best_gap = s, abs(e.seconds - median)
        assert best_split is not None
        out[a] = best_split
    return out


def estimate_round_time(cost: SplitCost, *, samples: int, compute_flops: float, uplink_bytes_per_s: float,
                        downlink_bytes_per_s: float, server_flops_per_s: float, latency_s: float = 0.0,
                        messages: int = 0, bytes_per_activation: Optional[float] = None,
                        measured_compute_s_per_sample: Optional[float] = None, wire_ratio: float = 1.0) -> float:
    """S2FL Eq. 1 (docs/methods.md §3) for an (agent, split) never measured, via :func:`sfl_core.timing.agent_round_time`.

    ``T = (2|Wc| + 2·p·q) / R + F_c / Comp_c + F_s / Comp_s`` with the transfer split by
    direction: weights down and up (``client_param_bytes`` each way), activations up and
    gradients down (``samples · q`` each way; ``q`` = ``cost.activation_bytes`` at fp32, or
    ``bytes_per_activation`` for a compressed wire), plus ``messages`` one-way latencies.
    ``wire_ratio`` (encoded / fp32 bytes, as measured on the wire) scales all of those bytes,
    so an estimate charges what the virtual clock will charge for the real encoded messages.
    Client compute is ``measured_compute_s_per_sample · samples`` when the agent measured
    it (real devices rarely reach their nominal FLOP/s), else
    ``client_flops · samples / compute_flops``; server compute is
    ``server_flops · samples / server_flops_per_s``.
    """
    if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples < 0:
        raise ValueError(f"estimate_round_time: samples must be an integer >= 0, got {samples!r}")
    for name, v in (("compute_flops", compute_flops), ("uplink_bytes_per_s", uplink_bytes_per_s),
                    ("downlink_bytes_per_s", downlink_bytes_per_s), ("server_flops_per_s", server_flops_per_s)):
        if not (isinstance(v, numbers.Real) and math.isfinite(v) and v > 0):
            raise ValueError(f"estimate_round_time: {name} must be a finite number > 0, got {v!r}")
    for name, v in (("latency_s", latency_s), ("bytes_per_activation", bytes_per_activation),
                    ("measured_compute_s_per_sample", measured_compute_s_per_sample)):
        if v is not None and not (isinstance(v, numbers.Real) and math.isfinite(v) and v >= 0):
            raise ValueError(f"estimate_round_time: {name} must be a finite number >= 0, got {v!r}")
    act = cost.activation_bytes if bytes_per_activation is None else float(bytes_per_activation)
    if measured_compute_s_per_sample is not None:
        client_flops = measured_compute_s_per_sample * samples * compute_flops   # seconds x FLOP/s
    else:
        client_flops = cost.client_flops * samples
    if not (isinstance(wire_ratio, numbers.Real) and math.isfinite(wire_ratio) and wire_ratio > 0):
        raise ValueError(f"estimate_round_time: wire_ratio must be a finite number > 0, got {wire_ratio!r}")
    one_way = (cost.client_param_bytes + samples * act) * wire_ratio
    t = agent_round_time(
        client_flops=client_flops, server_flops=cost.server_flops * samples,
        bytes_up=one_way, bytes_down=one_way,
        client_flops_per_s=compute_flops, server_flops_per_s=server_flops_per_s,
        uplink_bytes_per_s=uplink_bytes_per_s, downlink_bytes_per_s=downlink_bytes_per_s,
        latency_s=latency_s, messages=messages)
    return t.total_s


def fleet_round_time(cost: SplitCost, profiles: Sequence[Any], *, samples: int, server_flops_per_s: float) -> float:
    """A synchronous round at one split for a fleet of device ``profiles`` (objects with
    ``compute_flops``, ``link_bytes_per_s``, ``downlink_bytes_per_s``, ``latency_s``): the
    slowest device's :func:`estimate_round_time`. What "the fastest cut for this fleet" means."""
    return max(estimate_round_time(cost, samples=samples, compute_flops=p.compute_flops,
                                   uplink_bytes_per_s=p.link_bytes_per_s, downlink_bytes_per_s=p.downlink_bytes_per_s,
                                   server_flops_per_s=server_flops_per_s, latency_s=p.latency_s) for p in profiles)
