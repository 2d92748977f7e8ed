"""Input standardisation agreed across a fleet.

Why the fleet must agree: a device that standardises its pixels with its *own* mean and
std feeds the shared model a different input for the same pixel than its neighbour does,
and the exported model records constants that no device used. So every device and the
server standardise with one pair of per-channel constants: given in the run config, or
computed once from the devices' data without moving it (``normalize: federated``):

    each device k sends, per channel c: n_k (values), S_kc = sum x, Q_kc = sum x^2
    mean_c = sum_k S_kc / N            N = sum_k n_k
    var_c  = (sum_k Q_kc - N mean_c^2) / (N - 1)
    std_c  = max(sqrt(var_c), 1e-8)

which is exactly the statistics of the union of the devices' data (up to float64 rounding),
for the price of 2C + 1 numbers per device. "Channel" is axis 1 of a batch: an image
channel, or a feature of a table (each feature is then standardised on its own).

The values standardised are the *scaled* inputs (``raw / task.scale``, resized if the run
resizes), the same ones ``sfl-agent predict --raw`` produces from raw pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

__all__ = ["ChannelStats", "Normalization"]

MIN_STD = 1e-8


@dataclass(frozen=True)
class Normalization:
    """Per-channel constants: ``(x - mean[c]) / std[c]``."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``(N, C, ...)``) standardised, as a new tensor."""
        shape = (1, len(self.mean)) + (1,) * (x.dim() - 2)
        m = torch.tensor(self.mean, dtype=x.dtype).view(shape)
        s = torch.tensor(self.std, dtype=x.dtype).view(shape)
        return (x - m) / s

    def to_wire(self) -> dict[str, list[float]]:
        return {"mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_wire(cls, d: Any, channels: int, where: str = "normalize") -> "Normalization":
        """Validated constants (from a run description, an assignment or a checkpoint);
        ValueError in one line naming ``where``."""
        if not isinstance(d, dict) or set(d) != {"mean", "std"}:
            raise ValueError(f"{where}: expected {{mean: [...], std: [...]}}")
        mean, std = d["mean"], d["std"]
        ok = (isinstance(mean, (list, tuple)) and isinstance(std, (list, tuple)) and len(mean) == len(std) == channels
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                      for v in (*mean, *std))
              and all(v > 0 for v in std))
        if not ok:
            raise ValueError(f"{where}: expected {channels} finite means and {channels} positive stds")
        return cls(tuple(float(v) for v in mean), tuple(float(v) for v in std))


@dataclass(frozen=True)
class ChannelStats:
    """What one device tells the coordinator about its inputs: values per channel, their sum
    and their sum of squares (float64). Nothing else about the data leaves the device."""

    count: int
    sum: tuple[float, ...]
    sumsq: tuple[float, ...]

    @classmethod
    def of(cls, x: torch.Tensor) -> "ChannelStats":
        """Statistics of ``x`` (``(N, C, ...)``) per channel (axis 1)."""
        flat = x.transpose(0, 1).reshape(x.shape[1], -1).to(torch.float64)
        return cls(int(flat.shape[1]), tuple(flat.sum(1).tolist()), tuple((flat * flat).sum(1).tolist()))

    def to_wire(self) -> dict[str, Any]:
        return {"count": self.count, "sum": list(self.sum), "sumsq": list(self.sumsq)}

    @classmethod
    def from_wire(cls, d: Any, channels: int, where: str = "register.channel_stats") -> "ChannelStats":
        if not isinstance(d, dict) or set(d) != {"count", "sum", "sumsq"}:
            raise ValueError(f"{where}: expected {{count, sum, sumsq}}")
        count, s, q = d["count"], d["sum"], d["sumsq"]
        ok = (isinstance(count, int) and not isinstance(count, bool) and count > 0
              and all(isinstance(v, (list, tuple)) and len(v) == channels for v in (s, q))
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (*s, *q))
              and all(v >= 0 for v in q))
        if not ok:
            raise ValueError(f"{where}: expected a positive count and {channels} finite sums and sums of squares")
        return cls(count, tuple(float(v) for v in s), tuple(float(v) for v in q))

    @staticmethod
    def combine(parts: Iterable["ChannelStats"]) -> Normalization:
        """The constants of the union of the parts' data (see the module docstring)."""
        parts = list(parts)
        if not parts:
            raise ValueError("no channel statistics to combine")
        channels = len(parts[0].sum)
        n = sum(p.count for p in parts)
        mean, std = [], []
        for c in range(channels):
            s = sum(p.sum[c] for p in parts)
            q = sum(p.sumsq[c] for p in parts)
            m = s / n
            var = max(q - n * m * m, 0.0) / max(n - 1, 1)
            mean.append(m)
            std.append(max(math.sqrt(var), MIN_STD))
        return Normalization(tuple(mean), tuple(std))


def preprocessing_record(scale: float, norm: Normalization | None, resize: Sequence[int] | None,
                         raw_shape: Sequence[int] | None, classes: Sequence[str] | None = None) -> dict[str, Any]:
    """How raw inputs became the model's inputs, as exported models record it (``model.json``):
    ``(resize(raw / scale) - mean[c]) / std[c]``."""
    out: dict[str, Any] = {"scale": float(scale), "resize": list(resize) if resize else None,
                           "raw_shape": list(raw_shape) if raw_shape else None}
    if norm is not None:
        out.update(mean=list(norm.mean), std=list(norm.std))
    if classes is not None:
        out["classes"] = list(classes)
    return out
