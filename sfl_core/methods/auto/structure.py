"""``strategy: auto``'s decisions on how the model is split and served, for accuracy.

Problem: on a strongly label-skewed fleet each device trains its client portion on a few
classes, and the copies drift apart between averages; the server portion is the one part of
the model that sees every device's rows. Two choices decide how much of the model learns
from the whole fleet's mix, and the run config usually leaves both to the method:

* **The server mode** (``server_mode: auto``). One merged server copy takes a single step per
  local iteration on the concatenated rows (feature merging); SplitFed v2's sequential copy
  takes one step on each device's batch in turn, as many steps a round as centralised
  training, and meets every device's classes within the round (Thapa et al., "SplitFed: When
  Federated Learning Meets Split Learning", AAAI 2022). But each of those steps follows one
  device's few classes, and the deeper the server portion, the more of the model follows them:
  on strongly skewed fleets the sequential copy paid where the server portion was shallow (4
  blocks of a small CNN, 100 devices at Dirichlet 0.1) and cost accuracy where it was deep (7-12
  blocks of a VGG-16, 5-8 of a VGG-11). Where the devices' mixes are closer, each device's batch
  looks like the fleet's, and the copy's many smaller steps are simply more SGD steps: in
  S2FL's setting (12 blocks of a VGG-16 after the cut) at Dirichlet 0.5 and on IID shards it
  ended higher than the merged copy, and reached the target sooner. So: sequential, except on
  strong label skew over a server portion (after the shallowest cut) of more than
  :data:`SEQUENTIAL_SERVER_BLOCKS` blocks. The time model charges the server the same work in
  every mode (a server step per device's rows), so the choice is priced equal and taken for
  accuracy only. Server workers cannot share a sequential copy, so a run with several keeps it
  merged.
* **The cut's depth** (``auto.candidates`` unset). The shallower the cut, the less of the model
  a device trains alone on its own classes. On strong skew the planner's cuts are limited to
  the shallowest ones whose predicted round (the time model, at the run's batch) stays within
  :data:`DEPTH_COST` of the round over every cut; decided once, from the registered fleet.
  Accuracy is bought with time here, within a bound, as the time model prices it.

* **The selection** (``auto.selection: auto``). Label-mix selection (MergeSFL's objective, with
  its priority for rarely chosen devices) chooses each round's devices for a merged label mix
  close to the population's. Where a round takes a small share of the fleet it spreads the
  rounds as evenly as a uniform sample does and its merged mix is far closer to the
  population's; where it takes a large share, the pool it fills greedily is most of the fleet,
  and the devices whose labels never complete the mix sit out round after round. So: label
  mix where a round takes at most :data:`SELECTION_SHARE` of the fleet, the uniform sample
  otherwise.

All read the same evidence as the training options' rules (:mod:`sfl_core.evidence`).

Cost: the server mode is a comparison; the depth prices the fleet once per shallower prefix of
the candidate cuts (a handful of planner calls, once per run).
"""

from __future__ import annotations

from typing import Callable, Sequence

from sfl_core.evidence import Evidence

__all__ = ["DEPTH_COST", "SELECTION_SHARE", "SEQUENTIAL_SERVER_BLOCKS", "depth_reason", "selection_for",
           "server_mode_for", "shallow_cuts"]

DEPTH_COST = 2.0
"""How much longer a predicted round the shallower cuts may cost (on a strongly skewed fleet). At
the hard end (100 devices, Dirichlet 0.1) the first cut instead of the second cost 1.8x the
predicted round at equal batches, 1.3x the run's virtual time once batches were regulated, and
ended 1.4 points higher on each of four seeds."""
SEQUENTIAL_SERVER_BLOCKS = 4
"""The deepest server portion (blocks after the shallowest cut) a sequential server copy trains."""

SELECTION_SHARE = 0.25
"""The largest share of the fleet a round may take for label-mix selection to choose it. Over 100
rounds on Dirichlet(0.1) fleets, with 10 of 100 devices a round label-mix selection spread the
rounds as evenly as a uniform sample (coefficient of variation of the rounds per device 0.27
against 0.28-0.31); with 10 of 20 it spread them three times as unevenly (0.28-0.40 against
0.08-0.12: 5-15 % of the devices took part in under half their share), and on MergeSFL's
setting (10 of 20 Jetsons) the uniform sample ended 1.9 points higher over four seeds."""


def selection_for(evidence: Evidence) -> tuple[str, str]:
    """How auto chooses the round's devices where the run leaves it to auto, and why."""
    share = f"a round takes {evidence.per_round} of {evidence.agents} devices"
    if not evidence.partial:
        return "uniform", f"{share}: there is no choice to make"
    if evidence.per_round <= SELECTION_SHARE * evidence.agents:
        return "kl", (f"{share}: label-mix selection brings the merged label mix close to the population's "
                      "and still spreads the rounds evenly")
    return "uniform", (f"{share}, over {SELECTION_SHARE:.0%}: label-mix selection would leave the devices "
                       "that never complete the mix out for many rounds; a uniform sample")


def _skew(evidence: Evidence) -> str:
    return f"mean KL {evidence.label_skew:.2f} nats, {100 * evidence.absent:.0f} % of classes absent"


def server_mode_for(evidence: Evidence, *, server_blocks: int, shared: bool) -> tuple[str, str]:
    """The server mode for a run that leaves it to auto, and why. ``server_blocks``: the model's
    blocks after the shallowest cut the run may plan; ``shared``: several server workers share
    the round (they cannot share a sequential copy)."""
    if shared:
        return "merged", "server workers share the round and cannot share a sequential copy"
    if not evidence.strongly_skewed:
        return "sequential", (f"the devices' label mixes are close to the fleet's (mean KL {evidence.label_skew:.2f} "
                              "nats): each device's batch is like the fleet's, and one server copy stepping on each "
                              "in turn takes as many steps as centralised training")
    if server_blocks > SEQUENTIAL_SERVER_BLOCKS:
        return "merged", (f"strongly label-skewed devices, but a server portion of {server_blocks} blocks "
                          f"(over {SEQUENTIAL_SERVER_BLOCKS}) would follow each device's few classes step by step "
                          "in a sequential copy: one merged step on every device's rows")
    return "sequential", (f"strongly label-skewed devices ({_skew(evidence)}) and a server portion of "
                          f"{server_blocks} blocks: one server copy steps on each device's batch in turn, "
                          "so it meets every device's classes each round")


def shallow_cuts(cuts: Sequence[int], round_s: Callable[[tuple[int, ...]], float]
                 ) -> tuple[tuple[int, ...], float, float]:
    """The shallowest prefix of ``cuts`` (ascending) whose predicted round ``round_s(prefix)``
    is within :data:`DEPTH_COST` of ``round_s(cuts)``; with both rounds (seconds). A prefix
    always exists: the whole list is one."""
    cuts = tuple(sorted(cuts))
    every = round_s(cuts)
    for k in range(1, len(cuts)):
        t = round_s(cuts[:k])
        if t <= DEPTH_COST * every:
            return cuts[:k], t, every
    return cuts, every, every


def depth_reason(evidence: Evidence, kept: Sequence[int], cuts: Sequence[int], t: float, every: float) -> str:
    """Why :func:`shallow_cuts` kept ``kept`` of ``cuts``."""
    if len(kept) == len(cuts):
        return (f"strongly label-skewed devices ({_skew(evidence)}), but every shallower set of cuts would make "
                f"the predicted round more than {DEPTH_COST:g}x the {every:.3g} s over every cut")
    return (f"strongly label-skewed devices ({_skew(evidence)}): the shallowest cuts whose predicted round "
            f"{t:.3g} s is within {DEPTH_COST:g}x of the {every:.3g} s over every cut, so a device trains less of "
            f"the model alone on its own classes")
