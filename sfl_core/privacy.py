"""What leaves a device, made harder to invert: the defenses an agent can switch on, and the
measure of how much its activations say about its inputs.

Split learning keeps raw data on the device, but the activations it sends are a function of
the raw data, and early-layer activations can often be inverted (model inversion). The
defenses here all run on the agent, so a coordinator that does not know about them trains
as usual:

- **NoPeek** (Vepakomma et al., "NoPeek: Information leakage reduction to share activations
  in distributed deep learning", ICDMW 2020): the client portion also minimises the distance
  correlation between a batch's inputs and its activations, with a weight.
- **Clipped Gaussian noise on the activations**: each sample's activations are scaled to
  an L2 norm of at most ``clip``, and Gaussian noise of standard deviation ``sigma * clip``
  is added to every coordinate before they are sent. Gradients flow through the clipping;
  the noise is a constant.

Distance correlation (Székely, Rizzo and Bakirov, "Measuring and testing dependence by
correlation of distances", Annals of Statistics 2007) is 0 for independent variables and 1
for an exact similarity transform. A benchmark reports it for what an agent sends, next to
reconstruction quality.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:   # torch is imported where it is used: run configs load without it
    import torch

__all__ = ["distance_correlation", "clip_and_noise", "ActivationNoise", "AgentPrivacy"]

_EPS = 1e-12


def _centred_distances(x: torch.Tensor) -> torch.Tensor:
    """Double-centred pairwise Euclidean distances of the rows of ``x`` (flattened per sample).

    The square root is taken of a clamped square, so identical rows (distance 0, always on the
    diagonal) give a finite gradient instead of NaN."""
    import torch

    flat = x.reshape(x.shape[0], -1).to(torch.float64)
    sq = (flat.unsqueeze(1) - flat.unsqueeze(0)).pow(2).sum(-1)
    d = sq.clamp_min(_EPS).sqrt()
    return d - d.mean(0, keepdim=True) - d.mean(1, keepdim=True) + d.mean()


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Sample distance correlation between the rows of ``x`` and of ``z`` (same batch size),
    in [0, 1]; differentiable (NoPeek minimises it). Needs at least 2 rows."""
    if x.shape[0] != z.shape[0] or x.shape[0] < 2:
        raise ValueError(f"distance correlation needs two batches of one size >= 2, got {x.shape[0]} and {z.shape[0]}")
    a, b = _centred_distances(x), _centred_distances(z)
    dcov_xz = (a * b).mean().clamp_min(0.0)
    dvar = ((a * a).mean() * (b * b).mean()).sqrt()
    return (dcov_xz / dvar.clamp_min(_EPS)).sqrt().to(z.dtype)


@dataclass(frozen=True)
class ActivationNoise:
    """Per-sample L2 clipping to ``clip``, then Gaussian noise of std ``sigma * clip``."""

    clip: float
    sigma: float

    @classmethod
    def parse(cls, value: object) -> "ActivationNoise":
        """From ``"CLIP,SIGMA"`` (a flag, an agent YAML) or ``{clip: C, sigma: S}`` (a run config);
        ValueError saying what was expected."""
        expected = "expected CLIP,SIGMA (e.g. 1.0,0.5) or {clip: number > 0, sigma: number >= 0}"
        if isinstance(value, str):
            parts = value.split(",")
        elif isinstance(value, dict) and set(value) == {"clip", "sigma"}:
            parts = [value["clip"], value["sigma"]]
        else:
            raise ValueError(expected)
        try:
            clip, sigma = (float(p) for p in parts)
        except (TypeError, ValueError):
            raise ValueError(expected) from None
        return cls(clip, sigma)

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"activation noise: clip must be > 0, got {self.clip}")
        if not self.sigma >= 0:
            raise ValueError(f"activation noise: sigma must be >= 0, got {self.sigma}")


def clip_and_noise(z: torch.Tensor, noise: ActivationNoise, generator: Optional[torch.Generator] = None
                   ) -> torch.Tensor:
    """``z`` with each sample's L2 norm clipped to ``noise.clip`` and Gaussian noise added.

    The result stays in ``z``'s autograd graph through the clipping (the agent backpropagates
    the server's gradient through it); the noise is drawn from ``generator`` (the agent's,
    so a run is reproducible) and carries no gradient."""
    import torch

    norms = z.detach().reshape(z.shape[0], -1).norm(dim=1)
    scale = (noise.clip / norms.clamp_min(_EPS)).clamp(max=1.0)
    clipped = z * scale.view(-1, *([1] * (z.dim() - 1)))
    if noise.sigma == 0:
        return clipped
    draw = torch.randn(z.shape, generator=generator, dtype=z.dtype, device="cpu").to(z.device)
    return clipped + draw * (noise.sigma * noise.clip)


@dataclass(frozen=True)
class AgentPrivacy:
    """The defenses one agent applies to what it sends (all off by default)."""

    nopeek: float = 0.0
    """Weight of the distance correlation between inputs and activations in the client's loss."""
    activation_noise: Optional[ActivationNoise] = None

    def __post_init__(self) -> None:
        if not self.nopeek >= 0:
            raise ValueError(f"nopeek weight must be >= 0, got {self.nopeek}")

    @property
    def active(self) -> bool:
        return self.nopeek > 0 or self.activation_noise is not None

    def describe(self) -> dict:
        """What a run's metrics record of these defenses."""
        out: dict = {}
        if self.nopeek > 0:
            out["nopeek"] = self.nopeek
        if self.activation_noise is not None:
            out["activation_noise"] = asdict(self.activation_noise)
        return out
