"""Moving a server step's tensors between the host and a GPU without stalling either side.

A server step on a GPU takes every agent's activations from the host and hands every agent
its gradient back on the host. Done plainly (``x.to("cuda")``, ``g.cpu()``), each copy from
or to ordinary (pageable) memory passes through a driver bounce buffer and holds the Python
thread until it is done, and ``g.cpu()`` first waits for the GPU to finish all queued work:
decoding the next agent, the copies and the GPU's compute take turns instead of overlapping.

Here instead:

- :func:`to_device` stages a host tensor in page-locked (pinned) memory and queues its copy
  with ``non_blocking=True``: the GPU's copy engine moves one agent's rows while the host
  decodes and stages the next agent's (the engine stages each agent as soon as it is decoded);
- :func:`to_host` queues a copy back into a pinned host tensor, also without waiting, so a
  step queues the gradients of all its groups and waits once (:func:`wait`), at its end.

Pinned blocks come from PyTorch's caching host allocator: after the first steps no new
page-locked memory is allocated, and a block is handed out again only once the copies queued
on it have finished, so a tensor returned to a caller stays valid for as long as it is held.
On the CPU every function is the plain operation, and nothing is pinned.
"""

from __future__ import annotations

import torch

__all__ = ["to_device", "to_host", "wait"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; from the host to a GPU the copy is queued, not waited for."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if not t.is_pinned():
        staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        staged.copy_(t)
        t = staged
    return t.to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``. From a GPU the copy is only queued: read it after :func:`wait`."""
    if t.device.type != "cuda":
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def wait(device: torch.device) -> None:
    """Block until the work queued on ``device``'s current stream (copies included) is done."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
