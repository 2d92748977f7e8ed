"""Which method a run config's ``strategy:`` names, the layers its other keys ask for, and the
config sections the methods own.

The built-in methods are listed here by where they live (``"module:attribute"``) and imported
only when a run builds one. That keeps the run config free to check ``strategy:`` against
:func:`strategies` without importing any method (every method reads the run config, so an
import the other way would be a loop), exactly as installed plugins are found: by name in the
``sfl_edge.methods`` entry-point group, loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Union

from sfl_core.plugins import load_entry_points

# The run config reads this table, and every method reads the run config: the types handed
# out here (a RunConfig, a SplitModel, a Method) are named Any, since importing them, even for
# a type checker, would make a loop (tests/test_architecture.py checks there is none).
RunConfig = Any
SplitModel = Any
SplitCost = Any
Method = Any
Layer = Any
MethodSection = Any
MethodFactory = Callable[..., Any]

ENTRY_POINT_GROUP = "sfl_edge.methods"
DEFAULT_STRATEGY = "auto"
"""What ``strategy:`` is when a run config leaves it out: the joint planner."""

_BASES: dict[str, Union[str, MethodFactory]] = {
    "sfl": "sfl_core.methods.sfl:SFL",          # one cut for everybody, or FedFC's cut per profile
    "fedavg": "sfl_core.methods.fedavg:FedAvg",
    "s2fl": "sfl_core.methods.s2fl.method:S2FL",
    "auto": "sfl_core.methods.auto.method:Auto",
}
_LAYERS: list[Union[str, type[Layer]]] = ["sfl_core.methods.fedfc.method:FedFC",
                                            "sfl_core.methods.heterosfl.method:HeteroSFL",
                                            "sfl_core.methods.mergesfl.method:MergeSFL"]
"""Applied in this order, innermost first: FedFC's cuts under HeteroSFL's widths, and MergeSFL's
selection sees both underneath."""
_SECTIONS: dict[str, Union[str, type[MethodSection]]] = {
    "s2fl": "sfl_core.methods.s2fl.config:S2flConfig",
    "mergesfl": "sfl_core.methods.mergesfl.config:MergeSflConfig",
    "hetero": "sfl_core.methods.heterosfl.config:HeteroConfig",
    "auto": "sfl_core.methods.auto.config:AutoConfig",
    "fedfc": "sfl_core.methods.fedfc.config:FedFcConfig",
}
"""YAML key -> the method's section class (``sfl_core/methods/<method>/config.py``); a section
module imports only :mod:`sfl_core.config.fields`, ``values`` and ``section``, never the run
config, so the run config may load it while it is itself being read."""


def _resolve(ref: Union[str, Any]) -> Any:
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def register_method(strategy: str, factory: MethodFactory) -> None:
    """Make ``strategy: <name>`` in a run config build ``factory(cfg, model, costs)``."""
    _BASES[strategy] = factory


def unregister_method(strategy: str) -> None:
    """Forget a registered method (tests, and plugins that replace one)."""
    _BASES.pop(strategy, None)


def register_section(section: type[MethodSection]) -> None:
    """Make the run config accept ``section.KEY:`` and validate it with ``section`` (a plugin
    method's own settings). Register it before any run config is read."""
    if not section.KEY or not section.KEY.isidentifier():
        raise ValueError(f"a method's config section needs KEY, a YAML key, got {section.KEY!r}")
    _SECTIONS[section.KEY] = section


def unregister_section(key: str) -> None:
    """Forget a registered config section (tests)."""
    _SECTIONS.pop(key, None)


def sections() -> dict[str, type[MethodSection]]:
    """Every method config section by YAML key, built-in ones first."""
    strategies()    # an entry-point plugin registers its section when it loads
    for key, ref in list(_SECTIONS.items()):
        _SECTIONS[key] = _resolve(ref)
    return dict(_SECTIONS)   # type: ignore[arg-type]


def base_method(strategy: str) -> Any:
    """The class (or factory) ``strategy:`` names, for what a section asks of it before any run is built."""
    strategies()
    return _resolve(_BASES[strategy])


def method_classes() -> list[Any]:
    """Every registered base method and layer (classes or factories), in registration order."""
    strategies()
    return [_resolve(ref) for ref in (*_BASES.values(), *_LAYERS)]


def strategies() -> tuple[str, ...]:
    """The names ``strategy:`` accepts: the built-in methods first, then registered ones
    (including those installed packages declare in the ``sfl_edge.methods`` entry-point group)."""
    load_entry_points(ENTRY_POINT_GROUP, register_method, _BASES, "method")
    return tuple(_BASES)


def register_layer(layer: type[Layer]) -> None:
    """Apply ``layer`` to every run whose config it :meth:`~Layer.wanted` (after the built-in layers)."""
    if layer not in _LAYERS:
        _LAYERS.append(layer)


def prepare_model(cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]) -> SplitModel:
    """The run's global model as its method trains it: the base method's and each wanted
    layer's :meth:`~sfl_core.methods.base.Method.prepare_model` applied to ``model``."""
    for method in (base_method(cfg.strategy), *_wanted_layers(cfg)):
        getattr(method, "prepare_model", lambda *_: None)(cfg, model, costs)
    return model


def _wanted_layers(cfg: RunConfig) -> list[Any]:
    """The registered layers ``cfg`` asks for, innermost first."""
    return [layer for layer in map(_resolve, _LAYERS) if layer.wanted(cfg)]


def one_split_conflict(cfg: RunConfig) -> Any:
    """Why the run's method (its base or a layer it asks for) does not keep every agent at one
    fixed cut, which a bottleneck needs; None when it does."""
    for method in (base_method(cfg.strategy), *_wanted_layers(cfg)):
        conflict = getattr(method, "one_split_conflict", lambda _cfg: None)(cfg)
        if conflict:
            return conflict
    return None


def build_method(cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]) -> Method:
    """The run's method: its strategy's base, wrapped in every layer its config asks for."""
    if cfg.strategy not in strategies():
        raise ValueError(f"strategy {cfg.strategy!r}: no such method; known: {sorted(_BASES)}")
    base = base_method(cfg.strategy)
    method = base.for_run(cfg, model, costs) if hasattr(base, "for_run") else base(cfg, model, costs)
    for layer in _wanted_layers(cfg):
        method = layer(method)
    return method
