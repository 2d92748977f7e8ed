"""Splitting a training set's indices across agents to emulate data heterogeneity (docs/methods/data-heterogeneity.md).

Pure, seeded numpy: every agent can compute its own shard from ``(labels, seed, scheme)``
without talking to anyone, and the coordinator computes the same shards to know each agent's
label counts. The same arguments always give the same result (``numpy.random.default_rng``);
a different seed gives a different one.

Schemes:

- ``iid``: shuffle, split into ``num_agents`` near-equal parts.
- ``dirichlet``: label skew. For each class ``c``, draw ``p ~ Dir(alpha * 1_n)`` and split the
  (shuffled) samples of ``c`` across agents in proportions ``p``. Small ``alpha`` = severe
  skew. Redrawn until every agent has at least ``min_size`` samples (bounded retries).
- ``data-imbalance`` (FedFC): quantity skew. Agent ``i`` gets a share proportional to
  ``n - i`` (for 4 agents: 40/30/20/10 %). Each class is split by the same shares, so label
  distributions stay alike and only the amount of data differs.
- ``class-imbalance`` (FedFC): agent ``i`` holds the classes of group ``i mod 4`` of
  ``(0,1,2), (2,3,4), (4,5,6), (7,8,9)``; see :func:`class_groups` for other class counts.
- ``extreme`` (FedFC): disjoint pairs ``(0,1), (2,3), ...``; agent ``i`` holds pair
  ``i mod (num_classes // 2)`` (an odd last class joins the last pair).

For ``iid``, ``dirichlet`` and ``data-imbalance`` the shards partition the whole training set
(every index exactly once). For ``class-imbalance`` and ``extreme`` each held class is split
evenly among the agents holding it (shuffled, near-equal parts), shards are disjoint, and
they cover every index only when every group/pair is held by at least one agent (``num_agents
>= 4`` resp. ``>= num_classes // 2``): classes nobody holds are left out by design.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

__all__ = [
    "SCHEMES",
    "class_groups",
    "class_pairs",
    "label_counts",
    "load_shard_file",
    "partition_indices",
    "save_shard_file",
    "shard_for_agent",
]

SCHEMES = ("iid", "dirichlet", "data-imbalance", "class-imbalance", "extreme")

# FedFC's class-imbalance groups for 10 classes, as half-open ranges on [0, 10):
# [0,3)={0,1,2}, [2,5)={2,3,4}, [4,7)={4,5,6}, [7,10)={7,8,9}.
_FEDFC_RANGES = ((0, 3), (2, 5), (4, 7), (7, 10))
_DIRICHLET_RETRIES = 1000


def _check_labels(labels: np.ndarray, num_classes: int | None) -> tuple[np.ndarray, int]:
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise ValueError(f"labels must be non-negative, found {int(arr.min())}")
    top = int(arr.max()) + 1 if arr.size else 0
    if num_classes is None:
        num_classes = top
    elif num_classes < top:
        raise ValueError(f"num_classes={num_classes} but labels contain class {top - 1}")
    return arr, int(num_classes)


def label_counts(labels: np.ndarray, num_classes: int) -> list[int]:
    """Samples per class ``[count(0), ..., count(num_classes-1)]`` (what agents report)."""
    arr, k = _check_labels(labels, num_classes)
    return [int(c) for c in np.bincount(arr, minlength=k)]


def class_groups(num_classes: int) -> list[list[int]]:
    """FedFC class-imbalance groups, scaled to ``num_classes``.

    The 10-class ranges ``[a, b)`` above become ``[floor(a*C/10), max(floor(b*C/10), start+1))``,
    which is the identity for ``C = 10``, keeps the overlaps proportional (C=100: 0-29, 20-49,
    40-69, 70-99) and covers every class. Needs ``C >= 4``.
    """
    if num_classes < 4:
        raise ValueError(f"class-imbalance needs num_classes >= 4, got {num_classes}")
    groups = []
    for a, b in _FEDFC_RANGES:
        start = a * num_classes // 10
        end = max(b * num_classes // 10, start + 1)
        groups.append(list(range(start, end)))
    return groups


def class_pairs(num_classes: int) -> list[list[int]]:
    """Disjoint pairs ``[0,1], [2,3], ...``; with an odd count the last class joins the last pair."""
    if num_classes < 2:
        raise ValueError(f"extreme needs num_classes >= 2, got {num_classes}")
    pairs = [[2 * j, 2 * j + 1] for j in range(num_classes // 2)]
    if num_classes % 2:
        pairs[-1].append(num_classes - 1)
    return pairs


def _split_sizes(total: int, shares: np.ndarray) -> np.ndarray:
    """Integer sizes summing to ``total``, cut at ``floor(cumsum(shares) * total)``."""
    cum = np.cumsum(shares) / shares.sum()
    cuts = np.floor(cum[:-1] * total).astype(np.int64)
    return np.diff(np.concatenate(([0], cuts, [total])))


def _by_class(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffled indices of each class (one permutation per class, in class order)."""
    order = np.argsort(labels, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(labels, minlength=num_classes))))
    return [rng.permutation(order[bounds[c] : bounds[c + 1]]) for c in range(num_classes)]


def _dirichlet(per_class: list[np.ndarray], n: int, alpha: float, min_size: int, rng: np.random.Generator) -> list[list[np.ndarray]]:
    sizes_per_class = [len(ix) for ix in per_class]
    for _ in range(_DIRICHLET_RETRIES):
        props = rng.dirichlet(np.full(n, alpha), size=len(per_class))  # (classes, agents)
        splits = [_split_sizes(m, p) for m, p in zip(sizes_per_class, props)]
        totals = np.sum(splits, axis=0) if splits else np.zeros(n, dtype=np.int64)
        if totals.min() >= min_size:
            return [[chunk for chunk in np.split(ix, np.cumsum(sz)[:-1])] for ix, sz in zip(per_class, splits)]
    raise ValueError(
        f"dirichlet(alpha={alpha}) could not give each of {n} agents >= {min_size} samples in "
        f"{_DIRICHLET_RETRIES} draws; use a larger alpha, fewer agents or a smaller min_size"
    )


def _holders(assignment: list[list[int]], n: int) -> dict[int, list[int]]:
    """class -> agents holding it, given each agent's group/pair via ``i mod len(assignment)``."""
    out: dict[int, list[int]] = {}
    for agent in range(n):
        for c in assignment[agent % len(assignment)]:
            out.setdefault(c, []).append(agent)
    return out


def partition_indices(
    labels: np.ndarray,
    num_agents: int,
    scheme: str = "iid",
    *,
    alpha: float = 0.5,
    seed: int = 0,
    num_classes: int | None = None,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Indices into ``labels`` for each of ``num_agents`` agents (sorted int64 arrays).

    See the module docstring for what each scheme does. Raises ``ValueError`` for an unknown
    scheme, ``num_agents < 1``, ``alpha <= 0``, or when some agent would get fewer than
    ``min_size`` samples.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown partition scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    if int(num_agents) != num_agents or num_agents < 1:
        raise ValueError(f"num_agents must be an integer >= 1, got {num_agents}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    n = int(num_agents)
    arr, k = _check_labels(labels, num_classes)
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]

    if scheme == "iid":
        for agent, chunk in enumerate(np.array_split(rng.permutation(arr.size), n)):
            parts[agent].append(chunk)
    elif scheme == "dirichlet":
        for chunks in _dirichlet(_by_class(arr, k, rng), n, alpha, min_size, rng):
            for agent, chunk in enumerate(chunks):
                parts[agent].append(chunk)
    elif scheme == "data-imbalance":
        shares = np.arange(n, 0, -1, dtype=np.float64)
        for ix in _by_class(arr, k, rng):
            for agent, chunk in enumerate(np.split(ix, np.cumsum(_split_sizes(len(ix), shares))[:-1])):
                parts[agent].append(chunk)
    else:
        assignment = class_groups(k) if scheme == "class-imbalance" else class_pairs(k)
        holders = _holders(assignment, n)
        for c, ix in enumerate(_by_class(arr, k, rng)):
            agents = holders.get(c, [])
            for agent, chunk in zip(agents, np.array_split(ix, max(len(agents), 1))):
                parts[agent].append(chunk)

    shards = [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64) for p in parts]
    small = [i for i, s in enumerate(shards) if len(s) < min_size]
    if small:
        raise ValueError(
            f"scheme {scheme!r} gives agents {small} fewer than min_size={min_size} samples "
            f"({len(arr)} samples, {n} agents)"
        )
    return shards


def shard_for_agent(
    labels: np.ndarray,
    agent_index: int,
    num_agents: int,
    scheme: str,
    *,
    alpha: float = 0.5,
    seed: int = 0,
    num_classes: int | None = None,
) -> np.ndarray:
    """One agent's shard: what an agent computes locally, identical to the coordinator's view."""
    if not 0 <= agent_index < num_agents:
        raise ValueError(f"agent_index must be in [0, {num_agents}), got {agent_index}")
    return partition_indices(labels, num_agents, scheme, alpha=alpha, seed=seed, num_classes=num_classes)[agent_index]


# --------------------------------------------------------------------------- shard files


def _validate_indices(values: object, where: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{where}: indices must be a flat list, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{where}: indices must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{where}: indices must be non-negative, found {int(arr.min())}")
    if np.unique(arr).size != arr.size:
        raise ValueError(f"{where}: indices must be unique (found duplicates)")
    return arr


def load_shard_file(path: str | Path) -> np.ndarray:
    """Read a shard: ``.npy`` (no pickle) or JSON ``{"indices": [...]}``; validated int64 array."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: shard file not found")
    if p.suffix == ".npy":
        try:
            raw = np.load(p, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise ValueError(f"{p}: not a valid .npy array of integers ({exc})") from exc
        return _validate_indices(raw, str(p))
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p}: not valid JSON ({exc}); expected {{\"indices\": [...]}}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("indices"), list):
        raise ValueError(f'{p}: expected a JSON object {{"indices": [int, ...]}}')
    items = doc["indices"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"{p}: indices must all be JSON integers")
    try:
        arr = np.array(items, dtype=np.int64)
    except OverflowError as exc:
        raise ValueError(f"{p}: index out of the int64 range") from exc
    return _validate_indices(arr, str(p))


def save_shard_file(path: str | Path, indices: np.ndarray) -> None:
    """Write a shard as ``.npy`` (by suffix) or JSON otherwise; atomic (temp file + rename)."""
    p = Path(path)
    arr = _validate_indices(indices, str(p))
    tmp = p.with_name(p.name + ".tmp")
    if p.suffix == ".npy":
        with open(tmp, "wb") as fh:
            np.save(fh, arr, allow_pickle=False)
    else:
        tmp.write_text(json.dumps({"indices": arr.tolist()}), encoding="utf-8")
    os.replace(tmp, p)
