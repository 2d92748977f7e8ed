"""Weighted averaging of model states (FedAvg-style; weights are data or batch sizes)."""

from __future__ import annotations

import math
from typing import Hashable, Mapping, Sequence

import torch


def weighted_average(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
                     defaults: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Average each key over the states that hold it, weighted by ``weights``.

    Keys need not be identical across states: a layer is averaged over exactly its holders,
    which is what layer-wise aggregation over mixed split points needs. A holder may also
    hold only a *prefix* of a tensor (the first ``n`` channels along some dims: a narrow
    HeteroSFL bottleneck, HetBL Eq. 4-5, docs/methods/heterosfl.md): each element is then averaged over the holders
    that cover it. Elements no holder covers take their value from ``defaults`` (an error
    without one). Integer buffers (BatchNorm's ``num_batches_tracked``) are counters, not
    parameters: the weighted mean is rounded back to an integer.
    """
    if len(states) != len(weights) or not states:
        raise ValueError("need one weight per state and at least one state")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be finite and non-negative with a positive sum, got {list(weights)}")
    keys: list[str] = []
    for s in states:
        keys.extend(k for k in s if k not in keys)
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        holders = [(s[key], w) for s, w in zip(states, weights) if key in s]
        if sum(w for _, w in holders) <= 0:
            holders = [(t, 1.0) for t, _ in holders]
        ref = holders[0][0]
        if any(t.dim() != ref.dim() for t, _ in holders):
            raise ValueError(f"{key}: shapes differ across states ({[tuple(t.shape) for t, _ in holders]})")
        default = defaults.get(key) if defaults is not None else None
        full = tuple(max(t.shape[d] for t, _ in holders) for d in range(ref.dim()))
        if default is not None:
            full = tuple(max(a, b) for a, b in zip(full, default.shape))
        acc = torch.zeros(full, dtype=torch.float64)
        if all(tuple(t.shape) == full for t, _ in holders):   # every holder covers every element
            total = 0.0
            for t, w in _shared_once(holders):   # in place, upcast element by element: no temporaries
                acc.add_(t.detach().cpu(), alpha=w)
            for _, w in holders:
                total += w
            avg = acc / total
            out[key] = avg.round().to(ref.dtype) if not ref.is_floating_point() else avg.to(ref.dtype)
            continue
        wsum = torch.zeros(full, dtype=torch.float64)
        for t, w in holders:
            region = tuple(slice(0, n) for n in t.shape)
            acc[region].add_(t.detach().cpu(), alpha=w)
            wsum[region] += w
        if (wsum == 0).any():
            if default is None or tuple(default.shape) != full:
                raise ValueError(f"{key}: some elements are held by no state and no default was given")
            acc = torch.where(wsum == 0, default.detach().to(torch.float64).cpu(), acc)
            wsum = torch.where(wsum == 0, torch.ones_like(wsum), wsum)
        avg = acc / wsum
        out[key] = avg.round().to(ref.dtype) if not ref.is_floating_point() else avg.to(ref.dtype)
    return out


def _shared_once(holders: list[tuple[torch.Tensor, float]]) -> list[tuple[torch.Tensor, float]]:
    """Holders that are views of the same memory (the one server copy every agent of a merged
    group trained with) counted once, with their weights summed: the same average, without
    reading one tensor once per agent."""
    merged: dict[tuple, list] = {}
    for t, w in holders:
        key = (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key in merged:
            merged[key][1] += w
        else:
            merged[key] = [t, w]
    return [(t, w) for t, w in merged.values()]


def layerwise_average(client_states: Mapping[str, Mapping[str, torch.Tensor]],
                      server_states: Mapping[str, Mapping[str, torch.Tensor]],
                      weights: Mapping[str, float],
                      defaults: Mapping[str, torch.Tensor] | None = None,
                      server_groups: Mapping[str, Hashable] | None = None) -> dict[str, torch.Tensor]:
    """S2FL Alg. 2: every layer of the full model averaged over the round's agents.

    For agent ``a`` a layer comes from its client portion if it held the layer, else from
    ``server_states[a]`` — the server copy that trained on ``a``'s activations (its group's).
    The weight of every layer of agent ``a`` is ``weights[a]`` (its data size), so agents on
    different split points contribute to shared layers exactly once each.

    ``server_groups`` (agent -> id of the server copy it trained with) switches to FedFC's
    Alg. 3: a layer is averaged over the client portions that hold it and each server copy
    that trained it, the copy counted *once* — as one participant whose weight is the mean
    weight of the members it stands in for — however many shallower agents fed it.
    """
    return weighted_average(*participants(client_states, server_states, weights, server_groups), defaults)


def participants(client_states: Mapping[str, Mapping[str, torch.Tensor]],
                 server_states: Mapping[str, Mapping[str, torch.Tensor]],
                 weights: Mapping[str, float],
                 server_groups: Mapping[str, Hashable] | None = None
                 ) -> tuple[list[Mapping[str, torch.Tensor]], list[float]]:
    """The states and weights :func:`layerwise_average` averages (a robust rule reads the same):
    per agent its client portion with the server copy standing in for the layers it did not
    hold; with ``server_groups``, the client portions and each server copy once."""
    agents = list(client_states)
    if server_groups is None:
        return [{**server_states.get(a, {}), **client_states[a]} for a in agents], [weights[a] for a in agents]
    states: list[Mapping[str, torch.Tensor]] = [client_states[a] for a in agents]
    ws: list[float] = [weights[a] for a in agents]
    copies: dict[Hashable, dict[str, list[float]]] = {}   # copy -> key -> weights of the members it stands in for
    tensors: dict[Hashable, dict[str, torch.Tensor]] = {}
    for a in agents:
        g = server_groups[a]
        for key, t in server_states.get(a, {}).items():
            if key not in client_states[a]:
                copies.setdefault(g, {}).setdefault(key, []).append(weights[a])
                tensors.setdefault(g, {})[key] = t
    for g, by_key in copies.items():
        by_weight: dict[float, dict[str, torch.Tensor]] = {}
        for key, member_ws in by_key.items():
            by_weight.setdefault(sum(member_ws) / len(member_ws), {})[key] = tensors[g][key]
        for w, part in by_weight.items():
            states.append(part)
            ws.append(w)
    return states, ws
