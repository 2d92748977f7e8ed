"""Server-portion training: feature merging (default) or one copy per agent (SplitFed v1)."""

from __future__ import annotations

import copy
from typing import Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from sfl_core.aggregation import weighted_average

SERVER_MODES = ("merged", "per_agent")

Batch = tuple[torch.Tensor, torch.Tensor]


def pick_device(name: str = "auto") -> torch.device:
    """The server portion runs on the GPU when there is one, else on the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ServerTrainer:
    """Trains ``blocks[split:]`` of the global model on the agents' activations.

    *merged*: the activations of all agents for one step are concatenated into ONE batch,
    ONE forward/backward/step (MergeSFL, FedFC). Each agent receives the gradient of its
    own rows scaled by ``N / b_i``, i.e. the gradient of *its own* mean loss, so its client
    learning rate means the same in merged and per-agent modes.

    *per_agent*: SplitFed v1, one server copy per agent trained only on that agent's
    activations, the copies averaged (weights = data size) at the end of the round.
    """

    def __init__(self, server: nn.Module, *, mode: str = "merged", lr: float = 0.05,
                 momentum: float = 0.0, device: torch.device | str = "cpu"):
        if mode not in SERVER_MODES:
            raise ValueError(f"server mode {mode!r}; expected one of {SERVER_MODES}")
        self.mode = mode
        self.lr = lr
        self.momentum = momentum
        self.device = torch.device(device)
        self.server = server.to(self.device)
        self._copies: dict[str, nn.Module] = {}
        self._opts: dict[str, torch.optim.Optimizer] = {}

    def begin_round(self, agent_ids: Sequence[str]) -> None:
        """Fresh optimiser state each round, like the agents (they get new optimisers too)."""
        self.server.train()
        if self.mode == "merged":
            self._copies = {"*": self.server}
        else:
            self._copies = {a: copy.deepcopy(self.server) for a in agent_ids}
        # FedAvg leaves the server portion empty: nothing to optimise
        self._opts = {k: torch.optim.SGD(m.parameters(), lr=self.lr, momentum=self.momentum)
                      for k, m in self._copies.items() if any(True for _ in m.parameters())}

    def step(self, batches: Mapping[str, Batch]) -> tuple[dict[str, torch.Tensor], float]:
        """One local iteration for the agents in ``batches``; returns their gradients and the loss."""
        if self.mode == "merged":
            return self._merged_step(batches)
        grads, losses = {}, []
        for agent, (x, y) in batches.items():
            g, loss = self._train(agent, {agent: (x, y)})
            grads.update(g)
            losses.append(loss)
        return grads, sum(losses) / max(len(losses), 1)

    def _merged_step(self, batches: Mapping[str, Batch]) -> tuple[dict[str, torch.Tensor], float]:
        return self._train("*", batches)

    def _train(self, key: str, batches: Mapping[str, Batch]) -> tuple[dict[str, torch.Tensor], float]:
        model, opt = self._copies[key], self._opts[key]
        agents = list(batches)
        sizes = [batches[a][0].shape[0] for a in agents]
        # join on the device, not on the host: one host->device copy per agent, no host-side cat
        x = torch.cat([batches[a][0].to(self.device, non_blocking=True) for a in agents]).requires_grad_(True)
        y = torch.cat([batches[a][1].to(self.device, non_blocking=True) for a in agents])
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        n = x.shape[0]
        scale = torch.repeat_interleave(torch.tensor([n / b for b in sizes], device=self.device),
                                        torch.tensor(sizes, device=self.device))
        grad = (x.grad * scale.view(-1, *([1] * (x.dim() - 1)))).cpu()  # one device->host copy
        return dict(zip(agents, torch.split(grad, sizes))), loss.item()

    def drop(self, agent_id: str) -> None:
        """An agent left mid-round: its copy (per-agent mode) is not averaged in."""
        self._copies.pop(agent_id, None)
        self._opts.pop(agent_id, None)

    def end_round(self, weights: Mapping[str, float]) -> dict[str, torch.Tensor]:
        """Return the round's server-portion state (averaged over copies in per-agent mode)."""
        if self.mode == "merged":
            return {k: v.detach().cpu() for k, v in self.server.state_dict().items()}
        keys = [a for a in self._copies if weights.get(a, 0) > 0]
        if not keys:
            return {k: v.detach().cpu() for k, v in self.server.state_dict().items()}
        avg = weighted_average([self._copies[a].state_dict() for a in keys], [weights[a] for a in keys])
        self.server.load_state_dict(avg)
        return avg
