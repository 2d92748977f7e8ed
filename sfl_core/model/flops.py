"""Counting a block's FLOPs: PyTorch's own counter where it exists, the same count on torch 2.0.

``torch.utils.flop_counter.FlopCounterMode`` arrived in torch 2.1. The agents' floor is torch
2.0 (NVIDIA's wheels for JetPack 5 include 2.0), so on 2.0 the count comes from a small
dispatch-mode counter with the same rules for the operators the zoo's models run:
2 FLOPs per multiply-accumulate of ``mm``, ``addmm``, ``bmm`` and ``convolution`` (forward),
and of ``convolution_backward`` (the input's and the weight's gradients, each as large as the
forward); every other operator counts zero. A test checks that both counters agree on every
model in the zoo, so an agent on torch 2.0 prices splits exactly as the coordinator does.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FlopCounter", "counter"]

aten = torch.ops.aten


def _conv(x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], transposed: bool) -> int:
    """``2 · batch · output positions · c_out · c_in/groups · kernel`` (input positions when transposed)."""
    positions = x_shape[2:] if transposed else out_shape[2:]
    return 2 * x_shape[0] * math.prod(positions) * math.prod(w_shape)


def _swap(shape: Sequence[int]) -> list[int]:
    return [shape[1], shape[0], *shape[2:]]


def _mm(args: Sequence[Any], _out: Any) -> int:
    (m, k), n = args[0].shape, args[1].shape[1]
    return 2 * m * k * n


def _addmm(args: Sequence[Any], out: Any) -> int:
    return _mm(args[1:], out)


def _bmm(args: Sequence[Any], _out: Any) -> int:
    (b, m, k), n = args[0].shape, args[1].shape[2]
    return 2 * b * m * k * n


def _convolution(args: Sequence[Any], out: Any) -> int:
    return _conv(args[0].shape, args[1].shape, out.shape, bool(args[6]))


def _convolution_backward(args: Sequence[Any], _out: Any) -> int:
    grad_out, x, w = args[0].shape, args[1].shape, args[2].shape
    transposed, mask = bool(args[7]), args[10]
    flops = 0
    if mask[0]:   # the input's gradient: a convolution of the output's gradient with the weights
        flops += _conv(grad_out, w, x, not transposed)
    if mask[1]:   # the weights' gradient: the input with the output's gradient
        flops += _conv(_swap(x), _swap(grad_out), _swap(w), transposed)
    return flops


_FORMULAS: Dict[Any, Callable[[Sequence[Any], Any], int]] = {
    aten.mm: _mm, aten.addmm: _addmm, aten.bmm: _bmm,
    aten.convolution: _convolution, aten._convolution: _convolution,
    aten.convolution_backward: _convolution_backward,
}


class FlopCounter(TorchDispatchMode):
    """Counts FLOPs of the operators above while active (``with FlopCounter() as c: ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def get_total_flops(self) -> int:
        return self.total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        formula = _FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(args, out)
        return out


def counter() -> Any:
    """A fresh counter: PyTorch's ``FlopCounterMode`` where available, else :class:`FlopCounter`."""
    try:
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError:   # torch 2.0
        return FlopCounter()
    return FlopCounterMode(display=False)
