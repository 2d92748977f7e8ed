"""Splittable model zoo.

Every model is a :class:`SplitModel`: an ordered list of blocks. A split point ``s``
puts ``blocks[:s]`` (the *client portion* ``Wc``) on the agent and ``blocks[s:]``
(the *server portion* ``Ws``) on the coordinator. Keeping the model as a flat list of
coarse blocks (one conv layer / residual block / depthwise-separable block each) is what
makes per-split accounting, layer-wise aggregation and mixed split points trivial: the
state-dict key ``blocks.<i>.…`` tells you which side owns a tensor.

All image models accept ``(C, H, W)`` inputs, in particular ``(1, 8, 8)`` (sklearn
digits), ``(1, 28, 28)`` (MNIST / Fashion-MNIST) and ``(3, 32, 32)`` (CIFAR). They only
downsample (max-pool or stride 2) while the spatial size is still > 1, and size their
classifier from a dry run (or use adaptive average pooling), so small inputs never
collapse to zero size. ``cnn1d`` takes ``(channels, length)`` sensor windows, e.g.
``(9, 128)`` for UCI HAR.

Construction is deterministic given ``torch.manual_seed`` set by the caller (the dry runs
feed zeros and consume no randomness).
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from sfl_core.model.bottleneck import Bottleneck, Decoder, Encoder
from sfl_core.plugins import load_entry_points

__all__ = ["CANDIDATE_SPLITS", "candidate_splits", "SplitModel", "MODEL_NAMES", "NORMS", "ModelSpec", "build_model", "model_base_name", "model_names",
           "register_model"]


class SplitModel(nn.Module):
    """A model as an ordered list of blocks; split point ``s`` puts ``blocks[:s]`` on the
    agent and ``blocks[s:]`` on the server.

    ``split_points`` are the *proper* cuts (``1 <= s <= num_blocks - 1``). In addition
    ``s == num_blocks`` is always accepted: the whole model on the agent (FedAvg).
    """

    def __init__(
        self,
        name: str,
        blocks: list[nn.Module],
        split_points: Sequence[int],
        default_split: int,
        input_shape: tuple[int, ...],
        num_classes: int,
        block_names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if len(blocks) < 1:
            raise ValueError(f"{name}: a SplitModel needs at least one block")
        self.name = name
        self.blocks = nn.ModuleList(blocks)
        n = len(blocks)
        pts = tuple(sorted(set(int(s) for s in split_points)))
        bad = [s for s in pts if not 1 <= s <= n - 1]
        if bad:
            raise ValueError(f"{name}: split points {bad} outside 1..{n - 1} for {n} blocks")
        self.split_points: tuple[int, ...] = pts
        if block_names is None:
            block_names = tuple(f"block{i}" for i in range(n))
        if len(block_names) != n:
            raise ValueError(f"{name}: {len(block_names)} block names for {n} blocks")
        self.block_names: tuple[str, ...] = tuple(block_names)
        self.input_shape: tuple[int, ...] = tuple(int(d) for d in input_shape)
        self.num_classes = int(num_classes)
        self.check_split(default_split)
        self.default_split = int(default_split)
        # HeteroSFL bottlenecks, keyed by split point; empty unless add_bottleneck() was called
        self.bottlenecks = nn.ModuleDict()

    # ------------------------------------------------------------------ structure
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def valid_splits(self) -> tuple[int, ...]:
        """Proper split points plus ``num_blocks`` (whole model on the agent)."""
        return self.split_points + (self.num_blocks,)

    def check_split(self, s: int) -> None:
        """Raise ``ValueError`` unless ``s`` is a proper split point or ``num_blocks``."""
        ok = isinstance(s, numbers.Integral) and not isinstance(s, bool) and int(s) in self.valid_splits
        if not ok:
            raise ValueError(
                f"model {self.name!r}: invalid split point {s!r}; valid split points are "
                f"{list(self.valid_splits)} ({self.num_blocks} = whole model on the agent)"
            )

    def forward(self, x: Tensor) -> Tensor:
        for i, block in enumerate(self.blocks):
            if str(i) in self.bottlenecks:
                x = self.bottlenecks[str(i)](x)
            x = block(x)
        return x

    # ------------------------------------------------------------------ bottlenecks
    def add_bottleneck(self, s: int, width: int) -> Bottleneck:
        """Insert a HeteroSFL bottleneck (encoder/decoder pair of ``width``) at split ``s``."""
        self.check_split(s)
        if int(s) >= self.num_blocks:
            raise ValueError(f"model {self.name!r}: no bottleneck at split {s} (the whole model is on the agent)")
        shape = self.input_shape
        for block in self.blocks[: int(s)]:
            shape = _dry_run_shape(block, shape)
        pair = Bottleneck(shape, width)
        self.bottlenecks[str(int(s))] = pair
        return pair

    def bottleneck(self, s: int) -> Bottleneck | None:
        pair = self.bottlenecks[str(int(s))] if str(int(s)) in self.bottlenecks else None
        return pair if isinstance(pair, Bottleneck) else None

    def client(self, s: int) -> nn.Sequential:
        """``blocks[:s]`` (plus the encoder of a bottleneck at ``s``), sharing module objects.

        A bottleneck is a layer of the model: a pair at an earlier cut runs whole (encode and
        decode at its ``infer_width``) inside this portion, as in :meth:`forward`."""
        self.check_split(s)
        parts: list[nn.Module] = []
        for i, block in enumerate(self.blocks[: int(s)]):
            earlier = self.bottleneck(i)
            if earlier is not None:
                parts.append(earlier)
            parts.append(block)
        pair = self.bottleneck(s)
        if pair is not None:
            parts.append(Encoder(pair))
        return nn.Sequential(*parts)

    def server(self, s: int) -> nn.Sequential:
        """``blocks[s:]`` (after the decoder of a bottleneck at ``s``); empty for ``s == num_blocks``.
        A pair at a later cut runs whole inside this portion (see :meth:`client`)."""
        self.check_split(s)
        pair = self.bottleneck(s)
        parts: list[nn.Module] = [Decoder(pair)] if pair is not None else []
        for i in range(int(s), self.num_blocks):
            later = self.bottleneck(i) if i > int(s) else None
            if later is not None:
                parts.append(later)
            parts.append(self.blocks[i])
        return nn.Sequential(*parts)

    # ------------------------------------------------------------------ state
    @staticmethod
    def _block_index(key: str) -> int:
        # keys look like "blocks.3.conv.weight" or "bottlenecks.2.encoder.weight"
        return int(key.split(".", 2)[1])

    def _owner(self, key: str, s: int) -> str:
        """'client', 'server' or 'other' for a state key at split ``s``."""
        i = self._block_index(key)
        if key.startswith("bottlenecks.") and i == int(s):
            return "client" if key.split(".")[2] == "encoder" else "server"
        # a block, or a bottleneck at another cut (a whole layer of the side that runs it)
        return "client" if i < int(s) else "server"

    def client_keys(self, s: int) -> list[str]:
        """State-dict keys (parameters AND buffers) of ``blocks[:s]``, of bottlenecks before ``s``
        and of an encoder at ``s``."""
        self.check_split(s)
        return [k for k in self.state_dict() if self._owner(k, s) == "client"]

    def server_keys(self, s: int) -> list[str]:
        """State-dict keys of ``blocks[s:]``, of bottlenecks after ``s`` and of a decoder at ``s``."""
        self.check_split(s)
        return [k for k in self.state_dict() if self._owner(k, s) == "server"]

    def client_state(self, s: int) -> dict[str, Tensor]:
        """Subset of ``state_dict()`` for ``blocks[:s]`` (detached, same key names)."""
        keys = set(self.client_keys(s))
        return {k: v.detach() for k, v in self.state_dict().items() if k in keys}

    def server_state(self, s: int) -> dict[str, Tensor]:
        """Subset of ``state_dict()`` for ``blocks[s:]`` (detached, same key names)."""
        keys = set(self.server_keys(s))
        return {k: v.detach() for k, v in self.state_dict().items() if k in keys}

    def extra_repr(self) -> str:
        return f"name={self.name!r}, splits={list(self.valid_splits)}, default_split={self.default_split}"


# ====================================================================== helpers


def _check_image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(
            f"model {name!r} expects an image input shape (channels, height, width), got {input_shape!r}"
        )
    c, h, w = input_shape
    return c, h, w


def _dry_run_shape(block: nn.Module, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per-sample output shape of ``block`` for per-sample input ``shape``.

    Runs in eval mode on zeros (BatchNorm with batch 1 would refuse train mode) and
    restores the mode, so it neither consumes randomness nor touches running stats.
    """
    was_training = block.training
    block.eval()
    try:
        with torch.no_grad():
            out = block(torch.zeros(1, *shape))
    finally:
        block.train(was_training)
    return tuple(out.shape[1:])


def _can_downsample(shape: tuple[int, ...]) -> bool:
    """True while every spatial dim is > 1 (pooling a size-1 dim would break or be a no-op)."""
    return all(d > 1 for d in shape[1:])


class _Builder:
    """Accumulates named blocks while tracking the per-sample activation shape."""

    def __init__(self, input_shape: tuple[int, ...]) -> None:
        self.shape = tuple(input_shape)
        self.blocks: list[nn.Module] = []
        self.names: list[str] = []

    def add(self, name: str, block: nn.Module) -> None:
        self.shape = _dry_run_shape(block, self.shape)
        self.blocks.append(block)
        self.names.append(name)

    @property
    def channels(self) -> int:
        return self.shape[0]

    @property
    def flat(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def finish(self, name: str, default_split: int, input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
        n = len(self.blocks)
        return SplitModel(
            name, self.blocks, range(1, n), default_split, input_shape, num_classes, block_names=self.names
        )


NORMS: tuple[str, ...] = ("batch", "group", "none")


def _group_count(channels: int) -> int:
    """GroupNorm groups: the largest divisor of ``channels`` that is <= 32 and leaves >= 2
    channels per group (Wu & He's 32 groups, shrunk for the narrow layers of a width-scaled model)."""
    cap = max(1, min(32, channels // 2))
    return max(g for g in range(1, cap + 1) if channels % g == 0)


def _norm(kind: str, channels: int, dims: int = 2) -> nn.Module:
    """The normalisation layer after a conv: BatchNorm (running statistics, the papers' models),
    GroupNorm (per-sample statistics: nothing to average across label-skewed agents) or none."""
    if kind == "batch":
        return nn.BatchNorm2d(channels) if dims == 2 else nn.BatchNorm1d(channels)
    if kind == "group":
        return nn.GroupNorm(_group_count(channels), channels)
    return nn.Identity()


def _scaled(channels: int, width: float) -> int:
    return max(1, int(round(channels * width)))


def _conv_bn_relu(cin: int, cout: int, shape: tuple[int, ...], *, pool: bool, norm: str | None = "batch",
                  kernel: int = 3) -> nn.Sequential:
    """conv (+ norm) + ReLU (+ max-pool while the map can still shrink); ``norm=None`` = a model
    that has no normalisation by design (AlexNet, small_cnn)."""
    has_norm = norm is not None and norm != "none"
    layers: dict[str, nn.Module] = {
        "conv": nn.Conv2d(cin, cout, kernel, padding=kernel // 2, bias=not has_norm),
    }
    if norm is not None and has_norm:
        layers["bn"] = _norm(norm, cout)
    layers["relu"] = nn.ReLU(inplace=False)
    if pool and _can_downsample(shape):
        layers["pool"] = nn.MaxPool2d(2)
    return nn.Sequential(OrderedDict(layers))


def _classifier(in_features: int, num_classes: int, *, avgpool: bool, dims: int = 2) -> nn.Sequential:
    layers: dict[str, nn.Module] = {}
    if avgpool:
        layers["avgpool"] = nn.AdaptiveAvgPool2d(1) if dims == 2 else nn.AdaptiveAvgPool1d(1)
    layers["flatten"] = nn.Flatten()
    layers["linear"] = nn.Linear(in_features, num_classes)
    return nn.Sequential(OrderedDict(layers))


# ====================================================================== models


def small_cnn(input_shape: tuple[int, ...], num_classes: int, *, width: float = 1.0, norm: str = "none") -> SplitModel:
    """Tiny CNN for tests and demos: conv16 | conv32+pool | fc64 | fc. Default split 2
    (after the pooled conv stage: smallest activation before the dense layers)."""
    c, _, _ = _check_image_shape("small_cnn", input_shape)
    w1, w2, w3 = (_scaled(ch, width) for ch in (16, 32, 64))
    b = _Builder(input_shape)
    b.add("conv1", nn.Sequential(nn.Conv2d(c, w1, 3, padding=1), nn.ReLU()))
    b.add("conv2", _conv_bn_relu(w1, w2, b.shape, pool=True, norm=None))
    b.add("fc1", nn.Sequential(nn.Flatten(), nn.Linear(b.flat, w3), nn.ReLU()))
    b.add("fc", _classifier(w3, num_classes, avgpool=False))
    return b.finish("small_cnn", 2, input_shape, num_classes)


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs + norm) with a 1x1-conv projection shortcut when
    the shape changes (option B)."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str = "batch") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = _norm(norm, cout)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _norm(norm, cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def resnet8(input_shape: tuple[int, ...], num_classes: int, *, width: float = 1.0, norm: str = "batch") -> SplitModel:
    """CIFAR ResNet-8 in the He et al. 6n+2 family with n = 1 (the variant used by FedML
    and S2FL-style SFL papers): 3x3 stem (16 ch) | layer1 16 | layer2 32 (/2) |
    layer3 64 (/2) | avgpool+fc. ~78k parameters. Default split 2 (stem + layer1)."""
    c, _, _ = _check_image_shape("resnet8", input_shape)
    b = _Builder(input_shape)
    stem = _scaled(16, width)
    b.add("stem", nn.Sequential(nn.Conv2d(c, stem, 3, padding=1, bias=False), _norm(norm, stem), nn.ReLU()))
    for i, ch in enumerate((16, 32, 64), start=1):
        stride = 2 if (i > 1 and _can_downsample(b.shape)) else 1
        b.add(f"layer{i}", BasicBlock(b.channels, _scaled(ch, width), stride, norm))
    b.add("fc", _classifier(b.channels, num_classes, avgpool=True))
    return b.finish("resnet8", 2, input_shape, num_classes)


_VGG_CFG: dict[str, list[int | str]] = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}


def _vgg(name: str, input_shape: tuple[int, ...], num_classes: int, width: float, norm: str) -> SplitModel:
    """CIFAR VGG with normalisation: one block per conv layer (conv+norm+ReLU, plus the
    following max-pool if any), then avgpool+flatten+Linear(512, classes) — the compact
    classifier CIFAR variants use. Default split 1 (after the first conv)."""
    _check_image_shape(name, input_shape)
    cfg = _VGG_CFG[name]
    b = _Builder(input_shape)
    k = 0
    for i, v in enumerate(cfg):
        if v == "M":
            continue
        pool = i + 1 < len(cfg) and cfg[i + 1] == "M"
        k += 1
        b.add(f"conv{k}", _conv_bn_relu(b.channels, _scaled(int(v), width), b.shape, pool=pool, norm=norm))
    b.add("fc", _classifier(b.channels, num_classes, avgpool=True))
    return b.finish(name, 1, input_shape, num_classes)


def vgg_mini(input_shape: tuple[int, ...], num_classes: int, *, width: float = 1.0, norm: str = "batch") -> SplitModel:
    """VGG-style net sized for quick CPU runs: conv16+pool | conv32+pool | conv256 | 1x1
    conv64+pool | avgpool+fc. Its server portion at the default split 3 is a 1x1 conv and the
    classifier, so a HeteroSFL decoder collapses into it and widths above 64 cannot matter:
    for bottleneck studies use ``vgg11`` cut after three convs (split 3, p̄ = 256)."""
    _check_image_shape("vgg_mini", input_shape)
    b = _Builder(input_shape)
    b.add("conv1", _conv_bn_relu(b.channels, _scaled(16, width), b.shape, pool=True, norm=norm))
    b.add("conv2", _conv_bn_relu(b.channels, _scaled(32, width), b.shape, pool=True, norm=norm))
    b.add("conv3", _conv_bn_relu(b.channels, _scaled(256, width), b.shape, pool=False, norm=norm))
    b.add("conv4", _conv_bn_relu(b.channels, _scaled(64, width), b.shape, pool=True, norm=norm, kernel=1))
    b.add("fc", _classifier(b.channels, num_classes, avgpool=True))
    return b.finish("vgg_mini", 3, input_shape, num_classes)


def vgg11(input_shape: tuple[int, ...], num_classes: int, *, width: float = 1.0, norm: str = "batch") -> SplitModel:
    return _vgg("vgg11", input_shape, num_classes, width, norm)


def vgg16(input_shape: tuple[int, ...], num_classes: int, *, width: float = 1.0, norm: str = "batch") -> SplitModel:
    return _vgg("vgg16", input_shape, num_classes, width, norm)


def alexnet(input_shape: tuple[int, ...], num_classes: int, *, width: float = 1.0, norm: str = "none") -> SplitModel:
    """CIFAR AlexNet: 5 conv blocks (64/192/384/256/256, 3x3, ReLU, pools after 1, 2, 5;
    no normalisation by default, like the original) and a 512-512 classifier sized from a
    dry run. Default split 1 (after conv1+pool)."""
    _check_image_shape("alexnet", input_shape)
    b = _Builder(input_shape)
    for i, (ch, pool) in enumerate(((64, True), (192, True), (384, False), (256, False), (256, True)), 1):
        b.add(f"conv{i}", _conv_bn_relu(b.channels, _scaled(ch, width), b.shape, pool=pool, norm=norm))
    fc = _scaled(512, width)
    b.add("fc1", nn.Sequential(nn.Flatten(), nn.Linear(b.flat, fc), nn.ReLU()))
    b.add("fc2", nn.Sequential(nn.Linear(fc, fc), nn.ReLU()))
    b.add("fc", _classifier(fc, num_classes, avgpool=False))
    return b.finish("alexnet", 1, input_shape, num_classes)


class DepthwiseSeparable(nn.Module):
    """MobileNet v1 block: depthwise 3x3 conv + norm + ReLU, pointwise 1x1 conv + norm + ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str = "batch") -> None:
        super().__init__()
        self.dw = nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False)
        self.bn1 = _norm(norm, cin)
        self.pw = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn2 = _norm(norm, cout)
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.dw(x)))
        return self.relu(self.bn2(self.pw(x)))


_MOBILENET_CFG: list[tuple[int, int]] = [
    (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
    (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1),
]


def mobilenet_v1(input_shape: tuple[int, ...], num_classes: int, *, width: float = 1.0,
                 norm: str = "batch") -> SplitModel:
    """CIFAR MobileNet v1: 3x3 stem (stride 1) then 13 depthwise-separable blocks
    (one block each), avgpool+fc. ``width`` is the width multiplier of the paper.
    Default split 2 (stem + first dw block)."""
    c, _, _ = _check_image_shape("mobilenet_v1", input_shape)
    b = _Builder(input_shape)
    stem = _scaled(32, width)
    b.add("stem", nn.Sequential(nn.Conv2d(c, stem, 3, padding=1, bias=False), _norm(norm, stem), nn.ReLU()))
    for i, (ch, stride) in enumerate(_MOBILENET_CFG, start=1):
        st = stride if _can_downsample(b.shape) else 1
        b.add(f"dw{i}", DepthwiseSeparable(b.channels, _scaled(ch, width), st, norm))
    b.add("fc", _classifier(b.channels, num_classes, avgpool=True))
    return b.finish("mobilenet_v1", 2, input_shape, num_classes)


def cnn1d(input_shape: tuple[int, ...], num_classes: int, *, width: float = 1.0, norm: str = "batch") -> SplitModel:
    """1-D CNN for sensor windows ``(channels, length)``, e.g. UCI HAR ``(9, 128)``:
    conv64 k5 | conv128 k5 | conv128 k3 (each norm+ReLU+pool/2 while length > 1) |
    avgpool+fc100 | fc. Default split 1 (after the first conv)."""
    if len(input_shape) != 2:
        raise ValueError(
            f"model 'cnn1d' expects a sensor input shape (channels, length), got {input_shape!r}"
        )
    b = _Builder(input_shape)
    for i, (ch, k) in enumerate(((64, 5), (128, 5), (128, 3)), start=1):
        out = _scaled(ch, width)
        layers: dict[str, nn.Module] = {
            "conv": nn.Conv1d(b.channels, out, k, padding=k // 2, bias=False),
            "bn": _norm(norm, out, dims=1),
            "relu": nn.ReLU(),
        }
        if _can_downsample(b.shape):
            layers["pool"] = nn.MaxPool1d(2)
        b.add(f"conv{i}", nn.Sequential(OrderedDict(layers)))
    hidden = _scaled(100, width)
    b.add("fc1", nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(b.channels, hidden), nn.ReLU()))
    b.add("fc", _classifier(hidden, num_classes, avgpool=False))
    return b.finish("cnn1d", 1, input_shape, num_classes)


_BUILDERS: dict[str, Callable[..., SplitModel]] = {
    "small_cnn": small_cnn,
    "resnet8": resnet8,
    "vgg_mini": vgg_mini,
    "vgg11": vgg11,
    "vgg16": vgg16,
    "alexnet": alexnet,
    "mobilenet_v1": mobilenet_v1,
    "cnn1d": cnn1d,
}

MODEL_NAMES: tuple[str, ...] = ("small_cnn", "resnet8", "vgg_mini", "vgg11", "vgg16", "alexnet", "mobilenet_v1", "cnn1d")
"""The built-in zoo; :func:`model_names` adds the models registered since."""

_NATIVE_NORM = {"small_cnn": "none", "alexnet": "none"}   # models designed without normalisation

ENTRY_POINT_GROUP = "sfl_edge.models"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")


CANDIDATE_SPLITS: dict[str, tuple[int, ...]] = {
    # Where each zoo model may be cut: the split points methods choose among (S2FL's sliding
    # split, auto's cuts, FedFC's mixed cuts); register_model(candidate_splits=...) adds to it.
    "small_cnn": (1, 2, 3),
    "resnet8": (2, 3, 4),
    "vgg_mini": (1, 2, 4),
    "vgg11": (2, 4, 6),
    "vgg16": (2, 4, 7),
    "alexnet": (2, 4, 5),
    "mobilenet_v1": (3, 5, 7),
    "cnn1d": (1, 2, 3),
}


def candidate_splits(model_name: str, k: Optional[int] = None) -> tuple[int, ...]:
    """The model's candidate split points, ascending (smallest client portion first).

    With ``k`` (``1 <= k <= K``), an evenly spread subset that keeps the first and last
    candidate (for ``k >= 2``), so a smaller K still spans the whole shared part;
    ``k == 1`` gives the first (lightest) candidate.
    """
    base = model_name.partition(":")[0]   # a width/norm variant keeps its model's cuts
    if base not in CANDIDATE_SPLITS:
        raise ValueError(f"no candidate splits for model {model_name!r}; known: {sorted(CANDIDATE_SPLITS)} "
                         f"(set s2fl.candidates in the run config)")
    c = CANDIDATE_SPLITS[base]
    if k is None:
        return c
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= len(c):
        raise ValueError(f"model {model_name!r} has {len(c)} candidate splits {list(c)}; k must be 1..{len(c)}, got {k!r}")
    if k == 1:
        return c[:1]
    return tuple(c[round(i * (len(c) - 1) / (k - 1))] for i in range(k))


def register_model(name: str, builder: Callable[..., SplitModel], *, candidate_splits: Sequence[int] | None = None,
                   norms: bool = True, replace: bool = False) -> None:
    """Add a model to the zoo, so run configs, agents and every command can name it.

    ``builder(input_shape, num_classes, *, width=1.0, norm="batch")`` returns a
    :class:`SplitModel` whose block boundaries are the split points. ``candidate_splits``
    are the cuts S2FL slides between (needed for ``strategy: s2fl`` only). ``norms=False``
    says the model has no normalisation layers (``norm`` is then always ``"none"``).
    Agents build the model from its name, so they must register it too: package it and
    declare an entry point in the ``sfl_edge.models`` group (loaded on first use) rather
    than calling this in one process only.
    """
    if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS:
        raise ValueError(f"model name must be lower-case letters, digits, '_' or '-', got {name!r}")
    if not callable(builder):
        raise ValueError(f"model {name!r}: builder must be callable, got {builder!r}")
    if name in _BUILDERS and not replace:
        raise ValueError(f"model {name!r} is already registered (pass replace=True to override it)")
    _BUILDERS[name] = builder
    if not norms:
        _NATIVE_NORM[name] = "none"
    else:
        _NATIVE_NORM.pop(name, None)
    if candidate_splits is not None:
        cands = tuple(sorted({int(c) for c in candidate_splits}))
        if not cands or cands[0] < 1:
            raise ValueError(f"model {name!r}: candidate_splits must be split points >= 1, got {candidate_splits!r}")
        CANDIDATE_SPLITS[name] = cands


def model_names() -> tuple[str, ...]:
    """Every model a config may name: the zoo, then registered and entry-point models."""
    _load_entry_points()
    return tuple(_BUILDERS)


def _load_entry_points() -> None:
    """Register the models that installed packages declare in the ``sfl_edge.models`` group
    (each entry point: a builder; its optional ``candidate_splits`` and ``norms`` attributes are used)."""
    load_entry_points(ENTRY_POINT_GROUP, lambda name, builder: register_model(
        name, builder, candidate_splits=getattr(builder, "candidate_splits", None),
        norms=getattr(builder, "norms", True)), _BUILDERS, "model")


@dataclass(frozen=True)
class ModelSpec:
    """A zoo model and its options, written as one string so it travels wherever a model name
    does (run config, assignment, checkpoint): ``vgg16``, ``vgg16:width=0.25``,
    ``resnet8:norm=group``, ``vgg11:width=0.5,norm=group``.

    ``width`` multiplies every layer's channels (and hidden units): the knob that makes a
    CPU-sized replica of a paper's model. ``norm`` picks the normalisation after each conv:
    ``batch`` (BatchNorm, default for the models that have it), ``group`` (GroupNorm, whose
    statistics are per sample, so averaging label-skewed agents' models cannot skew them) or
    ``none``.
    """

    name: str
    width: float = 1.0
    norm: str | None = None   # None = the model's own (batch, or none for small_cnn/alexnet)

    @classmethod
    def parse(cls, spec: str) -> "ModelSpec":
        """Parse ``name[:key=value,...]``; ``ValueError`` names the offending part."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"model must be a name like 'vgg16' or 'vgg16:width=0.25', got {spec!r}")
        name, _, opts = spec.strip().partition(":")
        if name not in _BUILDERS:
            _load_entry_points()
        if name not in _BUILDERS:
            raise ValueError(f"unknown model {name!r}; choose one of {list(model_names())}")
        width, norm = 1.0, None
        for part in filter(None, (p.strip() for p in opts.split(","))):
            key, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"model {spec!r}: option {part!r} is not key=value")
            if key == "width":
                try:
                    width = float(value)
                except ValueError:
                    raise ValueError(f"model {spec!r}: width must be a number, got {value!r}") from None
                if not 0 < width <= 8:
                    raise ValueError(f"model {spec!r}: width must be in (0, 8], got {value}")
            elif key == "norm":
                if value not in NORMS:
                    raise ValueError(f"model {spec!r}: norm must be one of {', '.join(NORMS)}, got {value!r}")
                if name in _NATIVE_NORM and value != "none":
                    raise ValueError(f"model {spec!r}: {name} has no normalisation layers to replace")
                norm = value
            else:
                raise ValueError(f"model {spec!r}: unknown option {key!r} (options: width, norm)")
        return cls(name, width, norm)

    def __str__(self) -> str:
        opts = ([f"width={self.width:g}"] if self.width != 1.0 else []) + ([f"norm={self.norm}"] if self.norm else [])
        return self.name + (":" + ",".join(opts) if opts else "")


def model_base_name(spec: str) -> str:
    """``'vgg16:width=0.25'`` -> ``'vgg16'`` (what per-model tables such as candidate splits key on)."""
    return ModelSpec.parse(spec).name


def build_model(name: str, input_shape: Sequence[int], num_classes: int) -> SplitModel:
    """Build model ``name`` (a zoo name or a :class:`ModelSpec` string) for per-sample
    ``input_shape`` and ``num_classes`` outputs. The model's ``name`` is the canonical spec.

    Raises ``ValueError`` for an unknown name (listing :data:`MODEL_NAMES`) or option, a
    malformed input shape, an input shape of the wrong rank for the model, or ``num_classes < 1``.
    """
    spec = ModelSpec.parse(name)
    try:
        shape = tuple(int(d) for d in input_shape)
    except (TypeError, ValueError):
        raise ValueError(f"model {name!r}: input_shape must be a sequence of ints, got {input_shape!r}") from None
    if not shape or any(d < 1 for d in shape) or any(int(d) != d for d in input_shape):
        raise ValueError(f"model {name!r}: input_shape must be positive ints, got {input_shape!r}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 1:
        raise ValueError(f"model {name!r}: num_classes must be an int >= 1, got {num_classes!r}")
    norm = spec.norm or _NATIVE_NORM.get(spec.name, "batch")
    model = _BUILDERS[spec.name](shape, int(num_classes), width=spec.width, norm=norm)
    if not isinstance(model, SplitModel):
        model = as_split_model(spec.name, model, shape, int(num_classes))
    model.name = str(spec)
    return model


def as_split_model(name: str, module: Any, input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """A user's model as a :class:`SplitModel`: an ``nn.Sequential`` (each child a block), or a
    module that lists its blocks in ``blocks``. Every block boundary is a candidate split; the
    default split is the middle one. ValueError in one line for anything else."""
    if isinstance(module, nn.Sequential):
        names = [f"{key}:{type(child).__name__}" for key, child in module.named_children()]
        blocks = list(module.children())
    elif isinstance(getattr(module, "blocks", None), (nn.ModuleList, nn.Sequential, list, tuple)):
        blocks = list(module.blocks)
        names = [f"{i}:{type(b).__name__}" for i, b in enumerate(blocks)]
    else:
        raise ValueError(f"model {name!r}: its builder returned a {type(module).__name__}, not a SplitModel, an "
                         f"nn.Sequential or a module with a 'blocks' list (docs: 'Your own model')")
    if not all(isinstance(b, nn.Module) for b in blocks) or len(blocks) < 2:
        raise ValueError(f"model {name!r}: needs at least two blocks (nn.Module each) to split between, got "
                         f"{len(blocks)}")
    n = len(blocks)
    return SplitModel(name, blocks, range(1, n), default_cut(blocks, input_shape), input_shape, num_classes,
                      block_names=names)


def default_cut(blocks: Sequence[nn.Module], input_shape: tuple[int, ...]) -> int:
    """The default split of a user's model: the block boundary nearest the middle of the model
    that comes right after a reduction (the activation there is smaller than at the boundary
    before: a pooling or strided layer), else the middle one. Why: in a flat ``nn.Sequential``
    (one layer per block) the middle can fall between a ReLU and its MaxPool, and a device would
    then send four times the bytes of the cut one layer later, for the same compute."""
    n = len(blocks)
    middle = max(1, n // 2)
    sizes = []
    modes = [(m, m.training) for b in blocks for m in b.modules()]
    try:
        for b in blocks:
            b.eval()
        with torch.no_grad():
            x = torch.zeros(1, *input_shape)
            for b in blocks[:-1]:
                x = b(x)
                sizes.append(x.numel())
    except Exception:   # the user's code: the plain middle, and building reports any real problem
        return middle
    finally:
        for m, training in modes:
            m.training = training
    previous = [math.prod(input_shape)] + sizes[:-1]
    reduced = [s for s in range(1, n) if sizes[s - 1] < previous[s - 1]]
    return min(reduced, key=lambda s: (abs(s - middle), s)) if reduced else middle
