"""The server's held-out validation set, and the run's standardisation constants it is scaled by.

A built-in data set comes standardised. A run on the devices' own data (``task:``) standardises
with constants that are known up front (``normalize: [mean, std]`` or ``none``), read back from
a checkpoint, or combined from the devices' channel statistics before round 1
(``normalize: federated``); until then the set keeps its unscaled inputs, so it can be scaled
once the constants arrive. A task run may have no validation data on the server at all: the
global model is then scored only by the devices (:mod:`coordinator.evaluation`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, TypeVar, cast

import torch
import torch.nn.functional as F

from sfl_core.data.preprocessing import Normalization

if TYPE_CHECKING:
    from sfl_core.model.zoo import SplitModel

__all__ = ["Score", "ValidationSet", "evaluation_batch", "screen_draw"]

T = TypeVar("T")

CPU_EVAL_BYTES = 8 * 2**20
"""Largest block output of one evaluation batch on a CPU: past the caches, a bigger batch is slower."""


SCREEN_SEED = 0
"""Seed of :func:`screen_draw`: fixed, so every process holding the same set draws the same samples."""


def screen_draw(total: int, n: int) -> torch.Tensor:
    """Indices of the samples, of a held-out set of ``total``, that the robust screens read: a
    fixed random draw of ``n`` of them (all where there are no more), in random order, so that
    any prefix of it is a random draw too.

    Why not the first ``n``: held-out sets come ordered. MNIST's test set begins with the digits
    of its neater writers, and a folder of images is read class by class. A reference built from
    a part of the data describes that part: honest devices' digits look unlike their class's
    held-out ones, and a class outside the first ``n`` is not judged at all. The seed is fixed
    (:data:`SCREEN_SEED`): the same set gives the same draw in every process."""
    return torch.randperm(total, generator=torch.Generator().manual_seed(SCREEN_SEED))[:n]


def evaluation_batch(block_output_bytes: int, device: torch.device) -> int:
    """Samples per evaluation batch. On a CPU, the largest power of two whose widest block output
    (``block_output_bytes`` per sample) stays within :data:`CPU_EVAL_BYTES` (32 to 1024): a batch
    whose activations spill out of the caches runs slower per sample, not faster. An accelerator
    takes 1024."""
    if device.type != "cpu":
        return 1024
    fit = CPU_EVAL_BYTES // max(block_output_bytes, 1)
    return max(32, min(1024, 1 << max(fit, 1).bit_length() - 1))


class ValidationSet:
    """Inputs and labels the coordinator scores the global model on.

    Args:
        x: the inputs, standardised already (a built-in data set) or not yet (a task run).
        y: the labels (may be empty: no validation data on the server).
        limit: keep only the first ``limit`` samples (``eval_samples``), None for all.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, limit: Optional[int] = None):
        if limit is not None:
            x, y = x[:limit], y[:limit]
        self.x, self.y = x, y
        self._unscaled = x
        self._device_copies: dict[tuple[str, torch.memory_format], tuple[torch.Tensor, torch.Tensor]] = {}
        self._channels_last: Optional[bool] = None
        """Whether the model is scored in channels-last order on a CPU (None: not tried yet)."""
        self.normalization: Optional[Normalization] = None
        """The constants :attr:`x` is standardised with, once adopted (None before)."""

    def __len__(self) -> int:
        return len(self.y)

    def standardise(self, norm: Normalization) -> None:
        """Scale the unscaled inputs with ``norm`` (again from the unscaled ones if called twice)."""
        self.normalization = norm
        self.x = norm.apply(self._unscaled) if len(self._unscaled) else self._unscaled
        self._device_copies.clear()

    def evaluate(self, model: torch.nn.Module, device: torch.device,
                 batch_size: int = 1024) -> tuple[Optional[float], Optional[float]]:
        """Accuracy and mean cross-entropy of ``model`` (the full global model) on this set;
        (None, None) when the set is empty. The model is left in training mode."""
        if not len(self.y):
            return None, None
        return self.score(model, device, batch_size).means()

    def evaluate_at_cut(self, model: "SplitModel", split: int, index: torch.Tensor, device: torch.device,
                        batch_size: int = 1024) -> tuple[float, float, torch.Tensor]:
        """:meth:`evaluate` (on a set that is not empty), the model run as its client portion at
        ``split`` and then its server portion (with no bottleneck at ``split`` these are
        :meth:`SplitModel.forward`'s layers in its order, so the scores are the same), and the
        client portion's outputs for the inputs at ``index`` (in that order) kept on the way: a
        screen that reads them next round need not run them again."""
        score, rows = self.score_at_cut(model, split, index, device, batch_size)
        accuracy, loss = score.means()
        assert accuracy is not None and loss is not None
        return accuracy, loss, rows

    def score(self, model: torch.nn.Module, device: torch.device, batch_size: int,
              part: slice = slice(None)) -> "Score":
        """What :meth:`evaluate` reports, as sums over the samples in ``part`` of the set (a server
        worker scores a block of it: :mod:`coordinator.shard_scoring`).

        The set is moved to ``device`` once and kept there (a GPU server scores it every round),
        and scored in channels-last order on a CPU where the model takes it (:meth:`_ordered`)."""
        device = torch.device(device)
        try:
            return self._ordered(model, device, lambda m, order: _score(m, *self._part(device, order, part),
                                                                         batch_size))
        finally:
            model.train()

    def score_at_cut(self, model: "SplitModel", split: int, index: torch.Tensor, device: torch.device,
                     batch_size: int, part: slice = slice(None)) -> tuple["Score", torch.Tensor]:
        """What :meth:`evaluate_at_cut` reports, as sums over the samples in ``part``; ``index``
        counts from the part's first sample."""
        device = torch.device(device)
        try:
            return self._ordered(model, device, lambda m, order: _score_at_cut(
                cast("SplitModel", m), split, *self._part(device, order, part), index, batch_size))
        finally:
            model.train()

    def forward(self, module: torch.nn.Module, device: torch.device, index: torch.Tensor,
                batch_size: int) -> torch.Tensor:
        """``module`` (a client portion, in the mode the caller set) on the inputs at ``index``,
        ``batch_size`` of them at a time, without gradients; channels-last on a CPU where it
        takes that order (:meth:`_ordered`), the result in the usual order."""
        device = torch.device(device)

        def run(m: torch.nn.Module, order: torch.memory_format) -> torch.Tensor:
            x = self._on(device, order)[0][index]
            with torch.no_grad():
                return torch.cat([m(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]).contiguous()

        return self._ordered(module, device, run)

    def _ordered(self, model: torch.nn.Module, device: torch.device,
                 run: Callable[[torch.nn.Module, torch.memory_format], T]) -> T:
        """``run(model, order)`` with images in channels-last order on a CPU, on a copy of the model
        in that order, where oneDNN's convolutions run inference faster; as they are where the
        model cannot take that order (a ``forward`` that calls ``.view`` on a feature map), which
        is learnt on the first try and kept."""
        if self._channels_last is not False and device.type == "cpu" and self.x.dim() == 4:
            with torch.no_grad():
                reordered = copy.deepcopy(model).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
            try:
                out = run(reordered, torch.channels_last)
                self._channels_last = True
                return out
            except RuntimeError:
                if self._channels_last:   # it worked before: a real error, not the order
                    raise
                self._channels_last = False
        return run(model, torch.contiguous_format)

    def _part(self, device: torch.device, memory_format: torch.memory_format, part: slice
              ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._on(device, memory_format)
        return x[part], y[part]

    def _on(self, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format
            ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (str(device), memory_format)
        if key not in self._device_copies:
            self._device_copies[key] = (self.x.to(device, memory_format=memory_format), self.y.to(device))
        return self._device_copies[key]


@dataclass(frozen=True)
class Score:
    """A model's score on some samples, as sums: it adds up over parts of a set."""

    correct: int
    loss: float
    """The sum of the samples' cross-entropies."""
    count: int

    def __add__(self, other: "Score") -> "Score":
        return Score(self.correct + other.correct, self.loss + other.loss, self.count + other.count)

    def means(self) -> tuple[Optional[float], Optional[float]]:
        """Accuracy and mean cross-entropy (None, None over no samples)."""
        if not self.count:
            return None, None
        return self.correct / self.count, self.loss / self.count


@torch.inference_mode()
def _score(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int,
           through: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None) -> Score:
    """``model``'s score on ``(x, y)``, in batches of ``batch_size`` (``through``: what makes a
    batch's logits from its inputs and their first index, in place of ``model``)."""
    model.eval()
    correct, total_loss = 0, 0.0
    for i in range(0, len(y), batch_size):
        logits = model(x[i:i + batch_size]) if through is None else through(x[i:i + batch_size], i)
        total_loss += float(F.cross_entropy(logits, y[i:i + batch_size], reduction="sum"))
        correct += int((logits.argmax(1) == y[i:i + batch_size]).sum())
    return Score(correct, total_loss, len(y))


def _score_at_cut(model: "SplitModel", split: int, x: torch.Tensor, y: torch.Tensor, index: torch.Tensor,
                  batch_size: int) -> tuple[Score, torch.Tensor]:
    """:func:`_score` through ``model``'s portions at ``split``, and the client portion's rows of
    the inputs at ``index``."""
    client, server = model.client(split), model.server(split)
    where = torch.full((len(y),), -1, dtype=torch.long)
    where[index] = torch.arange(len(index))
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def through(inputs: torch.Tensor, start: int) -> torch.Tensor:
        rows = client(inputs)
        at = where[start:start + len(inputs)]
        mine = (at >= 0).nonzero().flatten()
        if len(mine):
            kept.append((at[mine], rows[mine.to(rows.device)].contiguous()))
        return server(rows)

    score = _score(model, x, y, batch_size, through)
    if not kept:   # none of the inputs at ``index`` lies here (a part of the set)
        return score, torch.empty(0)
    order = torch.cat([at for at, _ in kept])
    rows = torch.cat([r for _, r in kept])[torch.argsort(order).to(x.device)]
    return score, rows.clone()   # a tensor of its own, not of inference mode
