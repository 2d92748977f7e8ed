"""Split-learning methods behind one seam (:class:`Method`); the round engine runs any of them.

A run's method is its ``strategy`` (the base: where the model is cut) plus the layers its
config asks for::

    strategy: fedavg | sfl | s2fl        ->  FedAvg, SFL (FedFC with profile_splits), S2FL
    strategy: auto                       ->  the joint planner (split, codec, batch per agent)
    hetero: {width / codecs}             ->  + HeteroSFL (per-group widths and codecs)
    mergesfl: {select / regulate}        ->  + MergeSFL (selection and batch sizes)

A new method is one module: a :class:`Method` subclass (or a :class:`Layer`), registered with
:func:`register_method` (or :func:`register_layer`); the engine needs no change.
"""

from __future__ import annotations

from typing import Callable, Mapping

from sfl_core.accounting import SplitCost
from sfl_core.config import RunConfig
from sfl_core.methods.auto import Auto
from sfl_core.methods.base import AgentRound, Layer, Method, RoundPlan
from sfl_core.methods.fedavg import FedAvg
from sfl_core.methods.fedfc import FedFC
from sfl_core.methods.heterosfl import HeteroSFL
from sfl_core.methods.mergesfl import MergeSFL
from sfl_core.methods.s2fl import S2FL
from sfl_core.methods.sfl import SFL
from sfl_core.models import SplitModel
from sfl_core.plugins import load_entry_points

__all__ = ["AgentRound", "Layer", "Method", "RoundPlan", "build_method", "register_layer", "register_method", "strategies",
           "Auto", "FedAvg", "FedFC", "HeteroSFL", "MergeSFL", "S2FL", "SFL"]

ENTRY_POINT_GROUP = "sfl_edge.methods"
MethodFactory = Callable[[RunConfig, SplitModel, Mapping[int, SplitCost]], Method]

_BASES: dict[str, MethodFactory] = {
    "sfl": lambda cfg, model, costs: (FedFC if cfg.profile_splits else SFL)(cfg, model, costs),
    "fedavg": FedAvg,
    "s2fl": S2FL,
    "auto": Auto,
}
_LAYERS: list[type[Layer]] = [HeteroSFL, MergeSFL]
"""Applied in this order, innermost first: MergeSFL's selection sees HeteroSFL's plan underneath."""


def register_method(strategy: str, factory: MethodFactory) -> None:
    """Make ``strategy: <name>`` in a run config build ``factory(cfg, model, costs)``."""
    _BASES[strategy] = factory


def strategies() -> tuple[str, ...]:
    """The names ``strategy:`` accepts: the built-in methods first, then registered ones
    (including those installed packages declare in the ``sfl_edge.methods`` entry-point group)."""
    load_entry_points(ENTRY_POINT_GROUP, register_method, _BASES, "method")
    return tuple(_BASES)


def register_layer(layer: type[Layer]) -> None:
    """Apply ``layer`` to every run whose config it :meth:`~Layer.wanted` (after the built-in layers)."""
    if layer not in _LAYERS:
        _LAYERS.append(layer)


def build_method(cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]) -> Method:
    """The run's method: its strategy's base, wrapped in every layer its config asks for."""
    if cfg.strategy not in strategies():
        raise ValueError(f"strategy {cfg.strategy!r}: no such method; known: {sorted(_BASES)}")
    method = _BASES[cfg.strategy](cfg, model, costs)
    for layer in _LAYERS:
        if layer.wanted(cfg):
            method = layer(method)
    return method
