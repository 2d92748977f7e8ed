"""Server-side training over groups of agents, with mixed split points.

One mechanism covers every server mode of the product:

- *merged* (MergeSFL feature merging, the default): one group holding every agent;
- *per_agent* (SplitFed v1): one group per agent;
- *S2FL data-balance groups*: groups chosen so their label mix is near uniform.

Each group trains its own copy of the model's server side on the union of its members'
activations, one forward/backward/step per local iteration. Members may have different
split points (S2FL's sliding split, FedFC's mixed cut layers): the forward runs block by
block from the group's smallest split, and each member's activations join the batch at
the block where its client portion ended; autograd hands each member the gradient of its
own rows. That gradient is scaled by ``N / b_i`` so it is the gradient of the member's own
mean loss, which keeps a client learning rate meaning the same whatever the group size.

HeteroSFL (docs/methods/heterosfl.md) adds to that: a bottlenecked member's rows pass the first ``width``
input channels of the group's decoder before they join (rows that joined earlier pass the
whole pair, encode and decode, as in the full model's forward); the loss may be logit-calibrated
per member (each row scored against its own agent's label counts); and the method may add a
term of its own to the loss (``LossSpec.term``: HeteroSFL's BDKS, whose narrow passes run
through :meth:`ServerTrainer._server_forward`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from coordinator import host_copies
from sfl_core.model.norm_layers import freeze
from sfl_core.step_terms import StepTerms, leading_block
from sfl_core.losses import LossSpec, logit_calibrated_ce
from sfl_core.model.zoo import SplitModel

if TYPE_CHECKING:
    from coordinator.server_workers import GradReducer

Batch = Tuple[torch.Tensor, Optional[torch.Tensor]]   # typing.Tuple: a runtime alias, Python 3.8
"""An agent's activations and labels (``None``: the agent withheld them)."""
Exchange = Callable[[Dict[str, torch.Tensor]], Dict[str, Tuple[torch.Tensor, float]]]
"""Sends withheld-label agents their rows' logits; returns each one's logit gradient and loss."""


def pick_device(name: str = "auto") -> torch.device:
    """The server portion runs on the GPU when there is one, else on the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class _Group:
    """One server copy and its optimiser, for the blocks at and after the group's smallest split."""

    def __init__(self, model: SplitModel, members: Sequence[str], splits: Mapping[str, int], lr: float,
                 momentum: float):
        self.members = list(members)
        self.splits = {a: splits[a] for a in members}
        self.first = min(self.splits.values())
        self.model = copy.deepcopy(model)
        self.model.train()
        params = [p for blk in self.model.blocks[self.first:] for p in blk.parameters()]
        # a bottleneck at the first split: its decoder is the server's; one further on is a whole
        # layer of the server side (the rows of members cut before it pass it encode and decode)
        for key, pair in self.model.bottlenecks.items():
            if int(key) >= self.first:
                params += list((pair.decoder if int(key) == self.first else pair).parameters())  # type: ignore[union-attr]
        self.params = params
        self.buffers = [b for blk in self.model.blocks[self.first:] for b in blk.buffers()]
        self.opt = torch.optim.SGD(params, lr=lr, momentum=momentum) if params else None
        self.lr, self.momentum = lr, momentum
        self.steps = 0
        self.terms = StepTerms([])

    def correct(self, correction: Mapping[str, torch.Tensor] | None, proximal: float,
                device: torch.device) -> None:
        """Step with SCAFFOLD's ``c − cᵢ`` of the copy's one member (each tensor a leading block
        of a parameter: a bottleneck slice) and FedProx's ``μ (w − x)`` (:class:`sfl_core.step_terms.StepTerms`)."""
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        terms = []
        for p in self.params:
            name, term = name_of[id(p)], None
            if correction is not None and name in correction:
                term = torch.zeros(p.shape, dtype=torch.float32)
                term[leading_block(term, tuple(correction[name].shape))] = correction[name].float().cpu()
                term = term.to(device, p.dtype)
            terms.append((p, term))
        self.terms = StepTerms(terms, proximal)

    def step_at(self, lr: float) -> None:
        """The learning rate of this copy's next optimiser steps (a sequential copy's turn)."""
        if self.opt is not None:
            for param_group in self.opt.param_groups:
                param_group["lr"] = lr

    def step(self) -> None:
        """One optimiser step (the drift correction added to the gradients first)."""
        if self.opt is None:
            return
        self.terms.apply()
        self.opt.step()
        self.steps += 1

    def state_for(self, split: int) -> dict[str, torch.Tensor]:
        """This copy's layers from ``split`` on: what the group contributes for a member cut at ``split``."""
        return {k: v.detach().cpu() for k, v in self.model.server_state(split).items()}


class ServerTrainer:
    def __init__(self, model: SplitModel, *, lr: float = 0.05, momentum: float = 0.0,
                 device: torch.device | str = "cpu", loss: LossSpec = LossSpec(),
                 reducer: "GradReducer | None" = None):
        """``reducer``: this trainer is one of several server workers that share the round's
        rows (:mod:`coordinator.server_workers`); every step all-reduces the gradients."""
        self.model = model
        self.reducer = reducer
        self.lr = lr
        self.momentum = momentum
        self.device = torch.device(device)
        self.loss = loss
        self._groups: list[_Group] = []
        self._group_of: dict[str, _Group] = {}
        self._widths: dict[str, int] = {}
        self._counts: dict[str, torch.Tensor] = {}
        self._sequential = False
        self._turn_lr: dict[str, float] = {}
        """Each member's rate in its turn of a sequential copy (:meth:`begin_round`)."""
        self._placed: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        """Per group (by id), the merged batch :meth:`place_rows` laid out and each member's view of it."""
        self.last_rows = 0
        """Rows the last :meth:`step` trained on (every server worker's, with a reducer)."""

    def begin_round(self, groups: Sequence[Sequence[str]], splits: Mapping[str, int], *,
                    widths: Mapping[str, int] | None = None,
                    label_counts: Mapping[str, Sequence[int]] | None = None,
                    lr: float | None = None, sequential: bool = False,
                    member_lr: Mapping[str, float] | None = None,
                    population_counts: Mapping[str, Sequence[int]] | None = None,
                    frozen_norms: bool = False,
                    corrections: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
                    proximal: float = 0.0) -> None:
        """Fresh copies of the current global model, one per group (optimiser state too, like the agents).

        ``widths`` are the members' bottleneck widths (0 or absent = none); ``label_counts``
        their registered label counts, needed by the calibrated loss and by a method's loss term; ``lr`` this
        round's learning rate (default: the trainer's). ``sequential`` is SplitFed v2: a group's
        copy takes one optimiser step per member, in turn, instead of one on the merged batch;
        ``member_lr`` (each member's own rate, its assignment's) then caps its turn's rate.
        Why: a turn is one step on one member's rows. Where the method regulates batches
        (MergeSFL's Eq. 15) a device given a small batch steps its client portion at a smaller
        rate, since a gradient of few rows is noisy; its turn at the round's full rate was not,
        and with steps in flight a device of 2 rows a step made the copy diverge. A turn never
        steps faster than the round's rate (the merged step does not either).
        ``population_counts`` (every registered agent's label counts) is handed to the method's
        loss term (BDKS's global data set). ``frozen_norms``:
        the copies' BatchNorm layers normalise with the model's statistics and keep them
        (:func:`sfl_core.model.norm_layers.freeze`). ``corrections``: SCAFFOLD's ``c − cᵢ`` for the server
        layers of agents that have a copy of their own (:mod:`sfl_core.options.drift`).
        ``proximal``: FedProx's μ for every copy (0: none).
        """
        self._sequential = sequential
        lr = self.lr if lr is None else lr
        self._turn_lr = {a: min(lr, m) for a, m in (member_lr or {}).items()} if sequential else {}
        self._groups = [_Group(self.model, g, splits, lr, self.momentum) for g in groups if g]
        if frozen_norms:
            for group in self._groups:
                freeze(group.model)
        corrections = corrections or {}
        for group in self._groups:
            mine = [a for a in group.members if a in corrections]
            if mine and len(group.members) > 1:
                raise ValueError(f"SCAFFOLD corrects a server copy that trains for one agent; {mine} share one")
            group.correct(corrections[mine[0]] if mine else None, proximal, self.device)
        self._group_of = {a: g for g in self._groups for a in g.members}
        self._widths = {a: w for a, w in (widths or {}).items() if w}
        term = self.loss.term
        needs_counts = self.loss.kind == "calibrated" or (term is not None and term.needs_counts)
        if needs_counts and label_counts is None:
            raise ValueError(f"loss {self.loss} needs the agents' label counts")
        self._counts = {a: torch.as_tensor(c, dtype=torch.float64) for a, c in (label_counts or {}).items()}
        if term is not None:
            term.begin_round(self._widths, self._counts, population_counts)

    def place_rows(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
        """Where the coming step's activations can be decoded straight into the batch it merges.

        ``shapes``: each agent's activations' shape this step. For each group whose agents among
        them all join at its first block with no bottleneck there, and share one shape, a view
        per agent into one float32 tensor, laid out in the order the step merges them. A step
        whose rows are exactly these views trains on that tensor where it lies (:meth:`_train`):
        without it, each agent's rows are copied together into the batch, and their gradients
        apart again. One whose rows were narrowed or left out merges them as before. Nothing is
        placed on a GPU (each agent's rows travel there as soon as they are decoded,
        :meth:`stage`), for SplitFed v2's turns, or for a loss term of the method's."""
        self._placed = {}
        if self.device.type != "cpu" or self._sequential or self.loss.term is not None:
            return {}
        places: dict[str, torch.Tensor] = {}
        for group in self._groups:
            order = sorted(a for a in group.members if a in shapes)
            row = {tuple(shapes[a][1:]) for a in order}
            if (not order or len(row) != 1 or any(group.splits[a] != group.first for a in order)
                    or group.model.bottleneck(group.first) is not None):
                continue
            sizes = [int(shapes[a][0]) for a in order]
            merged = torch.empty((sum(sizes), *row.pop()))
            views = dict(zip(order, merged.split(sizes)))
            self._placed[id(group)] = (merged, views)
            places.update(views)
        return places

    def _in_place(self, group: _Group, order: Sequence[str], batches: Mapping[str, Batch]) -> Optional[torch.Tensor]:
        """The merged batch :meth:`place_rows` laid out for ``group``, where the step's rows
        (``order``) are its views, every one; else None."""
        merged, views = self._placed.get(id(group), (None, {}))
        if merged is None or list(views) != list(order) or any(batches[a][0] is not views[a] for a in order):
            return None
        return merged

    def stage(self, batch: Batch) -> Batch:
        """``batch`` on the server's device, its copy queued rather than waited for: staged as soon
        as it is decoded, one agent's rows travel while the host decodes the next agent's."""
        x, y = batch
        return host_copies.to_device(x, self.device), None if y is None else host_copies.to_device(y, self.device)

    def step(self, batches: Mapping[str, Batch], exchange: Exchange | None = None
             ) -> tuple[dict[str, torch.Tensor], float]:
        """One local iteration for the agents in ``batches``; returns their gradients and the mean loss.

        An agent that withholds its labels (MergeSFL, docs/methods/round.md) sends ``None`` as its labels:
        ``exchange`` then gets the logits of its rows and must return, per agent, the gradient
        of the agent's own mean loss w.r.t. those logits and the loss value (the agent computes
        both with the labels it kept). An agent missing from the reply contributes no gradient.
        The result equals the labelled path's: the merged loss is the mean over all rows.
        """
        if exchange is None and any(b[1] is None for b in batches.values()):
            raise ValueError("an agent withheld its labels but no logits exchange was given")
        # every group's work is queued first; the step then waits once for the GPU (host_copies)
        trained: list[tuple[dict[str, torch.Tensor], torch.Tensor, int]] = []
        for group in self._groups:
            present = {a: batches[a] for a in group.members if a in batches}
            if self.reducer is not None:       # every rank steps every group, rows or not
                trained.append(self._train(group, present, exchange) if present else self._idle(group))
                continue
            if not present:
                continue
            # SplitFed v2 trains the one copy on each member's rows in turn; otherwise one merged batch
            if not self._sequential:
                trained.append(self._train(group, present, exchange))
                continue
            for a in sorted(present):
                group.step_at(self._turn_lr.get(a, group.lr))
                trained.append(self._train(group, {a: present[a]}, exchange))
        self._placed = {}
        grads = self._gradients_to_host({a: g for out, _, _ in trained for a, g in out.items()})
        host_copies.wait(self.device)
        rows = sum(n for _, _, n in trained)
        self.last_rows = rows
        return grads, sum(float(loss) * n for _, loss, n in trained) / max(rows, 1)

    def _gradients_to_host(self, out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One queued device-to-host copy per distinct gradient shape; the tensors are complete
        once :func:`host_copies.wait` returns. On the CPU they are already where they go."""
        if self.device.type == "cpu":
            return dict(out)
        by_shape: dict[tuple[int, ...], list[str]] = {}
        for a, g in out.items():
            by_shape.setdefault(tuple(g.shape[1:]), []).append(a)
        grads: dict[str, torch.Tensor] = {}
        for members in by_shape.values():
            host = host_copies.to_host(torch.cat([out[a] for a in members]))
            for a, g in zip(members, torch.split(host, [out[a].shape[0] for a in members])):
                grads[a] = g
        return grads

    def _idle(self, group: _Group) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        """A server worker none of whose agents is in this group this step: it still takes part
        in the group's all-reduce (with no gradient) and takes the same optimiser step."""
        assert self.reducer is not None
        if group.opt is not None:
            group.opt.zero_grad(set_to_none=True)
        total = self.reducer.rows(0)
        self.reducer.sync(group.params, group.buffers, 0, total)
        loss = self.reducer.mean(0.0, 0, total)
        if total:
            group.step()
        return {}, torch.tensor(loss), total

    def _train(self, group: _Group, batches: Mapping[str, Batch], exchange: Exchange | None = None
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        """Queue one forward/backward/optimiser step of ``group`` on its members' rows; returns
        each member's scaled input gradient and the mean loss, both still on the device."""
        # members join in order of their split point; rows keep that order end to end
        order = sorted(batches, key=lambda a: (group.splits[a], a))
        inputs: dict[str, torch.Tensor] = {}
        h = None
        blocks = group.model.blocks
        pos = 0
        merged = self._in_place(group, order, batches)
        if merged is not None:   # decoded where the batch lies: one input, every member's rows a view of it
            h = merged.detach().requires_grad_(True)
            inputs = dict(zip(order, h.split([batches[a][0].shape[0] for a in order])))
            pos = len(order)
        leaf = h
        for layer in range(group.first, len(blocks)):
            joining = []
            pair = group.model.bottleneck(layer)
            while pos < len(order) and group.splits[order[pos]] == layer:
                a = order[pos]
                x = host_copies.to_device(batches[a][0], self.device).detach().requires_grad_(True)
                inputs[a] = x
                # a bottlenecked agent's rows pass its slice of the decoder before joining (HetBL)
                joining.append(pair.decode(x) if pair is not None else x)
                pos += 1
            if pair is not None and h is not None:   # rows that joined earlier pass the whole pair
                h = pair(h)
            if joining:   # (one member's rows alone are the batch as they are: not copied)
                h = joining[0] if h is None and len(joining) == 1 else torch.cat(([h] if h is not None else []) + joining)
            if h is not None:
                h = blocks[layer](h)
        assert h is not None, "a group member's split lies beyond the model"
        if group.opt is not None:
            group.opt.zero_grad(set_to_none=True)
        sizes = [inputs[a].shape[0] for a in order]
        n = sum(sizes)
        loss = self._backward(group, order, inputs, h, {a: batches[a][1] for a in order}, exchange)
        rows = n
        if self.reducer is not None:   # the mean loss over every rank's rows, one model on every rank
            rows = self.reducer.rows(n)
            self.reducer.sync(group.params, group.buffers, n, rows)
            loss = torch.tensor(self.reducer.mean(float(loss), n, rows))
        group.step()
        out: dict[str, torch.Tensor] = {}
        if leaf is None:
            got = {a: inputs[a].grad for a in order}
        else:
            got = dict(zip(order, leaf.grad.split(sizes) if leaf.grad is not None else [None] * len(order)))
        for a, b in zip(order, sizes):
            g = got[a]
            if g is None:                                   # no reply: no gradient
                out[a] = torch.zeros_like(inputs[a])
            else:   # scaled in place where it is dense: this step's own tensor, read by nobody else
                out[a] = g.mul_(n / b) if g.is_contiguous() else g * (n / b)
        return out, loss, rows

    def _backward(self, group: _Group, order: Sequence[str], inputs: Mapping[str, torch.Tensor],
                  logits: torch.Tensor, labels: Mapping[str, torch.Tensor | None],
                  exchange: Exchange | None) -> torch.Tensor:
        """Backpropagate the mean loss over all rows; returns its value (0-d, not waited for).
        Rows of agents that withheld their labels get their loss gradient from the agent (via
        ``exchange``)."""
        n = logits.shape[0]
        rows, pos = {}, 0
        for a in order:
            rows[a] = (pos, pos + inputs[a].shape[0])
            pos = rows[a][1]
        labelled = [a for a in order if labels[a] is not None]
        withheld = [a for a in order if labels[a] is None]
        if not withheld:
            y = torch.cat([host_copies.to_device(labels[a], self.device) for a in order])  # type: ignore[arg-type]
            loss = self._loss(group, order, inputs, logits, y)
            loss.backward()
            return loss.detach()
        outputs: list[torch.Tensor] = []
        grads: list[Optional[torch.Tensor]] = []
        total = torch.zeros((), device=logits.device)
        if labelled:
            idx = torch.cat([torch.arange(*rows[a], device=logits.device) for a in labelled])
            y = torch.cat([host_copies.to_device(labels[a], self.device) for a in labelled])  # type: ignore[arg-type]
            part = self._loss(group, labelled, inputs, logits[idx], y) * (idx.numel() / n)
            outputs.append(part)
            grads.append(None)
            total = total + part.detach()
        assert exchange is not None
        replies = exchange({a: logits[rows[a][0]:rows[a][1]].detach().cpu() for a in withheld})
        for a in withheld:
            if a not in replies:
                continue
            g, agent_loss = replies[a]
            b = rows[a][1] - rows[a][0]
            outputs.append(logits[rows[a][0]:rows[a][1]])
            grads.append(g.to(logits.device, logits.dtype) * (b / n))
            total = total + agent_loss * b / n
        if outputs:
            torch.autograd.backward(outputs, grads)
        return total

    def _loss(self, group: _Group, order: Sequence[str], inputs: Mapping[str, torch.Tensor],
              logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss over the group's rows (in ``order``), plus the method's term (BDKS's, of the wide rows)."""
        if self.loss.kind == "calibrated":
            counts = torch.cat([self._counts[a].expand(inputs[a].shape[0], -1) for a in order]).to(self.device)
            # a row's own class counts at least once, whatever the agent registered: never an infinite margin
            counts = counts.scatter(1, y.view(-1, 1), counts.gather(1, y.view(-1, 1)).clamp(min=1.0))
            loss = logit_calibrated_ce(logits, y, counts, self.loss.tau)
        else:
            loss = F.cross_entropy(logits, y)
        extra = self.loss.term.terms(order, inputs, logits, group.splits, group.first,
                                     lambda z: self._server_forward(group, z)) if self.loss.term is not None else None
        if extra is not None:
            loss = loss + extra
        return loss

    def _server_forward(self, group: _Group, z: torch.Tensor) -> torch.Tensor:
        """Logits of bottleneck codes ``z`` at the group's first split (decoder slice, then the blocks):
        a narrow pass of a method's loss term (BDKS). It trains like the wide pass (BatchNorm normalises with the batch's
        statistics, gradients reach the same parameters), but its buffer updates go to scratch
        copies: BatchNorm's running statistics are what evaluation and the aggregated model use,
        and they must describe the wide path's activations, not the narrow sub-bottleneck's.
        (Restoring the buffers in place after the pass would break backward, which saves them.)"""
        pair = group.model.bottleneck(group.first)
        assert pair is not None   # a narrow pass decodes the pair at the group's cut
        h = pair.decode(z)
        for blk in group.model.blocks[group.first:]:
            scratch = {k: b.clone() for k, b in blk.named_buffers()}
            h = torch.func.functional_call(blk, scratch, (h,)) if scratch else blk(h)
        return h

    def drop(self, agent_id: str) -> None:
        """An agent left mid-round: its rows stop joining its group's batch."""
        group = self._group_of.pop(agent_id, None)
        if group is not None and agent_id in group.members:
            group.members.remove(agent_id)

    def member_state(self, agent_id: str, split: int) -> dict[str, torch.Tensor]:
        """The server-side layers trained for ``agent_id`` (its group's copy, from its split on)."""
        return self._group_of[agent_id].state_for(split)

    def member_states(self, splits: Mapping[str, int]) -> dict[str, dict[str, torch.Tensor]]:
        """:meth:`member_state` of each agent in ``splits`` (agent -> its split), each group's copy
        read once per split: every member of a merged group shares its copy's tensors."""
        read: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        out = {}
        for agent_id, split in splits.items():
            group = self._group_of[agent_id]
            if (id(group), split) not in read:
                read[id(group), split] = group.state_for(split)
            out[agent_id] = read[id(group), split]
        return out

    def member_steps(self, agent_id: str) -> tuple[float, int, float]:
        """``(η, K, m)`` of the copy that trained for ``agent_id``: its learning rate, the steps
        it took this round and its momentum (a correction term's update, :mod:`sfl_core.options.drift`)."""
        group = self._group_of[agent_id]
        return group.lr, group.steps, group.momentum

