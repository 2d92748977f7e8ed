"""S2FL adaptive sliding split (docs/methods/s2fl.md; S2FL paper, Yan et al. 2023): candidate splits,
client time table, median rule.

Why: with one split for everybody, fast agents wait for slow ones. S2FL keeps K candidate
split points and gives each agent the one whose recorded round time is closest to the
median of all the selected agents' times, so per-agent round times bunch together.

The model has a fixed *client part* (``blocks[:min(candidates)]``, always on the agent), a
*shared part* the split slides over, and a fixed *server part* (``blocks[max(candidates):]``,
always on the coordinator). The paper uses three split layers per model; so do we. The
candidates are chosen so client FLOPs (and, mostly, activation bytes) change meaningfully
from one to the next: an early cut suits a slow processor, a late one (small activations)
a slow link. Numbers from :func:`sfl_core.model.accounting.model_costs` (10 classes): client
forward+backward FLOPs per sample | activation bytes per sample | ratio of consecutive
client FLOPs:

| model | candidates (cut after) | 1x28x28 FLOPs | 1x28x28 act | ratios | 3x32x32 FLOPs | 3x32x32 act | ratios |
|---|---|---|---|---|---|---|---|
| small_cnn | 1, 2, 3 (conv1, conv2, fc1) | 0.45M / 22.1M / 24.5M | 49K / 24K / 256B | 49 / 1.11 | 1.77M / 30.1M / 33.2M | 64K / 32K / 256B | 17 / 1.10 |
| resnet8 | 2, 3, 4 (layer1, layer2, layer3) | 22.1M / 39.0M / 55.8M | 49K / 24K / 12K | 1.76 / 1.43 | 30.1M / 52.1M / 74.1M | 64K / 32K / 16K | 1.73 / 1.42 |
| vgg_mini | 1, 2, 4 (conv1, conv2, conv4) | 0.45M / 5.87M / 32.4M | 12K / 6K / 2.2K | 13 / 5.5 | 1.77M / 8.85M / 43.5M | 16K / 8K / 4K | 5.0 / 4.9 |
| vgg11 | 2, 4, 6 (conv2, conv4, conv6) | 88.5M / 349M / 540M | 24K / 9K / 2K | 3.94 / 1.55 | 120M / 460M / 800M | 32K / 16K / 8K | 3.82 / 1.74 |
| vgg16 | 2, 4, 7 (conv2, conv4, conv7) | 175M / 435M / 869M | 49K / 24K / 9K | 2.48 / 2.00 | 234M / 573M / 1140M | 64K / 32K / 16K | 2.45 / 1.99 |
| alexnet | 2, 4, 5 (conv2, conv4, conv5) | 132M / 587M / 760M | 37K / 49K / 9K | 4.45 / 1.30 | 177M / 771M / 998M | 48K / 64K / 16K | 4.36 / 1.29 |
| mobilenet_v1 | 3, 5, 7 (dw2, dw4, dw6) | 50.4M / 153M / 262M | 98K / 49K / 32K | 3.03 / 1.71 | 68.2M / 202M / 335M | 128K / 64K / 32K | 2.96 / 1.66 |
| cnn1d (9x128) | 1, 2, 3 (conv1, conv2, conv3) | 1.47M / 17.2M / 26.6M | 16K / 16K / 8K | 11.7 / 1.55 | | | |

(K = 1024 bytes.) small_cnn has only four blocks, so its last step is small in FLOPs
(1.1x) but cuts the activations 100-fold; alexnet's last step is 1.3x in FLOPs and 4-5x in
bytes. Run configs may override the candidates (``s2fl.candidates``).

The client time table itself is shared by every method that plans by time: :mod:`sfl_core.estimates`.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

from sfl_core.estimates import ClientTimeTable

__all__ = ["warmup_split", "median_rule"]

# ====================================================================== the S2FL rules


def warmup_split(round_index: int, candidates: Sequence[int]) -> Optional[int]:
    """Rounds ``1..K`` use ``candidates[round_index - 1]`` for every agent (so each column of
    the table fills); ``None`` once the warm-up is over (or for round 0 / negative rounds)."""
    if 1 <= round_index <= len(candidates):
        return candidates[round_index - 1]
    return None


def median_rule(table: ClientTimeTable, agents: Sequence[str], candidates: Sequence[int]) -> dict[str, int]:
    """S2FL: each selected agent gets the candidate whose time is closest to the median of the
    selected agents' x·K times.

    Only known entries (measured or estimated) count; a split an agent has no entry for is
    skipped for that agent. Ties (equal distance to the median, within 1e-9 relative) go
    to the *smaller* split: less work and memory on the device, and the server copy — which
    has the GPU — takes the extra layers. Raises ``ValueError`` for no candidates or an
    agent with no entry at all (the caller must :meth:`~ClientTimeTable.set_estimate` first).
    """
    if not candidates:
        raise ValueError("median_rule: no candidate splits")
    agents = list(dict.fromkeys(agents))                 # a duplicate must not weigh twice
    cands = sorted(set(int(s) for s in candidates))
    missing = [a for a in agents if all(table.get(a, s) is None for s in cands)]
    if missing:
        raise ValueError(f"median_rule: agent(s) {missing} have no time-table entry for candidates {cands}; "
                         f"estimate them first")
    times = table.times(agents, cands)
    if not times:
        return {}
    median = statistics.median(times)
    tol = 1e-9 * max(1.0, abs(median))
    out: dict[str, int] = {}
    for a in agents:
        best_split, best_gap = None, math.inf
        for s in cands:                                  # ascending: a tie keeps the smaller split
            e = table.get(a, s)
            if e is not None and abs(e.seconds - median) < best_gap - tol:
                best_split, best_gap = s, abs(e.seconds - median)
        assert best_split is not None
        out[a] = best_split
    return out
