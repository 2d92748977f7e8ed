"""An exponential moving average of the global model over rounds (``model_ema: DECAY``).

Under label skew the global model swings from round to round: each round's few devices pull it
towards their own classes, and its accuracy moves by a point or more between neighbouring rounds
long after it has stopped improving on average. Averaging the global models of the last rounds
cancels much of that swing, as stochastic weight averaging does for SGD's iterates (Izmailov et
al., "Averaging Weights Leads to Wider Optima and Better Generalization", UAI 2018) and as server
side averaging does for federated rounds (Caldarola, Caputo and Ciccone, "Improving
Generalization in Federated Learning by Seeking Flat Minima", ECCV 2022).

After each round's aggregation (and the round's statistics pass, with ``norm_stats:
federated``), for every floating-point tensor ``x`` of the global model:

    a ← x                      after the first round
    a ← d · a + (1 − d) · x    after every later round

with ``d`` the decay in (0, 1): the average weighs the last ``1 / (1 − d)`` rounds or so.
Training goes on from the global model ``x``; the average is what the run delivers: it is
scored on the validation set, sent for federated evaluation, and exported. BatchNorm statistics
are averaged with the weights; they describe averaged weights well when the averaged models are
close, which a decay that weighs a handful of rounds keeps them. Integer tensors (a BatchNorm
layer's batch counter) are the current model's. The average lives on the coordinator,
checkpointed beside the model (``@ema/<name>``); nothing crosses the wire.

``torch.optim.swa_utils.AveragedModel`` does the same arithmetic on a copy of a module; here the
average is a set of named tensors, because that is how the checkpoint keeps the coordinator's
own state (a server optimiser's moments, SCAFFOLD's control variates) and how a resumed run
restores it.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

__all__ = ["ModelAverage", "STATE_PREFIX", "delivered_weights"]

STATE_PREFIX = "@ema/"
"""Checkpoint tensor names of the average start with this: no module parameter can."""


class ModelAverage:
    """The exponential moving average of a model's state over rounds.

    Args:
        decay: ``d`` in (0, 1), the weight the average keeps at each update.
    """

    def __init__(self, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"model_ema: the decay must be in (0, 1), got {decay!r}")
        self.decay = float(decay)
        self.tensors: Dict[str, torch.Tensor] = {}

    def update(self, state: Mapping[str, torch.Tensor]) -> None:
        """Fold the round's global ``state`` (a model's ``state_dict``) into the average."""
        for k, x in state.items():
            x = x.detach()
            a = self.tensors.get(k)
            if a is None or not x.is_floating_point() or a.shape != x.shape:
                self.tensors[k] = x.clone()   # first round, an integer, or a layer that changed shape
            else:
                a.lerp_(x.to(a.device, a.dtype), 1 - self.decay)

    def state(self, current: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The averaged model's state (:func:`_overlay` of the average on ``current``)."""
        return _overlay(self.tensors, current)

    def state_tensors(self) -> Dict[str, torch.Tensor]:
        """The average as checkpoint tensors (``@ema/<name>``)."""
        return {f"{STATE_PREFIX}{k}": t.detach().cpu() for k, t in self.tensors.items()}

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Continue from :meth:`state_tensors` (other names are ignored)."""
        self.tensors = {k: t.clone() for k, t in _unprefixed(tensors).items()}


def _unprefixed(tensors: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The average's tensors among checkpoint tensors, by their model names (``@ema/<name>``)."""
    return {name[len(STATE_PREFIX):]: t for name, t in tensors.items()
            if name.startswith(STATE_PREFIX) and len(name) > len(STATE_PREFIX)}


def _overlay(average: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``current`` with the average's tensor in place of each floating-point one it has (before
    the first update there is none; integers are not averaged)."""
    return {k: (average[k] if k in average and x.is_floating_point() else x) for k, x in current.items()}


def delivered_weights(model: Mapping[str, torch.Tensor],
                      own_state: Optional[Mapping[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """The weights a run delivers from its checkpoint: the model's, with the average's in their
    place when the run kept one (``own_state``: the checkpoint's ``@`` tensors,
    :func:`sfl_core.options.base.split_state`)."""
    return _overlay(_unprefixed(own_state or {}), model)
