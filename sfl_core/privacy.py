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
- **Label protection**, for an agent that withholds its labels: the gradient of its loss
  with respect to the logits (which it returns) points at the label, since the label's
  coordinate is its only negative one. ``max_norm`` (Li et al., "Label Leakage and
  Protection in Two-party Split Learning", ICLR 2022) adds Gaussian noise to each sample's
  gradient so that its expected norm equals the batch's largest; ``sigma`` adds noise of
  ``sigma`` times the largest possible per-sample norm (sqrt 2) to every sample.
- **DP-SGD on the client portion** (Abadi et al., "Deep Learning with Differential Privacy",
  CCS 2016): each sample's gradient of the client's weights is clipped to ``clip`` and
  Gaussian noise of std ``sigma * clip`` is added to their sum. The weights the agent sends
  for aggregation are then (epsilon, delta)-differentially private with respect to its
  samples; the privacy accountant of Opacus gives epsilon. The activations are not covered.

Distance correlation (Székely, Rizzo and Bakirov, "Measuring and testing dependence by
correlation of distances", Annals of Statistics 2007) is 0 for independent variables and 1
for an exact similarity transform. A benchmark reports it for what an agent sends, next to
reconstruction quality.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:   # torch is imported where it is used: run configs load without it
    import torch

__all__ = ["distance_correlation", "distance_correlation_u", "clip_scales", "clip_and_noise", "ActivationNoise", "LabelProtection",
           "protect_label_grads", "DpSgd", "clip_and_noise_per_sample", "dp_sgd_gradients", "require_accountant", "dp_epsilon", "AgentPrivacy",
           "privacy_summary"]

_EPS = 1e-12


def _batch_norms() -> tuple:
    import torch

    return (torch.nn.modules.batchnorm._BatchNorm,)


def _centred_distances(x: torch.Tensor) -> torch.Tensor:
    """Double-centred pairwise Euclidean distances of the rows of ``x`` (flattened per sample).

    The square root is taken of a clamped square, so identical rows (distance 0, always on the
    diagonal) give a finite gradient instead of NaN."""
    import torch

    flat = x.reshape(x.shape[0], -1).to(torch.float64)
    norms = flat.pow(2).sum(1)
    sq = norms.unsqueeze(1) + norms.unsqueeze(0) - 2 * flat @ flat.T   # n x n memory, not n x n x features
    d = sq.clamp_min(_EPS).sqrt()
    return d - d.mean(0, keepdim=True) - d.mean(1, keepdim=True) + d.mean()


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Sample distance correlation between the rows of ``x`` and of ``z`` (same batch size),
    in [0, 1]; differentiable (NoPeek minimises it). Needs at least 2 rows.

    Biased upwards in high dimension (independent 1,000-dimensional samples score near 1):
    fine as a training signal, misleading as a measurement; see :func:`distance_correlation_u`."""
    _same_batch(x, z, 2)
    a, b = _centred_distances(x), _centred_distances(z)
    dcov_xz = (a * b).mean().clamp_min(0.0)
    dvar = ((a * a).mean() * (b * b).mean()).sqrt()
    return (dcov_xz / dvar.clamp_min(_EPS)).sqrt().to(z.dtype)


def distance_correlation_u(x: torch.Tensor, z: torch.Tensor) -> float:
    """The bias-corrected squared distance correlation (Székely and Rizzo, "The distance
    correlation t-test of independence in high dimension", J. Multivariate Analysis 2013):
    U-centred distance matrices, expectation 0 under independence in any dimension, 1 for a
    similarity transform. Can come out slightly negative. Needs at least 4 rows."""
    import torch

    _same_batch(x, z, 4)

    def u_centred(t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(t.shape[0], -1).to(torch.float64)
        d = torch.cdist(flat, flat)
        n = d.shape[0]
        u = (d - d.sum(0, keepdim=True) / (n - 2) - d.sum(1, keepdim=True) / (n - 2)
             + d.sum() / ((n - 1) * (n - 2)))
        return u.fill_diagonal_(0.0)

    a, b = u_centred(x), u_centred(z)
    xz, xx, zz = (a * b).sum(), (a * a).sum(), (b * b).sum()
    return float(xz / (xx * zz).sqrt().clamp_min(_EPS))


def _same_batch(x: torch.Tensor, z: torch.Tensor, least: int) -> None:
    if x.shape[0] != z.shape[0] or x.shape[0] < least:
        raise ValueError(f"distance correlation needs two batches of one size >= {least}, "
                         f"got {x.shape[0]} and {z.shape[0]}")


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


def clip_scales(z: torch.Tensor, clip: float) -> torch.Tensor:
    """Per-sample factors in (0, 1] that bring each row of ``z`` to an L2 norm of at most
    ``clip``; computed without gradient (the clipping is a per-sample rescaling)."""
    norms = z.detach().reshape(z.shape[0], -1).norm(dim=1)
    return (clip / norms.clamp_min(_EPS)).clamp(max=1.0)


def _rows(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-sample vector shaped to broadcast over ``like``'s rows."""
    return v.view(-1, *([1] * (like.dim() - 1)))


def _gaussian(shape, std: float, generator: Optional[torch.Generator], like: torch.Tensor) -> torch.Tensor:
    """Noise drawn on the CPU from ``generator`` (the agent's: a run is reproducible on any device)."""
    import torch

    return (torch.randn(shape, generator=generator, dtype=like.dtype, device="cpu") * std).to(like.device)


def clip_and_noise(z: torch.Tensor, noise: ActivationNoise, generator: Optional[torch.Generator] = None
                   ) -> torch.Tensor:
    """``z`` with each sample's L2 norm clipped to ``noise.clip`` and Gaussian noise added.

    The result stays in ``z``'s autograd graph through the clipping (the agent backpropagates
    the server's gradient through it); the noise is drawn from ``generator`` and carries no
    gradient."""
    clipped = z * _rows(clip_scales(z, noise.clip), z)
    if noise.sigma == 0:
        return clipped
    return clipped + _gaussian(z.shape, noise.sigma * noise.clip, generator, z)


@dataclass(frozen=True)
class LabelProtection:
    """Noise on the logit gradients an agent that withholds its labels returns:
    ``mode`` "max_norm" (Li et al. 2022), or "sigma" with noise std ``sigma`` x sqrt 2 / batch."""

    mode: str
    sigma: float = 0.0

    @classmethod
    def parse(cls, value: object) -> "LabelProtection":
        """From ``max_norm``, a number (sigma) or ``{sigma: S}``; ValueError saying what was expected."""
        expected = "expected max_norm, a noise multiplier sigma >= 0 (e.g. 1.0) or {sigma: number >= 0}"
        if value == "max_norm":
            return cls("max_norm")
        if isinstance(value, dict) and set(value) == {"sigma"}:
            value = value["sigma"]
        if isinstance(value, bool):
            raise ValueError(expected)
        try:
            return cls("sigma", float(value))   # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(expected) from None

    def __post_init__(self) -> None:
        if self.mode not in ("max_norm", "sigma"):
            raise ValueError(f"label protection: mode must be max_norm or sigma, got {self.mode!r}")
        if not self.sigma >= 0:
            raise ValueError(f"label protection: sigma must be >= 0, got {self.sigma}")

    def describe(self) -> object:
        return "max_norm" if self.mode == "max_norm" else {"sigma": self.sigma}


def protect_label_grads(g: torch.Tensor, protection: LabelProtection,
                        generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The logit gradients ``g`` (batch x classes, of the batch's mean cross-entropy) as returned
    under ``protection``.

    max_norm: sample j gets isotropic noise of variance (|g_max|^2 - |g_j|^2) / classes per
    coordinate, so every sample's expected squared norm is the batch's largest and the norm
    no longer singles out rare classes. sigma: each sample's own-loss gradient (softmax minus
    one-hot, L2 norm at most sqrt 2) gets noise of std sigma * sqrt 2; in the mean's units
    that is divided by the batch size."""
    if protection.mode == "max_norm":
        sq = g.detach().pow(2).sum(dim=1)
        std = ((sq.max() - sq).clamp_min(0.0) / g.shape[1]).sqrt()
        return g + _gaussian(g.shape, 1.0, generator, g) * std.unsqueeze(1)
    if protection.sigma == 0:
        return g
    return g + _gaussian(g.shape, protection.sigma * 2 ** 0.5 / g.shape[0], generator, g)


@dataclass(frozen=True)
class DpSgd:
    """DP-SGD on the client portion: per-sample clip, noise multiplier, and the delta for epsilon."""

    clip: float
    sigma: float
    delta: float = 1e-5

    @classmethod
    def parse(cls, value: object) -> "DpSgd":
        """From ``"CLIP,SIGMA[,DELTA]"`` or ``{clip, sigma[, delta]}``; ValueError saying what was expected."""
        expected = "expected CLIP,SIGMA[,DELTA] (e.g. 1.0,1.0) or {clip: number > 0, sigma: number > 0, delta: number}"
        if isinstance(value, str):
            parts: list = value.split(",")
        elif isinstance(value, dict) and {"clip", "sigma"} <= set(value) <= {"clip", "sigma", "delta"}:
            parts = [value["clip"], value["sigma"]] + ([value["delta"]] if "delta" in value else [])
        else:
            raise ValueError(expected)
        if len(parts) not in (2, 3) or any(isinstance(p, bool) for p in parts):
            raise ValueError(expected)
        try:
            return cls(*(float(p) for p in parts))
        except (TypeError, ValueError):
            raise ValueError(expected) from None

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"dp_sgd: clip must be > 0, got {self.clip}")
        if not self.sigma > 0:
            raise ValueError(f"dp_sgd: sigma (the noise multiplier) must be > 0, got {self.sigma}")
        if not 0 < self.delta < 1:
            raise ValueError(f"dp_sgd: delta must be in (0, 1), got {self.delta}")


def clip_and_noise_per_sample(grads: dict[str, torch.Tensor], dp: DpSgd,
                              generator: Optional[torch.Generator] = None) -> dict[str, torch.Tensor]:
    """DP-SGD's step: ``grads`` holds each parameter's per-sample gradients (batch first). Each
    sample's gradient, over all parameters together, is clipped to L2 norm ``dp.clip``; the
    clipped gradients are summed and Gaussian noise of std ``dp.sigma * dp.clip`` is added.
    Returns the noisy sums (the caller divides by its batch size)."""
    import torch

    first = next(iter(grads.values()))
    sq = torch.zeros(first.shape[0], dtype=torch.float64, device=first.device)
    for v in grads.values():
        sq += v.detach().reshape(v.shape[0], -1).to(torch.float64).pow(2).sum(dim=1)
    scale = (dp.clip / sq.sqrt().clamp_min(_EPS)).clamp(max=1.0).to(first.dtype)
    return {k: (v * _rows(scale, v)).sum(dim=0) + _gaussian(v.shape[1:], dp.sigma * dp.clip, generator, v)
            for k, v in grads.items()}


def dp_sgd_gradients(module: torch.nn.Module, x: torch.Tensor, target: torch.Tensor,
                     loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dp: DpSgd,
                     generator: Optional[torch.Generator] = None) -> None:
    """Set ``module``'s parameter gradients to DP-SGD's: per-sample gradients of
    ``loss(module(x_i), target_i)`` (torch.func: one vectorised pass, any module without
    batch statistics), clipped, summed, noised, divided by the batch size."""
    from torch.func import functional_call, grad, vmap

    if any(isinstance(m, _batch_norms()) and m.training for m in module.modules()):
        raise ValueError("dp_sgd needs a client portion without BatchNorm (its batch statistics mix the samples); "
                         "choose a split before the first BatchNorm layer or a model without it")
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
    buffers = dict(module.named_buffers())

    def one(p: dict, xi: torch.Tensor, ti: torch.Tensor) -> torch.Tensor:
        return loss(functional_call(module, (p, buffers), (xi.unsqueeze(0),)).squeeze(0), ti)

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))(params, x, target)
    noisy = clip_and_noise_per_sample(per_sample, dp, generator)
    for n, p in module.named_parameters():
        if n in names:
            p.grad = noisy[n] / x.shape[0]


def require_accountant() -> None:
    """RuntimeError with the install command when Opacus (DP-SGD's accountant) is missing:
    checked when DP-SGD is switched on, not after the first round."""
    import importlib.util

    if importlib.util.find_spec("opacus") is None:
        raise RuntimeError("dp_sgd needs Opacus for its privacy accountant: pip install 'sfl-edge[privacy]'")


def dp_epsilon(steps: dict[float, int], sigma: float, delta: float) -> float:
    """Epsilon of DP-SGD after ``steps`` (sample rate -> number of steps taken at that rate) with
    noise multiplier ``sigma``, at ``delta``: Opacus's Renyi-DP accountant for the subsampled
    Gaussian mechanism (Mironov 2017), composed over the rates a run used. It assumes Poisson
    sampling; the agent draws batches by shuffling, the usual approximation (Opacus makes it too)."""
    require_accountant()
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    if not steps:
        return 0.0
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = sum(compute_rdp(q=q, noise_multiplier=sigma, steps=n, orders=orders) for q, n in steps.items())
    eps, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    return float(eps)


@dataclass(frozen=True)
class AgentPrivacy:
    """The defenses one agent applies to what it sends (all off by default)."""

    nopeek: float = 0.0
    """Weight of the distance correlation between inputs and activations in the client's loss."""
    activation_noise: Optional[ActivationNoise] = None
    withhold_labels: bool = False
    """Send no labels: the coordinator returns our rows' logits and we score them (MergeSFL)."""
    label_protection: Optional[LabelProtection] = None
    dp_sgd: Optional[DpSgd] = None

    def __post_init__(self) -> None:
        if not self.nopeek >= 0:
            raise ValueError(f"nopeek weight must be >= 0, got {self.nopeek}")
        if self.label_protection is not None and not self.withhold_labels:
            raise ValueError("label protection needs withheld labels (withhold_labels / --withhold-labels): "
                             "an agent that sends its labels has nothing left to protect")
        if self.dp_sgd is not None and self.nopeek > 0:
            raise ValueError("dp_sgd cannot be combined with nopeek: NoPeek's loss couples the samples of a "
                             "batch, so a per-sample gradient bound no longer holds")

    @property
    def active(self) -> bool:
        return bool(self.describe())

    @classmethod
    def from_description(cls, d: object) -> "AgentPrivacy":
        """The defenses a registering agent declared (:meth:`describe`'s form); ValueError naming
        what is wrong. The coordinator records them; it never relies on them."""
        if not isinstance(d, dict):
            raise ValueError("expected a mapping of defenses")
        unknown = sorted(set(d) - {"nopeek", "activation_noise", "withhold_labels", "label_protection", "dp_sgd"})
        if unknown:
            raise ValueError(f"unknown defense(s) {unknown}")
        nopeek = d.get("nopeek", 0.0)
        if isinstance(nopeek, bool) or not isinstance(nopeek, (int, float)):
            raise ValueError("nopeek: expected a number")
        if not isinstance(d.get("withhold_labels", False), bool):
            raise ValueError("withhold_labels: expected true or false")
        return cls(nopeek=float(nopeek), withhold_labels=d.get("withhold_labels", False),
                   activation_noise=ActivationNoise.parse(d["activation_noise"]) if "activation_noise" in d else None,
                   label_protection=LabelProtection.parse(d["label_protection"]) if "label_protection" in d else None,
                   dp_sgd=DpSgd.parse(d["dp_sgd"]) if "dp_sgd" in d else None)

    def describe(self) -> dict:
        """What a run's metrics record of these defenses (what the agent tells the coordinator)."""
        out: dict = {}
        if self.nopeek > 0:
            out["nopeek"] = self.nopeek
        if self.activation_noise is not None:
            out["activation_noise"] = asdict(self.activation_noise)
        if self.withhold_labels:
            out["withhold_labels"] = True
        if self.label_protection is not None:
            out["label_protection"] = self.label_protection.describe()
        if self.dp_sgd is not None:
            out["dp_sgd"] = asdict(self.dp_sgd)
        return out


def privacy_summary(per_agent: dict[str, dict]) -> dict:
    """A round record's privacy fields from its per-agent rows: ``privacy``, each distinct set
    of defenses the round's agents declared with how many applied it, and ``epsilon_max``,
    the largest DP-SGD epsilon reported (the run's guarantee is the weakest agent's). Empty
    when no agent declared anything."""
    import json

    counts: dict[str, int] = {}
    for row in per_agent.values():
        if row.get("privacy"):
            key = json.dumps(row["privacy"], sort_keys=True)
            counts[key] = counts.get(key, 0) + 1
    out: dict = {}
    if counts:
        out["privacy"] = [{"defenses": json.loads(k), "agents": n} for k, n in sorted(counts.items())]
    eps = [row["epsilon"] for row in per_agent.values() if "epsilon" in row]
    if eps:
        out["epsilon_max"] = max(eps)
    return out
