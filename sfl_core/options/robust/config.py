"""The robust aggregation's section of the run config (``robust:``)."""

from __future__ import annotations

from typing import Any, ClassVar, Union

from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, Fail, checked, number
from sfl_core.config.section import OptionSection
from sfl_core.config.values import NONNEG_INTEGER, auto_or_share, number_in, one_of

RULES = ("mean", "clip", "trimmed_mean", "median", "multi_krum")


def _factor_or_off(v: Any, fail: Fail) -> float:
    x = number(v)
    if x is None or not (x == 0 or x > 1):
        fail("0 (off) or a number > 1")
    return float(x)


def _cap(v: Any, fail: Fail) -> float:
    x = number(v)
    if x is None or not (x == 0 or x >= 1):
        fail("0 (no cap) or a number >= 1")
    return float(x)


@dataclass(frozen=True, config=STRICT)
class RobustConfig(OptionSection):
    """How the round's states are combined when a device may lie (docs/methods/robust.md):
    the weight a device claims is capped, and the average may be a robust one. ``robust:
    median`` is short for ``{aggregate: median}``."""

    KEY: ClassVar[str] = "robust"
    SHORTHAND: ClassVar[str] = "aggregate"
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("", "what a device that lies can do to the round (docs/methods/robust.md): its claimed weight is "
             "capped, its activations screened out of the server's step where their size is far from its cut's, "
             "and the round's states combined by a robust rule; 'robust: median' is short for "
             "{aggregate: median}."),
        ("aggregate",
         "mean (the method's weighted layer-wise average) | clip (default: an agent whose change from the round's "
         "start is over clip_factor x the round's typical change, or over peer_factor x that of its peers, or as large as the weights it started from (they were replaced, not trained), is left out of the round, and named) | trimmed_mean (coordinate-wise, the trim largest and smallest share of "
         "values dropped; Yin et al. 2018) | median (coordinate-wise median; Yin et al. 2018) | multi_krum (the "
         "agents whose changes lie closest to their neighbours, the attackers share of the round's agents left "
         "out and named; Blanchard et al. 2017). The coordinate-wise rules ignore the weights."),
        ("clip_factor", "clip: how large an agent's change may be against the round's typical change, > 0 (1: "
                        "typical; each layer's change against the median of that layer's holders, at most 3x the "
                        "layer's typical change of the round before, combined over its layers weighted by their "
                        "elements, per unit of its learning rate over the square root of its batch: a small batch's "
                        "change is mostly noise). The default 10 leaves honest devices alone (up to 7.6 on the "
                        "shipped configs, small skewed fleets given batches of 2 to 32 by the joint planner; under "
                        "3 on a 20-device one) while random weights and updates scaled x1000 are left out, named "
                        "and, round after round, quarantined; where devices train alike, peer_factor bounds "
                        "tightly."),
        ("peer_factor", "clip: how large an agent's change may be against its peers' typical change, where 5 or "
                        "more of the round's agents were given the same assignment (cut, bottleneck width, batch, "
                        "steps); > 1, 0 = off. Peers train alike, so the bound is tighter than clip_factor, which "
                        "holds across cuts, widths and batches: the default 4 leaves out and names updates scaled "
                        "x10 that pass under the round's bound, while honest peers stayed within 3.3x of their "
                        "median on the attack bench's skewed fleets (one BatchNorm device reached 5.5x once)."),
        ("trim", "trimmed_mean: the share of values dropped at each end of every coordinate, in [0, 0.5)."),
        ("attackers", "multi_krum: the share of a round's agents assumed malicious (f = floor(share x agents), "
                      "at most (agents - 3) / 2), in [0, 0.5)."),
        ("weight_cap", "an agent's weight in the average (its claimed data size, or the batch the coordinator "
                       "assigned) at most this many times the median weight (of every registered agent's claim; of "
                       "the round's batches), >= 1; 0 = no cap. A device's "
                       "data size cannot be verified; the default 10 leaves most honest fleets as they are and "
                       "keeps one device from outweighing the round by a claim. A capped device is named; it "
                       "counts towards quarantine only where its claim is over 10x the cap (a large honest "
                       "device of a skewed fleet stays in, weighing the cap)."),
        ("activation_factor", "the server portion's screen: a device whose activations' root mean square lies over "
                              "this many times (or under 1/this) the median of the devices cut at the same layer "
                              "in a server step has its rows left out of that step (a zero gradient back) and its "
                              "round's update left out of the average, and is named; > 1, 0 = off. Honest devices "
                              "at one cut stay within 2x of each other whatever their labels; activations scaled "
                              "x10 or noised to that size are caught. Cuts fewer than 3 devices share are not "
                              "screened."),
        ("label_margin", "the label screen: each device's first rows of a round are compared with the coordinator's "
                         "labelled held-out data run through the round's client portion; a device whose share of rows "
                         "nearer another class's held-out centroid than their label's is more than this margin over "
                         "the share expected of those classes (measured on the held-out rows) has its rows left out "
                         "of the round's server steps and its update out of the average, and is named (flipped labels, "
                         "a backdoor's triggered rows), where chance (the binomial's exact tail) makes it likelier "
                         "than 4 standard deviations of a normal tail it passes; where this round's rows mismatch "
                         "more than expected, the same holds for its "
                         "first rows of its last 3 rounds added up (each against its round's held-out data); a number "
                         "in (0, 1), 0 = off, auto (default) = 0.2. Where the device's layers hold BatchNorm, each "
                         "device is screened against held-out samples of its own mix of classes run as one batch "
                         "(a batch's own statistics move "
                         "its activations by its mix of labels), a row being unlike its label where it lies farther "
                         "from its class's held-out centroid than 90 % of the class's held-out rows; that batch is "
                         "the client portion's forward on tens to hundreds of held-out samples per device at its "
                         "first steps of each round, which on a CPU server can cost more than the server step "
                         "(docs/scaling.md; frozen statistics, norm_stats.freeze_after, run the held-out samples "
                         "once a round instead). Needs labels "
                         "sent with the activations and validation data on the server. Devices that poison fewer "
                         "than this share of their rows go unseen."),
        ("mix_limit", "the mix of classes each device registered (what MergeSFL's selection, the joint planner's "
                      "batches and S2FL's groups read) against the labels it sends in a round: where they lie over "
                      "this many standard deviations of chance from the claim (the likelihood-ratio statistic's "
                      "Wilson-Hilferty transform), or include a class it claimed none of, the device is named, "
                      "counted towards quarantine, and planned from then on by the mix it showed; > 0, 0 = off. "
                      "An honest device's labels are draws from what it holds: the default 5 is passed by chance "
                      "about once in three million rounds, while a device claiming an even mix and holding a "
                      "label-skewed one lies far beyond it within a round. Needs labels sent with the "
                      "activations."),
        ("repeated_rows", "once (default): the server's step trains on a row a device sent twice in it (the same "
                          "input and label: a device holding fewer samples than its batch wraps around its data) "
                          "once, and gives each copy its gradient, so a device weighs in the server's step by the "
                          "samples it showed, at most its batch | each: every "
                          "row as sent (a device of 16 samples given batches of 32 weighs as much as one of 32). "
                          "The label screen counts a repeated row once either way."),
        ("quarantine", "a device flagged (capped, clipped, left out, or its rows left out) in this many of its rounds in a row is no "
                       "longer selected until an operator readmits it (sfl-coord agents readmit RUN_DIR ID); the "
                       "log names it and the checkpoint keeps it; 0 = never. A resumed run counts the rounds afresh."),
    )

    aggregate: Annotated[str, checked(one_of(*RULES))] = "clip"
    """The rule that combines the round's states."""
    clip_factor: Annotated[float, checked(number_in(0.0, what="a number > 0"))] = 10.0
    peer_factor: Annotated[float, checked(_factor_or_off)] = 4.0
    trim: Annotated[float, checked(number_in(0.0, lo_open=False, hi=0.5, hi_open=True, what="a number in [0, 0.5)"))] = 0.3
    attackers: Annotated[float, checked(number_in(0.0, lo_open=False, hi=0.5, hi_open=True,
                                                  what="a number in [0, 0.5)"))] = 0.3
    weight_cap: Annotated[float, checked(_cap)] = 10.0
    activation_factor: Annotated[float, checked(_factor_or_off)] = 4.0
    label_margin: Annotated[Union[str, float], checked(auto_or_share)] = "auto"
    mix_limit: Annotated[float, checked(number_in(0.0, lo_open=False, what="a number >= 0"))] = 5.0
    repeated_rows: Annotated[str, checked(one_of("once", "each"))] = "once"
    quarantine: Annotated[int, NONNEG_INTEGER] = 3

    LABEL_MARGIN: ClassVar[float] = 0.2
    """The label screen's margin where ``label_margin`` is auto, with BatchNorm's matched reference
    and without: chosen on the attack benches' seeds 0-1 between 0.15, 0.2 and 0.3. On a hundred
    MNIST devices 0.15 stopped the backdoor as 0.2 did and flagged more honest devices without
    attackers; 0.3 let through a backdoor's devices holding mostly its target class (their
    triggered images are mostly of that class already, so fewer of their rows disagree with
    their labels)."""

    def label_screen(self) -> float:
        """The label screen's margin (0: off)."""
        return self.LABEL_MARGIN if self.label_margin == "auto" else float(self.label_margin)

    @property
    def on(self) -> bool:
        return (self.aggregate != "mean" or self.weight_cap > 0 or self.activation_factor > 0
                or self.label_margin != 0 or self.repeated_rows == "once" or self.mix_limit > 0)
