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
"""

from __future__ import annotations

import copy
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from sfl_core.models import SplitModel

SERVER_MODES = ("merged", "per_agent")

Batch = tuple[torch.Tensor, torch.Tensor]


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
        self.opt = torch.optim.SGD(params, lr=lr, momentum=momentum) if params else None

    def state_for(self, split: int) -> dict[str, torch.Tensor]:
        """This copy's layers from ``split`` on: what the group contributes for a member cut at ``split``."""
        return {k: v.detach().cpu() for k, v in self.model.server_state(split).items()}


class ServerTrainer:
    def __init__(self, model: SplitModel, *, lr: float = 0.05, momentum: float = 0.0,
                 device: torch.device | str = "cpu"):
        self.model = model
        self.lr = lr
        self.momentum = momentum
        self.device = torch.device(device)
        self._groups: list[_Group] = []
        self._group_of: dict[str, _Group] = {}

    def begin_round(self, groups: Sequence[Sequence[str]], splits: Mapping[str, int]) -> None:
        """Fresh copies of the current global model, one per group (optimiser state too, like the agents)."""
        self._groups = [_Group(self.model, g, splits, self.lr, self.momentum) for g in groups if g]
        self._group_of = {a: g for g in self._groups for a in g.members}

    def step(self, batches: Mapping[str, Batch]) -> tuple[dict[str, torch.Tensor], float]:
        """One local iteration for the agents in ``batches``; returns their gradients and the mean loss."""
        grads: dict[str, torch.Tensor] = {}
        losses, rows = 0.0, 0
        for group in self._groups:
            present = {a: batches[a] for a in group.members if a in batches}
            if not present:
                continue
            g, loss, n = self._train(group, present)
            grads.update(g)
            losses += loss * n
            rows += n
        return grads, losses / max(rows, 1)

    def _train(self, group: _Group, batches: Mapping[str, Batch]) -> tuple[dict[str, torch.Tensor], float, int]:
        # members join in order of their split point; rows keep that order end to end
        order = sorted(batches, key=lambda a: (group.splits[a], a))
        inputs: dict[str, torch.Tensor] = {}
        labels: list[torch.Tensor] = []
        h = None
        blocks = group.model.blocks
        pos = 0
        for layer in range(group.first, len(blocks)):
            joining = []
            while pos < len(order) and group.splits[order[pos]] == layer:
                a = order[pos]
                x = batches[a][0].to(self.device, non_blocking=True).detach().requires_grad_(True)
                inputs[a] = x
                labels.append(batches[a][1].to(self.device, non_blocking=True))
                joining.append(x)
                pos += 1
            if joining:
                h = torch.cat(([h] if h is not None else []) + joining)
            if h is not None:
                h = blocks[layer](h)
        assert h is not None, "a group member's split lies beyond the model"
        y = torch.cat(labels)
        if group.opt is not None:
            group.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(h, y)
        loss.backward()
        if group.opt is not None:
            group.opt.step()
        n = y.shape[0]
        sizes = [inputs[a].shape[0] for a in order]
        # scale on the device, then one device->host copy per distinct activation shape
        out: dict[str, torch.Tensor] = {}
        for a, b in zip(order, sizes):
            out[a] = inputs[a].grad * (n / b)
        by_shape: dict[tuple[int, ...], list[str]] = {}
        for a in order:
            by_shape.setdefault(tuple(out[a].shape[1:]), []).append(a)
        grads: dict[str, torch.Tensor] = {}
        for members in by_shape.values():
            host = torch.cat([out[a] for a in members]).cpu()
            for a, g in zip(members, torch.split(host, [out[a].shape[0] for a in members])):
                grads[a] = g
        return grads, loss.item(), n

    def drop(self, agent_id: str) -> None:
        """An agent left mid-round: its rows stop joining its group's batch."""
        group = self._group_of.pop(agent_id, None)
        if group is not None and agent_id in group.members:
            group.members.remove(agent_id)

    def member_state(self, agent_id: str, split: int) -> dict[str, torch.Tensor]:
        """The server-side layers trained for ``agent_id`` (its group's copy, from its split on)."""
        return self._group_of[agent_id].state_for(split)
