"""HeteroSFL bottleneck layers (docs/methods/heterosfl.md): an encoder at the end of the client portion that
narrows the activations from ``p̄`` to ``p`` channels, and the mirrored decoder at the start
of the server portion, trained end to end.

The coordinator keeps one full-width pair (width ``P``); an agent of width ``p <= P`` trains
the first ``p`` output channels of the encoder and the first ``p`` input channels of the
decoder (HetBL: narrow bottlenecks are prefixes of the wide one), so the full-width pair
can serve every group and be averaged channel by channel.

Shapes: image activations ``(C, H, W)`` use 1x1 ``Conv2d``; sequences ``(C, L)`` 1x1
``Conv1d``; flat features ``(F,)`` ``Linear``.
"""

from __future__ import annotations

from typing import Mapping, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F


def _layer(dims: int, cin: int, cout: int) -> Union[nn.Conv2d, nn.Conv1d, nn.Linear]:
    if dims == 3:
        return nn.Conv2d(cin, cout, kernel_size=1)
    if dims == 2:
        return nn.Conv1d(cin, cout, kernel_size=1)
    if dims == 1:
        return nn.Linear(cin, cout)
    raise ValueError(f"no bottleneck for activations of per-sample shape with {dims} dims")


def bottleneck_shape(activation_shape: Sequence[int], width: int) -> tuple[int, ...]:
    """Per-sample shape of what crosses the link: ``width`` channels instead of ``p̄``."""
    return (int(width), *activation_shape[1:])


class Bottleneck(nn.Module):
    """Encoder ``p̄ -> width`` and decoder ``width -> p̄`` at one split point."""

    def __init__(self, activation_shape: Sequence[int], width: int):
        super().__init__()
        channels = int(activation_shape[0])
        if not 1 <= width <= channels:
            raise ValueError(f"bottleneck width {width} outside 1..{channels} (the activation's channels)")
        self.activation_shape = tuple(int(d) for d in activation_shape)
        self.width = int(width)
        self.infer_width = self.width
        """Channels the full model runs at (``forward``): the widest width any agent trains."""
        self.encoder = _layer(len(activation_shape), channels, width)
        self.decoder = _layer(len(activation_shape), width, channels)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Start as an orthogonal projection: encoder rows orthonormal, decoder = their
        transpose, zero biases. Why: PyTorch's default init makes ``decode(encode(h))`` a random
        linear map that shrinks activations about threefold, and the extra depth then slows
        early training markedly; a projection passes the first ``width`` directions through
        unchanged, and every prefix of it (a narrower group's width) is a projection too."""
        enc = self.encoder.weight.view(self.width, -1)         # (width, channels)
        nn.init.orthogonal_(enc)
        self.decoder.weight.copy_(enc.t().reshape(self.decoder.weight.shape))
        for layer in (self.encoder, self.decoder):   # every _layer has a bias
            assert layer.bias is not None
            layer.bias.zero_()

    def encode(self, h: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """The first ``width`` encoder channels (all of them by default)."""
        w = self.width if width is None else width
        enc = self.encoder
        assert enc.bias is not None
        if isinstance(enc, nn.Linear):
            return F.linear(h, enc.weight[:w], enc.bias[:w])
        conv = F.conv2d if isinstance(enc, nn.Conv2d) else F.conv1d
        return conv(h, enc.weight[:w], enc.bias[:w])

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Decode ``z`` using the first ``z.shape[1]`` decoder input channels."""
        w = z.shape[1]
        dec = self.decoder
        if isinstance(dec, nn.Linear):
            return F.linear(z, dec.weight[:, :w], dec.bias)
        conv = F.conv2d if isinstance(dec, nn.Conv2d) else F.conv1d
        return conv(z, dec.weight[:, :w], dec.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(h, self.infer_width))


class Encoder(nn.Module):
    """The client-side half, as a module a Sequential can hold (shares the pair's parameters).

    The encoder layer is registered, so ``client(s).parameters()`` (what the agent's optimiser
    steps) includes it; the decoder is not."""

    def __init__(self, pair: Bottleneck):
        super().__init__()
        self.layer = pair.encoder
        self._pair = [pair]  # a list: the decoder stays out of this module's parameters

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self._pair[0].encode(h)


class Decoder(nn.Module):
    """The server-side half; registers only the decoder layer (see :class:`Encoder`)."""

    def __init__(self, pair: Bottleneck):
        super().__init__()
        self.layer = pair.decoder
        self._pair = [pair]

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self._pair[0].decode(z)


def covered_width(latest: Mapping[str, int], label_counts: Mapping[str, Sequence[int]],
                  population: Sequence[int]) -> int:
    """The width the global model should run a bottleneck at: the widest ``w`` whose channels
    were trained on every class, that is, whose trainers (the agents whose latest width is at
    least ``w``) together hold every class the fleet holds; the narrowest width in use when
    none does.

    Why: channels ``w_N..w`` are trained only by the agents of width ≥ ``w``. When label skew
    follows the link groups, the wide group may never see some classes, and a model evaluated
    through its channels misclassifies them wholesale, however well the narrow channels,
    trained by everyone, know them. (Only absent classes count: a class the wide group holds
    little of still shapes its channels, and evaluating narrower costs accuracy where it does.)
    ``latest``: each agent's latest width (> 0); ``population``: the fleet's label counts. An
    agent whose label counts are unknown (empty) counts as holding every class."""
    widths = sorted(set(latest.values()), reverse=True)
    if not widths:
        raise ValueError("covered_width: no agent has trained at a width")
    present = [c for c, n in enumerate(population) if n > 0]
    for w in widths:
        seen: set[int] = set()
        for a, aw in latest.items():
            counts = label_counts.get(a) or []
            if aw >= w:
                seen |= set(present) if not counts else {c for c, n in enumerate(counts) if n > 0}
        if all(c in seen for c in present):
            return w
    return widths[-1]


def slice_state(state: dict[str, torch.Tensor], prefix: str, width: int) -> dict[str, torch.Tensor]:
    """The entries of a full-width pair (keys under ``prefix``) that an agent of ``width`` holds:
    encoder rows and decoder columns ``[:width]``; the decoder bias is whole."""
    out = {}
    for k, v in state.items():
        if not k.startswith(prefix):
            continue
        part = k[len(prefix):]
        if part.startswith("encoder."):
            out[k] = v[:width]
        elif part == "decoder.weight":
            out[k] = v[:, :width]
        else:
            out[k] = v
    return out
