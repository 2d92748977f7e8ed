"""MergeSFL's section of the run config (``mergesfl:``): batch regulation and KL worker selection."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar, Optional

from pydantic import model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, checked, invalid
from sfl_core.config.section import MethodSection
from sfl_core.config.values import (
    AT_LEAST_0,
    BATCH,
    BOOLEAN,
    FRACTION,
    OPTIONAL_BATCH,
    OPTIONAL_POSITIVE_INTEGER,
    OPTIONAL_POSITIVE_NUMBER,
    POSITIVE_INTEGER,
    UNIT_OPEN,
    integer_in,
    number_in,
    optional,
)

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig


@dataclass(frozen=True, config=STRICT)
class MergeSflConfig(MethodSection):
    """MergeSFL control (docs/methods/mergesfl.md): batch-size regulation and KL worker selection under an
    ingress budget, on top of feature merging (``server_mode: merged``)."""

    KEY: ClassVar[str] = 'mergesfl'
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
        ('',
         'MergeSFL control (docs/methods/mergesfl.md), on top of feature merging'),
        ('regulate',
         'batch-size regulation (Eq. 9): the fastest agent gets max_batch, the others d_i = floor(D (mu_l+beta_l)/(mu_i+beta_i)) so all take equally long; lr scales with the batch; aggregation weighted by batch size (Eq. 17).'),
        ('max_batch',
         "D, the fastest agent's batch (>= batch_size); null = batch_size."),
        ('select',
         "KL worker selection (Eq. 10-13): a genetic algorithm picks the agents whose merged label mix is closest to the population's, within the ingress budget; then batches are tuned (Eq. 14) and scaled to fill the budget. per_round is not used: the budget sets how many agents train (bound it with min_agents / max_agents)."),
        ('min_agents',
         'with select: the fewest agents a round takes, where the budget lets that many fit.'),
        ('max_agents',
         'with select: the most agents a round takes; null = no bound.'),
        ('min_batch',
         'the smallest batch regulation and selection give an agent (>= 2 keeps batch-norm layers from single-sample batches).'),
        ('budget_bytes',
         "coordinator ingress budget per round (activation bytes per step); null = per_round x batch_size samples' activations."),
        ('epsilon',
         'KL target (nats) of the batch fine-tuning.'),
        ('smoothing',
         'weight of the previous estimate of mu (compute s/sample) and beta (transfer s/sample), Eq. 5-6, in [0, 1).'),
        ('ga_population',
         'individuals of the genetic algorithm.'),
        ('ga_generations',
         'generations at most (stops after 30 without improvement).'),
        ('ga_crossover',
         'uniform-crossover probability in [0, 1].'),
        ('ga_mutation',
         'per-gene flip probability; null = 1/agents.'),
    )

    regulate: Annotated[bool, BOOLEAN] = False    # Eq. 9: fastest agent gets max_batch, the others equal time
    max_batch: Annotated[Optional[int], OPTIONAL_BATCH] = None  # D; None = batch_size
    select: Annotated[bool, BOOLEAN] = False      # Eq. 10-13: GA picks the agents whose mixed labels are closest to IID
    min_agents: Annotated[int, POSITIVE_INTEGER] = 1    # with select: fewest agents per round (where the budget fits them)
    max_agents: Annotated[Optional[int], OPTIONAL_POSITIVE_INTEGER] = None    # with select: most agents per round; None = no bound
    min_batch: Annotated[int, BATCH] = 2       # smallest regulated batch (batch-norm needs >= 2 samples)
    budget_bytes: Annotated[Optional[float], OPTIONAL_POSITIVE_NUMBER] = None   # ingress budget per round; None = per_round x batch_size samples
    epsilon: Annotated[float, AT_LEAST_0] = 0.01                       # Eq. 14: KL target (nats) of the batch fine-tuning
    smoothing: Annotated[float, UNIT_OPEN] = 0.8
    """Eq. 5-6: weight of the previous estimate of mu and beta."""
    ga_population: Annotated[int, checked(integer_in(2, 10_000, what="an integer from 2 to 10000"))] = 60
    ga_generations: Annotated[int, checked(integer_in(1, 100_000, what="an integer from 1 to 100000"))] = 100
    ga_crossover: Annotated[float, FRACTION] = 0.9
    ga_mutation: Annotated[Optional[float], checked(optional(number_in(0.0, lo_open=False, hi=1.0, what="a number in [0, 1]")))] = None
    """Per-gene flip probability; None = 1/agents."""

    @model_validator(mode="after")
    def _relations(self) -> "MergeSflConfig":
        if self.max_agents is not None and self.max_agents < self.min_agents:
            raise invalid("max_agents", f"expected at least mergesfl.min_agents {self.min_agents}, got {self.max_agents}")
        return self

    def neutral(self) -> "MergeSflConfig":
        return replace(self, regulate=False, select=False)

    def check_run(self, run: "RunConfig") -> None:
        from sfl_core.method_registry import base_method
        if (self.regulate or self.select) and getattr(base_method(run.strategy), "TRAINS_WHOLE_MODEL", False):
            raise invalid("mergesfl", f"batch regulation and worker selection need split training, got strategy "
                                      f"{run.strategy!r} (the whole model on each agent)")
        if self.max_batch is not None and self.max_batch < run.batch_size:
            raise invalid("mergesfl.max_batch", f"expected at least batch_size {run.batch_size}, got {self.max_batch}")
        if self.min_batch > (self.max_batch or run.batch_size):
            raise invalid("mergesfl.min_batch", f"expected at most max_batch {self.max_batch or run.batch_size}, "
                                                f"got {self.min_batch}")
