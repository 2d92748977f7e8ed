"""The run's model as this device builds it: one function for ``sfl-agent start`` and
``sfl-agent check-data``, so the check says exactly what the start will do.

A user's model reaches a device two ways (:mod:`sfl_core.model.user_models`): a layer list
that travels in the run description, or ``FILE.py:FUNCTION`` of which the device imports its
*own* copy (``--model-file``), never code sent to it. Where the coordinator described its
build (a tensor-by-tensor fingerprint), the device's build must match it before it registers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from sfl_core.config.fields import read_yaml
from sfl_core.config.run import RunConfig, load_run_config, run_config_from_dict
from sfl_core.model.fingerprint import architecture, first_difference
from sfl_core.model.user_models import FILE_REF, register_layers, resolve_agent_model, user_model_fields
from sfl_core.model.zoo import build_model

__all__ = ["device_model", "run_config_for_device"]


def device_model(body: Mapping[str, Any], model_files: Sequence[str]) -> list[str]:
    """Register the run's model from what this device holds, build it, and return its
    architecture lines. ``body``: a run description's ``model``, ``input_shape``,
    ``num_classes`` and, where they apply, ``model_layers``, ``model_file``/``model_function``
    and ``architecture`` (the coordinator's build). ValueError, in one line, when the device
    cannot build the run's model or builds another one."""
    if "model_layers" in body:
        name = register_layers(body["model_layers"])
        if name != str(body["model"]).partition(":")[0]:
            raise ValueError(f"the run's layer list is registered here as {name}, the run calls it {body['model']}")
    elif "model_file" in body:
        if "model_function" not in body:
            raise ValueError("run description: model_file without model_function")
        resolve_agent_model(body["model_file"], body["model_function"], model_files)
    try:
        ours = architecture(build_model(body["model"], tuple(body["input_shape"]), body["num_classes"]))
    except ValueError as exc:
        raise ValueError(f"cannot build the run's model here: {exc}") from None
    theirs = body.get("architecture")
    diff = first_difference([str(x) for x in theirs], ours) if theirs is not None else ""
    if diff:
        raise ValueError(f"this device's model {body['model']!r} is not the run's ({diff}): install the same "
                         f"model code here")
    return ours


def run_config_for_device(path: Path, model_files: Sequence[str]) -> tuple[RunConfig, dict[str, Any]]:
    """A run config read as this device sees the run (``sfl-agent check-data``): its model's file
    resolved to the device's own copy (``model_files``, by base name) exactly as ``start`` does,
    and the run-description fields :func:`device_model` checks, the coordinator's build
    included when its model file sits beside the run config (elsewhere it cannot be known
    here). A config without a fleet is fine: the check is about this device. ConfigError or
    ValueError in one line."""
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        return load_run_config(path), {}          # the loader's own one-line error
    if not raw.get("fleet") and raw.get("min_agents") is None:
        raw = {**raw, "min_agents": 1}            # the fleet is the coordinator's business
    model = raw.get("model")
    ref = FILE_REF.match(model.strip()) if isinstance(model, str) else None
    if ref is None:
        cfg = run_config_from_dict(raw, str(path), base_dir=path.parent)
        return cfg, {"model": cfg.model, **user_model_fields(cfg.model)}
    assert isinstance(model, str)   # ref matched it
    name, rest = Path(ref["path"]).name, model.strip()[len(ref["path"]):]
    theirs = None
    coordinator_file = path.parent / ref["path"]
    if coordinator_file.is_file():                # the coordinator's build, as the run will describe it
        coordinator = run_config_from_dict(raw, str(path), base_dir=path.parent)
        if coordinator.task is not None:
            theirs = architecture(build_model(coordinator.model, tuple(coordinator.task.input_shape),
                                              coordinator.task.num_classes))
    mine = next((Path(f) for f in model_files if Path(f).name == name), None)
    if mine is None:
        resolve_agent_model(name, ref["func"], model_files)      # raises: what to install, and how
        raise AssertionError("unreachable")
    cfg = run_config_from_dict({**raw, "model": str(mine.resolve()) + rest}, str(path), base_dir=path.parent)
    body = {"model": cfg.model, "model_file": name, "model_function": ref["func"]}
    if theirs is not None:
        body["architecture"] = theirs
    return cfg, body
