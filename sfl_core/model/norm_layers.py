"""A model's BatchNorm layers, found and frozen: what the trainers of both sides need, whichever
training option (:mod:`sfl_core.options.norm_stats`) asks for it."""

from __future__ import annotations

from torch import nn

__all__ = ["batch_norm_layers", "freeze"]


def batch_norm_layers(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    """Every BatchNorm layer of ``model`` by its name in ``model`` (the names all parts share)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def freeze(module: nn.Module) -> nn.Module:
    """Every BatchNorm layer of ``module`` (already in train mode) normalises with its running
    statistics and stops updating them; its scale and shift still train."""
    for layer in batch_norm_layers(module).values():
        layer.eval()
    return module
