"""The BatchNorm statistics' section of the run config (``norm_stats:``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, checked, invalid
from sfl_core.config.section import OptionSection
from sfl_core.config.values import BOOLEAN, NONNEG_INTEGER, POSITIVE_INTEGER, integer_in, one_of


if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig


@dataclass(frozen=True, config=STRICT)
class NormStatsConfig(OptionSection):
    """Where the global model's BatchNorm statistics come from (docs/methods/norm-stats.md):
    averaged with the weights, or recomputed by the devices after aggregation (``federated``).
    ``norm_stats: federated`` is short for ``{mode: federated}``."""

    KEY: ClassVar[str] = "norm_stats"
    SHORTHAND: ClassVar[str] = "mode"
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
    ('',
     "where the global model's BatchNorm statistics come from (docs/methods/norm-stats.md); 'norm_stats: federated' is short for {mode: federated}."),
    ('mode',
     'auto (strategy auto decides from the registered fleet and the model, docs/methods/auto.md; other strategies: averaged) | averaged (with the weights, as FedAvg does) | federated (after aggregation the devices run local batches through the new client portion without training and report each BatchNorm layer\'s input moments and the activations; the coordinator adds its server portion\'s and sets the global statistics; costs a download, forward passes and an upload per asked device, charged by the time model).'),
    ('every',
     'a statistics pass every k rounds; the rounds between keep the last pass\'s statistics (federated).'),
    ('agents',
     "how many of the round's completed agents run the pass, those whose pass the time model prices shortest; 0 = all of them (federated)."),
    ('batches',
     'local batches of batch_size each asked agent runs, 1-64 (federated).'),
    ('freeze_after',
     'after this many rounds, every BatchNorm layer, on the devices and the server, normalises with the '
     "global model's statistics and stops updating them (FixBN; with federated, the last pass's, and no "
     'pass runs after the freeze); 0 = never.'),
    ('local',
     "FedBN (Li et al. 2021): each device keeps the BatchNorm layers of its client portion (scale, shift, "
     "statistics) from its last round instead of the global ones it receives; the global model's, averaged "
     "(or the pass's statistics with federated), are for evaluation, export and a device's first round; "
     "kept in the agent's memory (a restarted agent starts again from the global ones)."),
    )

    mode: Annotated[str, checked(one_of("auto", "averaged", "federated"))] = "auto"
    """auto: strategy auto decides from the fleet (any other strategy: averaged)."""
    every: Annotated[int, POSITIVE_INTEGER] = 1
    """A statistics pass every k rounds (the rounds between keep the last pass's statistics)."""
    agents: Annotated[int, NONNEG_INTEGER] = 0
    """How many of the round's completed agents run the pass, those whose pass the time model
    prices shortest (0: all of them)."""
    batches: Annotated[int, checked(integer_in(1, 64, "an integer from 1 to 64"))] = 1
    """Local batches (of ``batch_size``) each asked agent runs through the new client portion."""
    freeze_after: Annotated[int, NONNEG_INTEGER] = 0
    """After this many rounds, BatchNorm layers train with the global statistics, frozen (FixBN;
    with ``federated``, the last pass's); 0: never."""
    local: Annotated[bool, BOOLEAN] = False
    """FedBN: each device keeps its own BatchNorm layers of its client portion from one round to
    the next; the global model's (averaged, or the pass's statistics) are for evaluation, export
    and a device's first round."""

    @property
    def federated(self) -> bool:
        return self.mode == "federated"

    def check_run(self, run: "RunConfig") -> None:
        if self.federated and run.privacy.dp_sgd is not None:
            raise invalid("norm_stats.mode", "federated statistics are not covered by DP-SGD's accounting: "
                                             "use 'averaged' with privacy.dp_sgd")

