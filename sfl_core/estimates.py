"""What a run's methods estimate of each agent's speed, shared by all of them.

Two estimators come from the papers and serve every method that plans by time: the client
time table of S2FL (Yan et al., 2023) — round seconds per (agent, split), measured where the
agent trained at that split, estimated by the time model elsewhere — and the smoothed
per-sample rates of MergeSFL (Liao et al., 2023, Eq. 5-6) — compute and transfer seconds per
sample, and the transfer seconds per round that do not grow with the batch.
:class:`FleetEstimates` holds one copy of each per run; the coordinator's records of the
agents themselves are :mod:`sfl_core.fleet`.

Time table semantics: a *measured* entry (:meth:`ClientTimeTable.record`) replaces an
estimate and any earlier measurement of the same (agent, split) — the paper updates the
table with every round, and the newest measurement reflects the device's current load.
An *estimate* (:meth:`ClientTimeTable.set_estimate`) only fills a gap and never overwrites a
measurement.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

import numpy as np


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)

def nonneg_float(name: str, value: object, *, positive: bool = False) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be finite and {'> 0' if positive else '>= 0'}, got {value!r}")
    return v

def probability(name: str, value: float) -> float:
    v = nonneg_float(name, value)
    if v > 1:
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    return v


# ====================================================================== per-sample rates (MergeSFL Eq. 5-6)


def smooth(prev: float | None, measured: float, alpha: float = 0.8) -> float:
    """Eq. 5-6: ``x_h = alpha * x_{h-1} + (1 - alpha) * x_hat_h``.

    ``alpha`` weighs the *history* (the previous estimate), ``1 - alpha`` the new
    measurement; the paper uses ``alpha = 0.8``, so one noisy round moves the estimate by
    only a fifth of its error, while a lasting change (Jetson power mode switched) is
    tracked within ~10 rounds (0.8^10 ≈ 0.11). ``prev=None`` (first observation) returns
    ``measured``. Raises ``ValueError`` for negative or non-finite times or ``alpha``
    outside ``[0, 1]``.
    """
    a = probability("alpha", alpha)
    x = nonneg_float("measured", measured)
    if prev is None:
        return x
    return a * nonneg_float("prev", prev) + (1.0 - a) * x

@dataclass(frozen=True)
class AgentState:
    """An agent's smoothed times (docs/methods/mergesfl.md, Table I of the paper).

    ``mu``: compute seconds per sample (client-portion forward + backward);
    ``beta``: transfer seconds per sample (activations up + gradients down) — only what
    grows with the batch; ``fixed``: transfer seconds per round that do not (the client
    portion's weights down and up, message latencies; 0 = the paper's model).
    A round of ``tau`` local iterations at batch ``d`` takes
    ``tau * d * (mu + beta) + fixed`` (Eq. 7 plus the fixed part, :meth:`round_time`).
    """

    mu: float
    beta: float
    fixed: float = 0.0

    def __post_init__(self) -> None:
        nonneg_float("mu", self.mu)
        nonneg_float("beta", self.beta)
        nonneg_float("fixed", self.fixed)

    @property
    def per_sample(self) -> float:
        """``mu + beta``: seconds one sample costs this agent per local iteration."""
        return self.mu + self.beta

    def round_time(self, batch: int, tau: int = 1) -> float:
        """Eq. 7 plus the fixed part: ``tau * batch * (mu + beta) + fixed`` seconds."""
        return positive_int("tau", tau) * positive_int("batch", batch) * self.per_sample + self.fixed

    def update(self, mu: float, beta: float, alpha: float = 0.8, *, fixed: float | None = None) -> AgentState:
        """A new state with the measurements smoothed in by Eq. 5-6 (``alpha`` weighs the old state);
        ``fixed=None`` keeps the fixed part as it is."""
        return replace(self, mu=smooth(self.mu, mu, alpha), beta=smooth(self.beta, beta, alpha),
                       fixed=self.fixed if fixed is None else smooth(self.fixed, fixed, alpha))


def scale_lr(base_lr: float, batch: int, base_batch: int) -> float:
    """Eq. 15: an agent's learning rate proportional to its batch (linear scaling rule).

    The paper follows [44]: ``eta_i = base_lr * d_i / base_batch``, so an agent taking a
    bigger batch (a less noisy gradient) takes a proportionally bigger step, and per-sample
    progress is the same for everyone. ``base_batch`` is the batch ``base_lr`` was tuned for
    (usually the maximum batch ``D``).
    """
    lr = nonneg_float("base_lr", base_lr, positive=True)
    return lr * positive_int("batch", batch) / positive_int("base_batch", base_batch)


# ====================================================================== client time table (S2FL)


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


# ====================================================================== one copy per run


@dataclass
class FleetEstimates:
    """Per-agent estimates, one copy for all of a run's methods and layers.

    ``time_table``: round seconds per (agent, split), measured or estimated (S2FL's table);
    ``rates``: per agent the smoothed compute and transfer seconds per sample and the fixed
    transfer seconds per round (MergeSFL's μ, β; Eq. 5-6); ``wire_ratio``: measured wire bytes
    over fp32 bytes per ``"<split>/<codec>"``, so estimates charge what the clock charges.
    """

    time_table: ClientTimeTable = field(default_factory=ClientTimeTable)
    rates: dict[str, AgentState] = field(default_factory=dict)
    wire_ratio: dict[str, float] = field(default_factory=dict)
    up_share: dict[str, float] = field(default_factory=dict)
    """Per ``"<split>/<codec>"`` the share of the steps' bytes that go up (activations against
    gradients), so a window of steps in flight is priced on its busier direction."""
