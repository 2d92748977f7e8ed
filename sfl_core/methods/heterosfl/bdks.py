"""HeteroSFL's bi-directional knowledge sharing on the server (Chen et al., 2025, Eq. 6-8,
extended to k groups): a term the method adds to the server's loss
(:class:`sfl_core.losses.ServerTerm`; the server trainer runs it, never by name).

For the rows of a member of width ``w`` wider than the round's narrowest ``w_1``, the narrower
sub-bottlenecks ``w_j < w`` run too (the first ``w_j`` channels of the same activations). The
narrowest path, trained on everybody's data, teaches the wide one the classes under-represented
in width ``w``'s group (N2W, weight α); each narrower path learns from the wide path's soft labels
(W2N). Terms are weighted by the rows' share of the batch, like the mean loss.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from sfl_core.losses import n2w_loss, under_represented_classes, w2n_loss

__all__ = ["Bdks"]


class Bdks:
    """BDKS's server term.

    Args:
        alpha: the weight of N2W (Eq. 8).
        theta: a class is under-represented in a group when its share of the group's data is
            below ``theta`` times its share of all agents' data.
    """

    needs_counts = True

    def __init__(self, alpha: float = 1.0, theta: float = 0.1):
        self.alpha, self.theta = float(alpha), float(theta)
        self.widths: dict[str, int] = {}
        self.under: dict[int, list[int]] = {}

    def __repr__(self) -> str:
        return f"Bdks(alpha={self.alpha}, theta={self.theta})"

    def begin_round(self, widths: Mapping[str, int], counts: Mapping[str, torch.Tensor],
                    population: Optional[Mapping[str, Sequence[int]]] = None) -> None:
        """BDKS's class set R for each width ``w`` wider than the round's narrowest (HeteroSFL §4.2):
        the classes whose share in the data of this round's width-``w`` members is below θ times
        their share in the global data set (label proportions, :func:`under_represented_classes`).

        The paper's "global dataset" is everybody's data: ``population`` (every registered
        agent's label counts; the round's agents are part of it). Without it, the round's
        bottlenecked agents stand in for the population."""
        self.widths = dict(widths)
        self.under = {}
        if not self.widths:
            return
        pool = {a: torch.as_tensor(c, dtype=torch.float64) for a, c in (population or {}).items()}
        pool.update({a: counts[a] for a in self.widths})
        everyone: torch.Tensor = sum(pool.values())  # type: ignore[assignment]
        for w in sorted(set(self.widths.values()))[1:]:
            group: torch.Tensor = sum(counts[a] for a, v in self.widths.items() if v == w)  # type: ignore[assignment]
            self.under[w] = under_represented_classes(group.tolist(), everyone.tolist(), self.theta, relative=True)

    def terms(self, order: Sequence[str], inputs: Mapping[str, torch.Tensor], logits: torch.Tensor,
              splits: Mapping[str, int], first: int,
              forward: Callable[[torch.Tensor], torch.Tensor]) -> Optional[torch.Tensor]:
        """The term for a group's batch (its rows in ``order``; ``forward``: the server's logits of
        bottleneck codes at the group's cut ``first``, a narrow pass); None in a round without R."""
        if not self.under:
            return None
        widths = sorted(set(self.widths.values()))
        n = logits.shape[0]
        offsets, pos = {}, 0
        for a in order:
            offsets[a] = (pos, pos + inputs[a].shape[0])
            pos += inputs[a].shape[0]
        total = logits.new_zeros(())
        for w, under in self.under.items():
            members = [a for a in order if self.widths.get(a) == w]
            if not members:
                continue
            if any(splits[a] != first for a in members):
                raise ValueError("BDKS needs every bottlenecked member on one split")
            rows = torch.cat([torch.arange(*offsets[a], device=logits.device) for a in members])
            wide = logits[rows]
            z = torch.cat([inputs[a] for a in members])
            narrower = {p: forward(z[:, :p]) for p in widths if p < w}
            term = self.alpha * n2w_loss(wide, narrower[widths[0]], under)
            for narrow in narrower.values():
                term = term + w2n_loss(narrow, wide)
            total = total + term * (rows.numel() / n)
        return total
