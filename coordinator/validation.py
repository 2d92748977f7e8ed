"""The server's held-out validation set, and the run's standardisation constants it is scaled by.

A built-in data set comes standardised. A run on the devices' own data (``task:``) standardises
with constants that are known up front (``normalize: [mean, std]`` or ``none``), read back from
a checkpoint, or combined from the devices' channel statistics before round 1
(``normalize: federated``); until then the set keeps its unscaled inputs, so it can be scaled
once the constants arrive. A task run may have no validation data on the server at all: the
global model is then scored only by the devices (:mod:`coordinator.evaluation`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from sfl_core.data.preprocessing import Normalization

__all__ = ["ValidationSet"]


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
        self.normalization: Optional[Normalization] = None
        """The constants :attr:`x` is standardised with, once adopted (None before)."""

    def __len__(self) -> int:
        return len(self.y)

    def standardise(self, norm: Normalization) -> None:
        """Scale the unscaled inputs with ``norm`` (again from the unscaled ones if called twice)."""
        self.normalization = norm
        self.x = norm.apply(self._unscaled) if len(self._unscaled) else self._unscaled

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device,
                 batch_size: int = 1024) -> tuple[Optional[float], Optional[float]]:
        """Accuracy and mean cross-entropy of ``model`` (the full global model) on this set;
        (None, None) when the set is empty. The model is left in training mode."""
        if not len(self.y):
            return None, None
        model.eval()
        correct, total_loss = 0, 0.0
        for i in range(0, len(self.y), batch_size):
            x = self.x[i:i + batch_size].to(device)
            y = self.y[i:i + batch_size].to(device)
            logits = model(x)
            total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
        model.train()
        n = max(len(self.y), 1)
        return correct / n, total_loss / n
