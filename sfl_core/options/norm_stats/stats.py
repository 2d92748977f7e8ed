"""Federated BatchNorm statistics: the normalisation a label-skewed fleet's model is evaluated with.

Why: a BatchNorm layer's running mean and variance are buffers, averaged at aggregation like the
weights. When every device sees a few classes, each device's running statistics describe its own
classes, and their average describes no input the aggregated weights will see: the global model
is evaluated with the wrong normalisation. Recomputing the statistics of the *aggregated* model
on data drawn across the fleet repairs it (the recalibration SWA's ``bn_update`` does: Izmailov et
al., "Averaging Weights Leads to Wider Optima and Better Generalization", UAI 2018), but the
coordinator holds no training data. So the devices do it (``norm_stats: federated``):

1. After aggregation, each asked device runs ``batches`` local batches through the new global
   client portion, weights untouched, every BatchNorm layer normalising with its batch's own
   statistics (train mode, as in training), and reports per layer and channel the count ``n``,
   the mean ``μ`` and the sum of squared deviations ``M₂`` of the layer's input.
2. It sends the activations of the same passes; the coordinator runs them through its server
   portion, batch by batch, the same way (no labels are needed).
3. The coordinator combines every part per layer with Chan, Golub and LeVeque's pairwise update
   ("Updating Formulae and a Pairwise Algorithm for Computing Sample Variances", 1979)::

       n = n_a + n_b,  δ = μ_b - μ_a,  μ = μ_a + δ n_b / n,  M₂ = M₂a + M₂b + δ² n_a n_b / n

   and sets ``running_mean = μ``, ``running_var = M₂ / (n - 1)`` (PyTorch keeps the unbiased
   variance). The result equals the same computation over all devices' batches in one place.

Cost: per asked device, one download of its client portion, ``batches × batch`` forward passes
(a third of a training step's FLOPs each), the upload of those activations and 3 numbers per
channel per layer; on the server the forward passes of its portion. Only statistics of
activations leave a device, never a label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

from sfl_core.model.norm_layers import batch_norm_layers, freeze

__all__ = ["Moments", "batch_norm_layers", "frozen", "freeze", "collect", "combine", "apply", "running_stats",
           "to_wire_state", "from_wire_state", "expected_layers"]


@dataclass(frozen=True)
class Moments:
    """One layer's per-channel count, mean and sum of squared deviations of its input."""

    count: int
    mean: torch.Tensor
    m2: torch.Tensor

    @property
    def variance(self) -> torch.Tensor:
        """The unbiased variance (what BatchNorm keeps as ``running_var``)."""
        return self.m2 / max(self.count - 1, 1)

    def merge(self, other: "Moments") -> "Moments":
        """Chan et al.'s pairwise update, in float64 on the CPU (a device's part and the server's,
        computed on a GPU, meet there)."""
        n = self.count + other.count
        a, b = self.mean.double().cpu(), other.mean.double().cpu()
        delta = b - a
        mean = a + delta * (other.count / n)
        m2 = self.m2.double().cpu() + other.m2.double().cpu() + delta * delta * (self.count * other.count / n)
        return Moments(n, mean, m2)


def local_entries(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``state`` (names as in ``model``) that belong to its BatchNorm layers:
    scale, shift and running statistics, which a device keeps for itself under FedBN.

    Why (FedBN: Li, Jiang, Zhang, Kamp and Dou, "FedBN: Federated Learning on Non-IID Features
    via Local Batch Normalization", ICLR 2021): a device whose inputs differ from the fleet's
    keeps normalisation layers fitted to its own data, and only the other layers are shared."""
    prefixes = tuple(f"{n}." for n in batch_norm_layers(model))
    return {k: v.detach().clone() for k, v in state.items() if prefixes and k.startswith(prefixes)}


def frozen(freeze_after: int, r: int) -> bool:
    """Whether round ``r`` trains with frozen statistics: it comes after ``freeze_after`` rounds
    of exploration (0: never freeze).

    Why (FixBN: Zhong, Chen and Chao, "Making Batch Normalization Great in Federated Deep
    Learning", 2024): under label skew, normalising each device's batch by its own statistics
    makes local training fit its own classes' statistics, which the global model never sees at
    test time. Once training has explored, freezing the global statistics and normalising with
    them on every device and on the server removes that mismatch, and the model is trained with
    exactly the normalisation it is evaluated with."""
    return 0 < freeze_after < r


@torch.no_grad()
def collect(model: nn.Module, portion: nn.Module, batches: Iterable[torch.Tensor]
            ) -> tuple[dict[str, Moments], list[torch.Tensor]]:
    """The input moments of every BatchNorm layer of ``portion`` (a part of ``model``, sharing its
    modules; names are ``model``'s), over ``batches`` run one by one in train-mode normalisation,
    and ``portion``'s output for each batch. Nothing in ``model`` changes: running statistics are
    computed on scratch copies."""
    names = {id(m): n for n, m in batch_norm_layers(model).items()}
    found: dict[str, Moments] = {}
    hooks = []

    def record(name: str):
        def hook(_mod: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach().double()
            dims = [0] + list(range(2, x.dim()))
            n = x.numel() // x.shape[1]
            mean = x.mean(dims)
            shape = [1, -1] + [1] * (x.dim() - 2)
            part = Moments(n, mean.cpu(), ((x - mean.view(shape)) ** 2).sum(dims).cpu())   # parts meet on the CPU
            found[name] = found[name].merge(part) if name in found else part
        return hook

    layers = [m for m in portion.modules() if id(m) in names]
    saved = [{k: b.clone() for k, b in m.named_buffers()} for m in layers]
    modes = [(m, m.training) for m in portion.modules()]
    portion.eval()
    for m in layers:
        m.train()
        hooks.append(m.register_forward_pre_hook(record(names[id(m)])))
    try:
        outputs = [portion(x) for x in batches]
    finally:
        for h in hooks:
            h.remove()
        for m, buffers in zip(layers, saved):
            for k, b in m.named_buffers():
                b.copy_(buffers[k])
        for m, training in modes:
            m.training = training
    return found, outputs


def combine(parts: Iterable[Mapping[str, Moments]]) -> dict[str, Moments]:
    """Every part's moments merged per layer (the order does not matter beyond rounding)."""
    out: dict[str, Moments] = {}
    for part in parts:
        for name, m in part.items():
            out[name] = out[name].merge(m) if name in out else m
    return out


@torch.no_grad()
def apply(model: nn.Module, moments: Mapping[str, Moments]) -> list[str]:
    """Set the named layers' running statistics from ``moments``; the layers set, sorted."""
    layers = batch_norm_layers(model)
    for name, m in moments.items():
        layer = layers[name]
        assert layer.running_mean is not None and layer.running_var is not None   # tracked: batch_norm_layers
        layer.running_mean.copy_(m.mean.to(layer.running_mean))
        layer.running_var.copy_(m.variance.to(layer.running_var))
    return sorted(moments)


def running_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every BatchNorm layer's running mean and variance (state-dict names)."""
    return {f"{n}.{b}": getattr(m, b).detach().clone() for n, m in batch_norm_layers(model).items()
            for b in ("running_mean", "running_var")}


def to_wire_state(moments: Mapping[str, Moments]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The tensors (``<layer>.mean``, ``<layer>.m2``, float32) and counts a device sends."""
    tensors: dict[str, torch.Tensor] = {}
    for name, m in moments.items():
        tensors[f"{name}.mean"] = m.mean.float()
        tensors[f"{name}.m2"] = m.m2.float()
    return tensors, {name: int(m.count) for name, m in moments.items()}


def from_wire_state(tensors: Mapping[str, torch.Tensor], counts: Mapping[str, int]) -> dict[str, Moments]:
    """Back from :func:`to_wire_state` (the caller has checked keys, shapes and counts)."""
    return {name: Moments(int(n), tensors[f"{name}.mean"].double(), tensors[f"{name}.m2"].double())
            for name, n in counts.items()}


def expected_layers(model: nn.Module, portion: nn.Module) -> dict[str, int]:
    """The BatchNorm layers of ``portion`` (names as in ``model``) and their channel counts:
    what a device's report must hold, exactly."""
    names = {id(m): n for n, m in batch_norm_layers(model).items()}
    return {names[id(m)]: int(m.num_features) for m in portion.modules()   # type: ignore[arg-type]
            if id(m) in names}
