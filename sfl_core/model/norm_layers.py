"""A model's BatchNorm layers, found and frozen: what the trainers of both sides need, whichever
training option (:mod:`sfl_core.options.norm_stats`) asks for it; and whether a portion runs
alike in training and inference mode (the coordinator's score of the model then makes the
screens' held-out rows, :mod:`coordinator.option_host`)."""

from __future__ import annotations

from torch import nn

from sfl_core.model.bottleneck import Bottleneck, Decoder, Encoder
from sfl_core.model.zoo import BasicBlock, DepthwiseSeparable

__all__ = ["MODE_FREE", "batch_norm_layers", "freeze", "runs_alike_in_either_mode"]


def batch_norm_layers(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    """Every BatchNorm layer of ``model`` by its name in ``model`` (the names all parts share)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def freeze(module: nn.Module) -> nn.Module:
    """Every BatchNorm layer of ``module`` (already in train mode) normalises with its running
    statistics and stops updating them; its scale and shift still train."""
    for layer in batch_norm_layers(module).values():
        layer.eval()
    return module


MODE_FREE: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.Identity, nn.Flatten, nn.Sequential, nn.ModuleList,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.ELU, nn.Tanh, nn.Sigmoid, nn.Hardswish, nn.Hardsigmoid,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.LayerNorm, nn.GroupNorm)
"""Layers whose output does not depend on their training flag."""


def runs_alike_in_either_mode(module: nn.Module, frozen_norms: bool) -> bool:
    """Whether ``module`` makes the same rows in training and in inference mode: built of
    :data:`MODE_FREE` layers and the zoo's blocks and bottlenecks (built of them) only, and of
    BatchNorm layers where they normalise with their running statistics either way
    (``frozen_norms``). Dropout, or a layer of a user's model this cannot vouch for, is not."""
    vouched = (*MODE_FREE, BasicBlock, DepthwiseSeparable, Encoder, Decoder, Bottleneck)
    return all(isinstance(m, vouched) or (frozen_norms and isinstance(m, nn.modules.batchnorm._BatchNorm))
               for m in module.modules())
