"""S2FL adaptive sliding split (SPEC §4): candidate splits, client time table, median rule.

The model has a fixed client part (``blocks[:min(candidates)]``), a shared middle part the
split slides over, and a fixed server part (``blocks[max(candidates):]``). Candidates are
chosen so both client FLOPs and activation bytes change meaningfully between them — a slow
processor prefers an early split, a slow link one with small activations — measured with
``sfl-coord models`` (forward+backward FLOPs per sample / activation bytes per sample):

| model | candidates (cut after) | 1x28x28 client FLOPs | activation bytes |
|---|---|---|---|
| small_cnn | 1, 2, 3 (conv1, conv2, fc1) | 0.5M, 22M, 25M | 50 KB, 25 KB, 256 B |
| resnet8 | 2, 3, 4 (layer1, layer2, layer3) | 22M, 39M, 56M | 50 KB, 25 KB, 12.5 KB |
| vgg11 | 2, 4, 6 (conv2, conv4, conv6) | 89M, 349M, 540M | 25 KB, 9 KB, 2 KB |
| vgg16 | 2, 4, 7 (conv2, conv4, conv7) | 175M, 435M, 869M | 50 KB, 25 KB, 9 KB |
| alexnet | 2, 4, 5 (conv2, conv4, conv5) | 132M, 587M, 761M | 38 KB, 50 KB, 9 KB |
| mobilenet_v1 | 3, 5, 7 (dw2, dw4, dw6) | 50M, 153M, 262M | 100 KB, 50 KB, 33 KB |
| cnn1d (9x128) | 1, 2, 3 (conv1, conv2, conv3) | 1.5M, 17M, 27M | 16 KB, 16 KB, 8 KB |

(For 3x32x32 inputs the ratios are similar; the numbers scale with the image area.)

The client time table holds, per agent and candidate, the time of one round; rounds 1..K
are warm-up (candidate k for everybody, so every column fills), then each agent gets the
split whose time is closest to the median of all the selected agents' x·K times.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from sfl_core.accounting import SplitCost
from sfl_core.timing import agent_round_time

CANDIDATE_SPLITS: dict[str, tuple[int, ...]] = {
    "small_cnn": (1, 2, 3),
    "resnet8": (2, 3, 4),
    "vgg11": (2, 4, 6),
    "vgg16": (2, 4, 7),
    "alexnet": (2, 4, 5),
    "mobilenet_v1": (3, 5, 7),
    "cnn1d": (1, 2, 3),
}


def candidate_splits(model_name: str, k: Optional[int] = None) -> tuple[int, ...]:
    """The model's candidate split points (the first ``k`` of them if given)."""
    if model_name not in CANDIDATE_SPLITS:
        raise ValueError(f"no candidate splits for model {model_name!r}; known: {sorted(CANDIDATE_SPLITS)} "
                         f"(set s2fl.candidates in the run config)")
    c = CANDIDATE_SPLITS[model_name]
    return c if k is None else c[:k]


@dataclass
class TimeEntry:
    seconds: float
    estimated: bool
    round: int
    """Round in which the time was measured (0 for estimates)."""


class ClientTimeTable:
    """Per agent and per candidate split, the round time. A measurement replaces an estimate
    and any earlier measurement; an estimate never replaces a measurement."""

    def __init__(self) -> None:
        self._t: dict[str, dict[int, TimeEntry]] = {}

    def record(self, agent: str, split: int, seconds: float, round: int) -> None:
        self._t.setdefault(agent, {})[int(split)] = TimeEntry(float(seconds), False, int(round))

    def set_estimate(self, agent: str, split: int, seconds: float) -> None:
        row = self._t.setdefault(agent, {})
        old = row.get(int(split))
        if old is None or old.estimated:
            row[int(split)] = TimeEntry(float(seconds), True, 0)

    def get(self, agent: str, split: int) -> Optional[TimeEntry]:
        return self._t.get(agent, {}).get(int(split))

    def agents(self) -> list[str]:
        return sorted(self._t)

    def times(self, agents: Sequence[str], splits: Sequence[int]) -> list[float]:
        return [e.seconds for a in agents for s in splits if (e := self.get(a, s)) is not None]

    def to_json(self) -> dict[str, Any]:
        return {a: {str(s): asdict(e) for s, e in row.items()} for a, row in self._t.items()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ClientTimeTable":
        table = cls()
        for a, row in d.items():
            for s, e in row.items():
                table._t.setdefault(a, {})[int(s)] = TimeEntry(float(e["seconds"]), bool(e["estimated"]), int(e["round"]))
        return table

    def format(self, splits: Sequence[int]) -> str:
        head = f"{'agent':<16}" + "".join(f"{'split ' + str(s):>14}" for s in splits)
        lines = [head]
        for a in self.agents():
            cells = []
            for s in splits:
                e = self.get(a, s)
                cells.append(f"{'-':>14}" if e is None else f"{e.seconds:>13.3f}{'*' if e.estimated else ' '}")
            lines.append(f"{a:<16}" + "".join(cells))
        return "\n".join(lines)


def warmup_split(round_index: int, candidates: Sequence[int]) -> Optional[int]:
    """Rounds 1..K use candidate k for every agent; None once the warm-up is over."""
    if 1 <= round_index <= len(candidates):
        return candidates[round_index - 1]
    return None


def median_rule(table: ClientTimeTable, agents: Sequence[str], candidates: Sequence[int]) -> dict[str, int]:
    """Each agent gets the candidate whose recorded time is closest to the median of the
    selected agents' x·K times. Ties go to the smaller client portion (less work on the device)."""
    times = table.times(agents, candidates)
    if not times:
        raise ValueError("the client time table has no entry for the selected agents")
    median = statistics.median(times)
    out = {}
    for a in agents:
        options = [(abs(e.seconds - median), s) for s in candidates if (e := table.get(a, s)) is not None]
        if not options:
            raise ValueError(f"agent {a!r} has no time-table entry; estimate it first")
        out[a] = min(options)[1]
    return out


def estimate_round_time(cost: SplitCost, *, samples: int, compute_flops: float, uplink_bytes_per_s: float,
                        downlink_bytes_per_s: float, server_flops_per_s: float, latency_s: float = 0.0,
                        messages: int = 0, bytes_per_activation: Optional[float] = None,
                        measured_compute_s_per_sample: Optional[float] = None) -> float:
    """SPEC §3 Eq. 1 for an (agent, split) never measured: weights down and up, activations up
    and gradients down, client compute (measured per sample if known, else FLOPs / FLOP/s),
    server compute."""
    act = cost.activation_bytes if bytes_per_activation is None else bytes_per_activation
    client_s = (measured_compute_s_per_sample * samples if measured_compute_s_per_sample is not None
                else cost.client_flops * samples / compute_flops)
    t = agent_round_time(
        client_flops=client_s * compute_flops, server_flops=cost.server_flops * samples,
        bytes_up=cost.client_param_bytes + samples * act, bytes_down=cost.client_param_bytes + samples * act,
        client_flops_per_s=compute_flops, server_flops_per_s=server_flops_per_s,
        uplink_bytes_per_s=uplink_bytes_per_s, downlink_bytes_per_s=downlink_bytes_per_s,
        latency_s=latency_s, messages=messages)
    return t.total_s
