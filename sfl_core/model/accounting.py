"""Per-split cost accounting: what a split point costs the agent, the server and the link.

These numbers feed the timing model (docs/methods/time-model.md, S2FL Eq. 1):
``T = (2|Wc| + 2·p·q) / R + F_c / Comp_c + F_s / Comp_s`` — ``|Wc|`` is
:attr:`SplitCost.client_param_bytes`, ``q`` is :attr:`SplitCost.activation_bytes`,
``F_c`` / ``F_s`` are :attr:`SplitCost.client_flops` / :attr:`SplitCost.server_flops`
(per sample; multiply by the batch size).

FLOPs come from :class:`torch.utils.flop_counter.FlopCounterMode` (on torch 2.0, which lacks
it, from :mod:`sfl_core.model.flops` with the same rules), which counts only
matmul / convolution-like ops (2 FLOPs per multiply-accumulate, forward and backward).
Elementwise ops (ReLU, BatchNorm, pooling, bias adds, residual adds, the loss) are NOT
counted; they are memory-bound and small next to the convolutions, and a hand-written
counter would drift from what PyTorch actually executes.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from sfl_core.model import flops
from sfl_core.model.zoo import SplitModel, build_model

__all__ = ["SplitCost", "block_flops", "split_costs", "model_costs", "format_cost_table"]

_BATCH = 2  # > 1 so BatchNorm in train mode works even at 1x1 spatial size


@dataclass(frozen=True)
class SplitCost:
    """Cost of one split point ``split`` (per sample where it says so)."""

    split: int
    client_params: int  # parameters in blocks[:s]
    client_param_bytes: int  # bytes of the client state dict (params + buffers) at their dtypes
    client_flops: float  # forward+backward FLOPs per sample of blocks[:s]
    server_flops: float  # forward+backward FLOPs per sample of blocks[s:] (incl. grad wrt its input)
    activation_shape: tuple[int, ...]  # per sample, output of blocks[:s]; () for s == num_blocks
    activation_bytes: int  # per sample at fp32 (0 for s == num_blocks)
    client_activation_bytes: int = 0
    """Per sample at fp32, every output of ``blocks[:s]``: what training keeps for the backward
    pass on the device (with the input), the part of its memory that grows with the batch."""


@dataclass(frozen=True)
class _BlockProfile:
    flops: float  # fwd+bwd FLOPs per sample
    out_shape: tuple[int, ...]  # per-sample output shape


def _profile_blocks(model: SplitModel) -> list[_BlockProfile]:
    """Run each block on its own, forward then backward, under a FLOP counter (:mod:`.flops`).

    Each block gets a fresh leaf input, so ``backward`` stops at the block boundary and
    block ``i``'s backward FLOPs are attributed to block ``i``. Block 0's input does not
    require grad (no one needs the gradient of the raw data); every later block's input
    does, because its predecessor — on either side of the cut — needs that gradient.
    A server portion starting at ``s >= 1`` therefore includes the gradient it sends back.

    Works on a deep copy so the caller's weights, ``.grad`` and BN running stats are
    untouched, and uses a private RNG so the global torch RNG is not advanced.
    """
    work = copy.deepcopy(model).train()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_BATCH, *model.input_shape, generator=gen)
    profiles: list[_BlockProfile] = []
    for i, block in enumerate(work.blocks):
        inp = x.detach().requires_grad_(i > 0)
        counter = flops.counter()
        with counter:
            out = block(inp)
            out.backward(torch.ones_like(out))
        profiles.append(_BlockProfile(counter.get_total_flops() / _BATCH, tuple(out.shape[1:])))
        x = out
    return profiles


def block_flops(model: SplitModel) -> list[float]:
    """Forward+backward FLOPs per sample for each block (see :func:`_profile_blocks`)."""
    return [p.flops for p in _profile_blocks(model)]


def _state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def split_costs(model: SplitModel) -> dict[int, SplitCost]:
    """Costs for every split in ``model.split_points`` plus ``num_blocks`` (FedAvg)."""
    profiles = _profile_blocks(model)
    total = sum(p.flops for p in profiles)
    costs: dict[int, SplitCost] = {}
    for s in model.valid_splits:
        client_flops = sum(p.flops for p in profiles[:s])
        whole = s == model.num_blocks
        shape = () if whole else profiles[s - 1].out_shape
        costs[s] = SplitCost(
            split=s,
            client_params=sum(p.numel() for p in model.blocks[:s].parameters()),
            client_param_bytes=_state_bytes(model.client_state(s)),
            client_flops=float(client_flops),
            server_flops=float(total - client_flops),
            activation_shape=shape,
            activation_bytes=0 if whole else 4 * math.prod(shape),
            client_activation_bytes=4 * sum(math.prod(p.out_shape) for p in profiles[:s]),
        )
    return costs


@functools.lru_cache(maxsize=64)
def _model_costs_cached(name: str, input_shape: tuple[int, ...], num_classes: int) -> dict[int, SplitCost]:
    # fork_rng: building the model must not advance the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(name, input_shape, num_classes)
    return split_costs(model)


def model_costs(name: str, input_shape: Sequence[int], num_classes: int) -> dict[int, SplitCost]:
    """Cached :func:`split_costs` for a model built by name (costs do not depend on weights).

    Returns a fresh dict each call (the ``SplitCost`` values are frozen), so callers may
    mutate it without poisoning the cache.
    """
    return dict(_model_costs_cached(name, tuple(int(d) for d in input_shape), int(num_classes)))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"  # unreachable


def _fmt_flops(f: float) -> str:
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(f) >= scale:
            return f"{f / scale:.2f} {unit}"
    return f"{f:.0f} FLOP"


def format_cost_table(costs: dict[int, SplitCost], block_names: Sequence[str] | None = None) -> str:
    """Human-readable table, one row per split (for ``sfl-coord models``).

    ``block_names`` (e.g. ``model.block_names``) adds a column naming the last client block.
    """
    headers = ["split"] + (["cut after"] if block_names else []) + [
        "client params", "client bytes", "client FLOPs/sample", "server FLOPs/sample",
        "activation", "act bytes/sample",
    ]
    rows: list[list[str]] = []
    for s in sorted(costs):
        c = costs[s]
        row = [str(s)]
        if block_names:
            row.append(block_names[s - 1] if 0 < s <= len(block_names) else "?")
        row += [
            f"{c.client_params:,}",
            _fmt_bytes(c.client_param_bytes),
            _fmt_flops(c.client_flops),
            _fmt_flops(c.server_flops),
            "x".join(map(str, c.activation_shape)) if c.activation_shape else "(whole model)",
            _fmt_bytes(c.activation_bytes) if c.activation_shape else "-",
        ]
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def split_note(costs: dict[int, SplitCost], split: int, input_shape: Sequence[int]) -> str | None:
    """One line when a fixed ``split`` sends far more per sample than it needs to, or ``None``.

    The sign: another cut with similar client FLOPs (within 1.5x) sends at most half the
    activation bytes per sample (what split learning pays every step, both ways).
    ``vgg_mini``'s default cut is the case that motivated it: 49 KB per sample where the next
    cut sends 2.2 KB for about as much client compute.
    """
    c = costs.get(split)
    if c is None or not c.activation_shape:
        return None
    similar = [s for s, o in costs.items()
               if s != split and o.activation_shape and 2 * o.activation_bytes <= c.activation_bytes
               and c.client_flops / 1.5 <= o.client_flops <= 1.5 * c.client_flops]
    if not similar:
        return None
    best = min(similar, key=lambda s: costs[s].activation_bytes)
    input_bytes = 4 * math.prod(int(v) for v in input_shape)
    return (f"split {split} sends {_fmt_bytes(c.activation_bytes)} of activations per sample (the input is "
            f"{_fmt_bytes(input_bytes)}); split {best} sends {_fmt_bytes(costs[best].activation_bytes)} for similar "
            f"client compute ({_fmt_flops(costs[best].client_flops)} vs {_fmt_flops(c.client_flops)} per sample): "
            f"see `sfl-coord models`")
