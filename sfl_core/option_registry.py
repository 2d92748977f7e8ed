"""The training options a run config may switch on, and the config sections, assignment fields
and messages they own.

Built-in options are listed by where they live (``"module:attribute"``) and imported only when
first needed, as :mod:`sfl_core.method_registry` lists the methods: the run config, the wire
protocol and the agent read what an option declares without importing it at their own import
time (every option imports them, so an import the other way would be a loop). Installed
packages add theirs by name in the ``sfl_edge.options`` entry-point group, loaded on first use.
The order is the order the engine runs their hooks in.
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence, Union

from sfl_core.plugins import load_entry_points

# The run config and the wire protocol read this table, and every option reads them: the types
# handed out here are named Any, since importing them, even for a type checker, would make a
# loop (tests/test_architecture.py checks there is none).
RunConfig = Any
SplitModel = Any
RoundOption = Any
OptionSection = Any
AssignField = Any

ENTRY_POINT_GROUP = "sfl_edge.options"

_OPTIONS: dict[str, Union[str, type[RoundOption]]] = {
    "drift": "sfl_core.options.drift.option:Drift",
    "server_opt": "sfl_core.options.server_opt.option:ServerOpt",
    "norm_stats": "sfl_core.options.norm_stats.option:NormStats",
    "model_ema": "sfl_core.options.model_ema.option:ModelEma",
    "lr_anneal": "sfl_core.options.lr_anneal.option:LrAnneal",
    "loss": "sfl_core.options.calibrated_loss.option:CalibratedLoss",
    "robust": "sfl_core.options.robust.option:Robust",
}
"""YAML key of the option's section -> its class."""
_SECTIONS: dict[str, Union[str, type[OptionSection]]] = {
    "drift": "sfl_core.options.drift.config:DriftConfig",
    "server_opt": "sfl_core.options.server_opt.config:ServerOptConfig",
    "norm_stats": "sfl_core.options.norm_stats.config:NormStatsConfig",
    "model_ema": "sfl_core.options.model_ema.config:ModelEmaConfig",
    "lr_anneal": "sfl_core.options.lr_anneal.config:LrAnnealConfig",
    "loss": "sfl_core.options.calibrated_loss.config:LossConfig",
    "robust": "sfl_core.options.robust.config:RobustConfig",
}
"""YAML key -> the option's section class (a section module imports only the config's building
blocks, so the run config may load it while it is itself being read)."""


def _resolve(ref: Union[str, Any]) -> Any:
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def register_option(option: type[RoundOption]) -> None:
    """Make a run config accept ``option.SECTION.KEY:`` and the engine run ``option`` where it is
    :meth:`~sfl_core.options.base.RoundOption.wanted`. Register it before any run config is read."""
    key = option.SECTION.KEY
    if not key or not key.isidentifier():
        raise ValueError(f"an option's config section needs KEY, a YAML key, got {key!r}")
    _OPTIONS[key] = option
    _SECTIONS[key] = option.SECTION


def unregister_option(key: str) -> None:
    """Forget a registered option (tests, and plugins that replace one)."""
    _OPTIONS.pop(key, None)
    _SECTIONS.pop(key, None)


def _load_plugins() -> None:
    load_entry_points(ENTRY_POINT_GROUP, lambda _name, option: register_option(option), _OPTIONS, "option")


def sections() -> dict[str, type[OptionSection]]:
    """Every option's config section by YAML key."""
    _load_plugins()
    for key, ref in list(_SECTIONS.items()):
        _SECTIONS[key] = _resolve(ref)
    return dict(_SECTIONS)   # type: ignore[arg-type]


def option_classes() -> list[type[RoundOption]]:
    """Every registered option, in hook order."""
    _load_plugins()
    for key, ref in list(_OPTIONS.items()):
        _OPTIONS[key] = _resolve(ref)
    return list(_OPTIONS.values())   # type: ignore[arg-type]


def wanted(cfg: RunConfig) -> list[type[RoundOption]]:
    """The options ``cfg`` switches on."""
    return [o for o in option_classes() if o.wanted(cfg)]


def build_options(cfg: RunConfig, model: SplitModel, keep: Sequence[RoundOption] = ()) -> list[RoundOption]:
    """The run's options (the engine holds them for the run); an option of ``keep`` whose
    section ``cfg`` leaves as it was is kept, its state with it (the run's decisions changed)."""
    kept = {type(o): o for o in keep}
    return [kept[o] if o in kept and kept[o].section == o.settings(cfg) else o(cfg, model) for o in wanted(cfg)]


def left_to_auto(cfg: RunConfig) -> list[type[RoundOption]]:
    """The options ``cfg`` leaves to ``strategy: auto`` (their section says ``auto``)."""
    return [o for o in option_classes() if o.left_to_auto(cfg)]


def assign_fields() -> dict[str, AssignField]:
    """Every field an option may add to an assignment, by wire name."""
    out: dict[str, AssignField] = {}
    for o in option_classes():
        for name, f in o.ASSIGN_FIELDS.items():
            if name in out:
                raise ValueError(f"two options declare the assignment field {name!r}")
            out[name] = f
    return out


def messages() -> dict[str, tuple[str, dict[str, Any]]]:
    """Message types the options own: ``type -> (direction, {field: type})``, direction
    ``"coordinator"`` (to an agent) or ``"agent"``."""
    return {t: (direction, dict(fields)) for o in option_classes() for t, (direction, fields) in o.MESSAGES.items()}


def run_info_keys() -> list[str]:
    """The keys the options may add to the run description."""
    return [k for o in option_classes() for k in o.RUN_INFO]


def delivered_weights(model: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The weights a run delivers from its checkpoint: the model's (``model``), as each option
    would replace them from its own checkpointed state (``own``: the ``@`` tensors); an option
    the run did not use finds none of its state and changes nothing."""
    for option in option_classes():
        model = option.delivered_from_checkpoint(model, own)
    return model
