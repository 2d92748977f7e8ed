"""What a run is built from, each built once: the global model, its cost table, the method and
the architecture the devices' own builds must match.

The CLI builds these while it checks a run config (settings only the model can judge: a cut the
model lacks, a bottleneck wider than the cut, which must exit 2 before anything starts) and
hands them to the engine; a run started from Python has the engine build them. Either way the
torch generator is seeded with the run's ``seed`` before the model's weights are drawn, and the
engine continues the stream from where the build left it (``rng_state``), so a run draws the
same numbers wherever its parts were built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from sfl_core.config.run import RunConfig
from sfl_core.method_registry import prepare_model
from sfl_core.methods import build_method
from sfl_core.model.accounting import SplitCost, model_costs
from sfl_core.model.fingerprint import architecture, fingerprinted
from sfl_core.model.zoo import SplitModel, build_model


@dataclass
class RunParts:
    model: SplitModel
    """The global model as the method trains it (the zoo model plus the method's bottleneck)."""
    costs: dict[int, SplitCost]
    method: Any
    """The run's method (``sfl_core.methods.base.Method``), its layers applied."""
    architecture: Optional[list[str]]
    """What every agent's own build of the model must match, where devices build it from their
    own installed code (:func:`~sfl_core.model.fingerprint.fingerprinted`); None otherwise."""
    rng_state: torch.Tensor
    """The torch generator's state once the model and the method were built."""


def build_parts(cfg: RunConfig, input_shape: tuple[int, ...], num_classes: int) -> RunParts:
    """The run's parts. Raises ``ValueError`` (one line) for a setting the model refuses."""
    torch.manual_seed(cfg.seed)
    bare = build_model(cfg.model, input_shape, num_classes)   # the model each device builds itself
    fingerprint = architecture(bare) if fingerprinted(cfg) else None
    costs = model_costs(cfg.model, input_shape, num_classes)
    model = prepare_model(cfg, bare, costs)
    method = build_method(cfg, model, costs)
    rng_state = torch.get_rng_state()
    for s in ([cfg.split] if cfg.split is not None else []) + list(method.configured_splits):
        model.check_split(s)
    return RunParts(model, costs, method, fingerprint, rng_state)
