"""The server's losses (docs/methods/heterosfl.md): logit calibration (FedLC, Zhang et al., 2022, as
HeteroSFL uses it) and HeteroSFL's BDKS (Chen et al., 2025): its set of under-represented
classes and its two distillation terms. The server trainer combines them (Eq. 8, in
``coordinator.server_trainer``) as the run's method asks (:class:`LossSpec`, from
``Method.server_loss``).

All take raw logits ``(B, C)`` and return scalar tensors averaged over the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol, Sequence, Union

import torch
import torch.nn.functional as F

Counts = Union[Sequence[int], Sequence[float], torch.Tensor]   # typing.Union: a runtime alias, Python 3.8


@dataclass(frozen=True)
class LossSpec:
    """How the server scores the rows it trains on: the run config's ``loss``, and what the method adds
    (``Method.server_loss``: HeteroSFL's BDKS)."""

    kind: str = "ce"          # ce | calibrated
    tau: float = 1.0          # calibration strength (calibrated only)
    term: Optional["ServerTerm"] = None
    """A term the method adds to every server copy's loss (HeteroSFL's BDKS)."""


class ServerTerm(Protocol):
    """A method's term in the server's loss, run by the server trainer for each group's batch."""

    needs_counts: bool
    """It reads the agents' label counts (the trainer then requires them)."""

    def begin_round(self, widths: Mapping[str, int], counts: Mapping[str, torch.Tensor],
                    population: Optional[Mapping[str, Sequence[int]]] = None) -> None:
        """The round's bottleneck widths and label counts (``population``: every registered agent's)."""

    def terms(self, order: Sequence[str], inputs: Mapping[str, torch.Tensor], logits: torch.Tensor,
              splits: Mapping[str, int], first: int,
              forward: Callable[[torch.Tensor], torch.Tensor]) -> Optional[torch.Tensor]:
        """The term for a group's batch; None: nothing this round."""


def _counts_tensor(label_counts: Counts, logits: torch.Tensor) -> torch.Tensor:
    n = torch.as_tensor(label_counts, dtype=torch.float64, device=logits.device)
    b, c = logits.shape
    if n.dim() == 1 and n.shape[0] == c:
        n = n.unsqueeze(0).expand(b, c)
    elif not (n.dim() == 2 and tuple(n.shape) == (b, c)):
        raise ValueError(f"label_counts must have shape ({c},) or ({b}, {c}), got {tuple(n.shape)}")
    if not bool(torch.isfinite(n).all()) or bool((n < 0).any()):
        raise ValueError("label_counts must be finite and non-negative")
    return n


def _check_logits(name: str, logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"{name} must be (batch, classes), got shape {tuple(logits.shape)}")


def _check_distillation(student: str, student_logits: torch.Tensor, teacher: str, teacher_logits: torch.Tensor,
                        T: float) -> None:
    """A knowledge-sharing loss's inputs: logits of one shape, and a temperature to divide by."""
    _check_logits(f"{student}_logits", student_logits)
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"{student} {tuple(student_logits.shape)} and {teacher} {tuple(teacher_logits.shape)} "
                         "logits differ in shape")
    if not math.isfinite(T) or T <= 0:
        raise ValueError(f"T must be finite and positive, got {T!r}")


def _check_labels(labels: torch.Tensor, logits: torch.Tensor) -> None:
    if labels.shape != (logits.shape[0],):
        raise ValueError(f"labels must have shape ({logits.shape[0]},), got {tuple(labels.shape)}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= logits.shape[1]):
        raise ValueError(f"labels must be class indices in [0, {logits.shape[1]})")


def logit_calibrated_ce(logits: torch.Tensor, labels: torch.Tensor, label_counts: Counts,
                        tau: float = 1.0) -> torch.Tensor:
    """FedLC's calibrated cross-entropy (Zhang et al., ICML 2022), as HeteroSFL uses it.

    Each logit is shifted by a class margin that grows as the class gets rarer locally,

        z̃_c = z_c − τ · n_c^(−1/4),      L = CE(z̃, y) = −log softmax(z̃)_y,

    where ``n_c`` is the label count of class ``c`` on the agent (or group) the row came
    from. Why: under label skew, plain CE pushes the logits of locally rare classes down on
    every sample; subtracting a larger margin from rare classes means the model must raise
    their raw logits to fit its own labels, so the local update is biased less against
    classes it rarely sees. ``τ`` is the calibration strength (τ = 0 is plain CE; larger τ
    enlarges the gap between rare and frequent classes). Because only *differences* between
    margins matter, equal counts for all classes give exactly plain CE.

    Classes with ``n_c = 0`` get an infinite margin, i.e. they drop out of the softmax (as in
    the reference implementation, where ``exp(z − τ·0^(−1/4)) = 0``); a row whose own label has
    count 0 is an error (the counts do not describe its data). ``label_counts`` is ``(C,)``
    for the whole batch or ``(B, C)`` — one row per sample — for merged batches that mix
    agents.
    """
    _check_logits("logits", logits)
    _check_labels(labels, logits)
    if not math.isfinite(tau) or tau < 0:
        raise ValueError(f"tau must be finite and non-negative, got {tau!r}")
    n = _counts_tensor(label_counts, logits)
    absent = n == 0
    if labels.numel() and bool(absent.gather(1, labels.view(-1, 1).to(torch.long)).any()):
        raise ValueError("a sample's own label has count 0 in label_counts")
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    margin = (tau * n.clamp(min=1.0).pow(-0.25)).to(logits.dtype)
    calibrated = (logits - margin).masked_fill(absent, float("-inf"))
    return F.cross_entropy(calibrated, labels.to(torch.long))


def n2w_loss(wide_logits: torch.Tensor, narrow_logits: torch.Tensor, under_represented: Sequence[int], *,
             T: float = 1.0) -> torch.Tensor:
    """Narrow-to-wide knowledge sharing, paper Eq. 6, mean over all rows.

        L_N2W = − Σ_{i∈R} P^N_i · log P^W_i − (Σ_{j∈J} P^N_j) · log(Σ_{j∈J} P^W_j)

    ``P = softmax(logits / T)`` (the paper has T = 1; the result is scaled by T²). The narrow
    model (trained on every group's data) teaches the wide one each under-represented class
    of R individually, while the well-represented classes J are lumped into one bin, so the
    wide model learns nothing from the narrow model about *how* to split mass within J.
    Every sample contributes (Eq. 6 restricts classes, not samples). The narrow logits are
    the teacher and are detached. R empty gives 0; R = all classes is plain soft-label CE.
    """
    _check_distillation("wide", wide_logits, "narrow", narrow_logits, T)
    c = wide_logits.shape[1]
    r = sorted(set(int(i) for i in under_represented))
    if any(not 0 <= i < c for i in r):
        raise ValueError(f"under_represented classes must be in [0, {c}), got {list(under_represented)}")
    if wide_logits.shape[0] == 0:
        return wide_logits.sum() * 0.0
    p_n = F.softmax(narrow_logits.detach() / T, dim=1)
    logp_w = F.log_softmax(wide_logits / T, dim=1)
    r_idx = torch.tensor(r, dtype=torch.long, device=wide_logits.device)
    j_idx = torch.tensor([i for i in range(c) if i not in set(r)], dtype=torch.long, device=wide_logits.device)
    per_row = -(p_n[:, r_idx] * logp_w[:, r_idx]).sum(dim=1)
    if j_idx.numel():
        per_row = per_row - p_n[:, j_idx].sum(dim=1) * torch.logsumexp(logp_w[:, j_idx], dim=1)
    return per_row.mean() * (T * T)


def w2n_loss(narrow_logits: torch.Tensor, wide_logits: torch.Tensor, *, T: float = 1.0) -> torch.Tensor:
    """Wide-to-narrow knowledge sharing, paper Eq. 7: ``CE(f^N(x), f^W(x))``, mean over rows.

    Soft-label cross-entropy ``−Σ_c softmax(wide/T)_c · log softmax(narrow/T)_c`` (× T²): in
    the high-end group the narrow path learns from the wide path's soft labels instead of
    the one-hot labels, which avoids the gradient interference between the nested models.
    The wide logits are the teacher and are detached. (Same gradient as KL; the value is
    offset by the teacher's entropy, so it is not 0 when the logits agree.)
    """
    _check_distillation("narrow", narrow_logits, "wide", wide_logits, T)
    if narrow_logits.shape[0] == 0:
        return narrow_logits.sum() * 0.0
    p_w = F.softmax(wide_logits.detach() / T, dim=1)
    return -(p_w * F.log_softmax(narrow_logits / T, dim=1)).sum(dim=1).mean() * (T * T)


def under_represented_classes(group_label_counts: Sequence[int], global_label_counts: Sequence[int],
                              theta: float = 0.1, *, relative: bool = True) -> list[int]:
    """BDKS's set R of under-represented classes for the wide (high-end) group, ascending.

    The paper (§4.2) defines R as the classes processed by the high-end group "where the
    number of samples per class is less than θ% of its share in the global dataset"
    (θ = 10 %), and calls R "a subset of minority classes in high-end group". A *share* is
    a proportion, so both sides are label proportions:

        R = { c : n_group[c] / N_group  <  θ · n_global[c] / N_global }

    — class ``c`` makes up less of the group's data than a fraction θ of what it makes up of
    the global data (docs/methods/heterosfl.md). This is a statement about the group's label *mix*:
    it does not change when the group holds more or less of the data overall, which is what
    over-fitting to the group's mix depends on. The global counts are the whole population's
    (every agent's data), of which the group is a part. Classes absent globally are never in
    R (the narrow model knows nothing about them either); the complement J is every other
    class. A group with no data at all lacks every class present globally.

    ``relative=False`` is the other reading, absolute counts, ``n_group[c] < θ · n_global[c]``
    (the group holds less than a fraction θ of the class's samples), which makes the bar
    depend on how much of all data the group holds.
    """
    g = [int(x) for x in group_label_counts]
    a = [int(x) for x in global_label_counts]
    if len(g) != len(a) or not g:
        raise ValueError(f"need one group and one global count per class, got {len(g)} and {len(a)}")
    if any(x < 0 for x in g) or any(x < 0 for x in a):
        raise ValueError("label counts must be non-negative")
    if any(x > y for x, y in zip(g, a)):
        raise ValueError(f"a group cannot hold more samples of a class than the whole data set: {g} vs {a}")
    if not math.isfinite(theta) or not 0 <= theta <= 1:
        raise ValueError(f"theta must be in [0, 1], got {theta!r}")
    if relative:
        ng, na = sum(g), sum(a)
        if ng == 0:
            return [c for c in range(len(a)) if a[c] > 0 and theta > 0]
        return [c for c in range(len(a)) if a[c] > 0 and g[c] * na < theta * a[c] * ng]
    return [c for c in range(len(a)) if a[c] > 0 and g[c] < theta * a[c]]
