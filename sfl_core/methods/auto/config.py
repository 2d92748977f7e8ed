"""The joint planner's section of the run config (``auto:``): what it may choose among, and its bounds."""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Union

from pydantic import model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, Fail, checked, invalid, number
from sfl_core.config.section import MethodSection
from sfl_core.config.values import (
    BATCH,
    BOOLEAN,
    OPTIONAL_BATCH,
    POSITIVE_INTEGER,
    UNIT_OPEN,
    codec_list,
    number_in,
    one_of,
    positive_integers,
    split_points,
)
from sfl_core.wire.codec import CODECS, TOPK_PATTERN


def _widths(v: Any, fail: Fail) -> str | tuple[int, ...] | None:
    if v == "auto":
        return "auto"
    if isinstance(v, str):
        fail('"auto", a non-empty list of positive integers, or null')
    return positive_integers(v, fail)


def _whole_model(v: Any, fail: Fail) -> Union[bool, str]:
    if v == "auto" or isinstance(v, bool):
        return v
    fail('"auto", true or false')


def _epsilon(v: Any, fail: Fail) -> str | float:
    if v == "auto":
        return "auto"
    x = number(v)
    if x is None or x < 0:
        fail('"auto" or a number >= 0')
    return float(x)


def _codec_tuple(v: Any, fail: Fail) -> tuple[str, ...]:
    out = codec_list(v, fail)
    if out is None:
        fail("a non-empty list of codecs (" + ", ".join(CODECS) + f" or {TOPK_PATTERN})")
    return out


@dataclass(frozen=True, config=STRICT)
class AutoConfig(MethodSection):
    """``strategy: auto`` (docs/methods/auto.md): split, codec and batch per agent, planned jointly each round."""

    KEY: ClassVar[str] = 'auto'
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
        ('',
         'the joint planner, used when strategy is auto (docs/methods/auto.md): each round, per agent, the split, codec (bottleneck width) and batch that make the slowest agent finish first while the merged batch keeps its size'),
        ('candidates',
         "the cuts it chooses among (strictly increasing); null = the model's candidate splits."),
        ('whole_model',
         "also consider the whole model on an agent (FedAvg-style: it trains locally and sends only its weights) where that finishes sooner than any cut; auto (the default) = yes where the registered devices' label mixes look alike, no on a label-skewed fleet (a device training the whole model on its own classes drifts from the others, where a cut's server part trains on every device's rows)."),
        ('selection',
         "which agents train each round: uniform = the engine's uniform sample of per_round; kl = among a pool drawn with priority to rarely chosen agents (MergeSFL Eq. 13), the per_round whose merged label mix is closest to the population's (MergeSFL Eq. 11-12). auto (the default) = kl where a round takes at most a quarter of the registered fleet, else uniform: with a larger share, label-mix selection keeps choosing the agents that complete the mix and leaves others out for many rounds (docs/methods/auto.md). Where every online agent trains each round the two are the same."),
        ('codecs',
         'the activation codecs it may choose among (only those within max_compression are used).'),
        ('max_compression',
         'the strongest codec compression allowed, >= 1: fp16/bf16 = 2, int8 = 4, topk<P> = 67/P. Default 2: fp16 errs little, int8 cost accuracy on a bench (docs/results.md).'),
        ('widths',
         "bottleneck widths (channels, HeteroSFL's encoder/decoder pair at the run's split, the widest its full width) it may give an agent cut at that split, within max_bottleneck; cuts then stop at that split (no later cut, no whole model), and an agent with time to spare sends the widest width that keeps the round's time. auto (the default) = decided once from the run's fleet: the full width and each quarter of it down to 1 channel that sends at least min_bottleneck_values values per sample, where they make the fleet's predicted round at the run's batch size at least 2.5x shorter (links that slow), else none (the run's notes and sfl-coord plan say which and why); a list = these widths; null = no bottleneck (docs/methods/auto.md)."),
        ('max_bottleneck',
         'the strongest bottleneck compression allowed (the cut\'s channels over the width sent), >= 1.'),
        ('min_bottleneck_values',
         "the fewest values per sample (width x the activation map's positions) a width of the widths: auto ladder may send, >= 1; default 64, the narrowest bottleneck the HeteroSFL paper measured (one 8x8 channel). Narrower ones stalled learning on 8x8 digits (2 channels of 4x4 = 32 values)."),
        ('regulate',
         "plan batch sizes too (faster agents train larger batches, learning rate scaled with the batch, MergeSFL Eq. 15); false = every agent trains the run's batch_size."),
        ('max_batch',
         'largest batch of one agent (1-4096); null = 2 x batch_size.'),
        ('min_batch',
         'smallest batch of one agent (1-4096; batch-norm needs >= 2).'),
        ('epsilon',
         "how far (KL, nats) regulated batches may move the merged batch's label mix from what equal batches would give, >= 0; auto = no limit where label-mix selection (kl) chose the round's agents out of more, else 0.05."),
        ('smoothing',
         "weight of the previous estimate when a round's measured compute and link seconds arrive, in [0, 1); lower follows a device's slowdown faster."),
    )

    candidates: Annotated[Optional[tuple[int, ...]], checked(split_points)] = None   # None = the model's candidate cuts
    whole_model: Annotated[Union[bool, str], checked(_whole_model)] = "auto"
    """Also consider the whole model on the agent (it sends weights only) where that is faster;
    "auto": where the registered devices' label mixes look alike."""
    selection: Annotated[str, checked(one_of("auto", "uniform", "kl"))] = "auto"
    """Which agents train: 'kl' = label mix closest to the population's, 'uniform' = the engine's
    uniform sample, 'auto' = kl where a round takes at most a quarter of the fleet
    (:func:`sfl_core.methods.auto.structure.selection_for`)."""
    codecs: Annotated[tuple[str, ...], checked(_codec_tuple)] = ("fp32", "fp16", "int8")
    max_compression: Annotated[float, checked(number_in(1.0, lo_open=False, what="a number >= 1"))] = 2.0
    """Strongest codec compression allowed (fp16 = 2x, int8 = 4x, topk<P> = 67/P x)."""
    widths: Annotated[Union[str, tuple[int, ...], None], checked(_widths)] = "auto"
    """Bottleneck widths an agent cut at the run's split may send (HeteroSFL's encoder/decoder pair
    there, the widest = its full width); None = no bottleneck; "auto" = a ladder of widths where
    they make the fleet's predicted round much shorter (decided once, from the run's fleet:
    :func:`sfl_core.methods.auto.method.decide_widths`). Cuts then stop at that split."""
    max_bottleneck: Annotated[float, checked(number_in(1.0, lo_open=False, what="a number >= 1"))] = 64.0
    """Strongest bottleneck compression allowed (the cut's channels over the width sent)."""
    min_bottleneck_values: Annotated[int, POSITIVE_INTEGER] = 64
    """Fewest values per sample a width of the ``widths: auto`` ladder sends (width x the map's
    positions): HeteroSFL's narrowest measured bottleneck, one 8x8 channel."""
    regulate: Annotated[bool, BOOLEAN] = True        # batch sizes planned with the rest; false = the run's batch
    max_batch: Annotated[Optional[int], OPTIONAL_BATCH] = None
    """Largest batch of one agent; None = 2 x batch_size."""
    min_batch: Annotated[int, BATCH] = 2
    epsilon: Annotated[Union[str, float], checked(_epsilon)] = "auto"
    """Nats the merged label mix may drift from equal batches'; "auto" = none where label-mix
    selection chose the round's agents, else 0.05 (:func:`sfl_core.methods.auto.method.label_mix_bound`)."""
    smoothing: Annotated[float, UNIT_OPEN] = 0.5
    """Weight of the previous speed estimate when a round's measurement arrives (MergeSFL Eq. 5-6)."""

    @model_validator(mode="after")
    def _relations(self) -> "AutoConfig":
        if self.max_batch is not None and self.max_batch < self.min_batch:
            raise invalid("max_batch", f"expected at least auto.min_batch {self.min_batch}, got {self.max_batch}")
        return self
