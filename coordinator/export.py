"""Rebuild a run's global model from its checkpoint, and export it (``sfl-coord export``).

A checkpoint holds tensors and JSON only (``checkpoint.pt``, loaded with
``weights_only=True``), so the architecture has to come from its run state: the
``model_info`` entry the engine writes there (:func:`describe_model`), or, for runs that
predate it, the run's config plus its data set (``--config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from coordinator import state as ckpt
from sfl_core.method_registry import prepare_model
from sfl_core.model.accounting import model_costs
from sfl_core.model.onnx_export import export_onnx
from sfl_core.model.user_models import describe_source, register_described
from sfl_core.model.zoo import SplitModel, build_model
from sfl_core.option_registry import delivered_weights
from sfl_core.options.base import split_state

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig


class ExportError(ValueError):
    """Why a run cannot be exported; the message names the file or option to fix."""


def describe_model(model: SplitModel, dataset: Optional[str] = None,
                   preprocessing: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """What it takes, besides the tensors, to rebuild ``model`` (JSON-ready): name, per-sample
    input shape, classes, and its HeteroSFL bottlenecks with the width the full model runs at;
    and how raw inputs were prepared (``Dataset.preprocessing``), so a device can do the same."""
    return {
        "name": model.name, "input_shape": list(model.input_shape), "num_classes": model.num_classes,
        "dataset": dataset, "preprocessing": preprocessing or None,
        "classes": (preprocessing or {}).get("classes"),
        **describe_source(model.name),
        "bottlenecks": [{"split": int(s), "width": int(p.width),  # type: ignore[arg-type]  # Bottleneck
                         "infer_width": int(p.infer_width)}  # type: ignore[arg-type]
                        for s, p in model.bottlenecks.items()],
    }


def run_model(cfg: "RunConfig", input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """The (untrained) global model of a run: the zoo model, plus what the run's method trains
    beyond it (a bottleneck at the cut: :func:`~sfl_core.method_registry.prepare_model`)."""
    model = build_model(cfg.model, input_shape, num_classes)
    return prepare_model(cfg, model, model_costs(cfg.model, input_shape, num_classes))


def rebuild_model(info: dict[str, Any]) -> SplitModel:
    """The untrained model :func:`describe_model` described (load the checkpoint into it)."""
    register_described(info)   # a user's model: its file on this machine, or its layer list
    model = build_model(info["name"], info["input_shape"], int(info["num_classes"]))
    for b in info.get("bottlenecks") or []:
        model.add_bottleneck(int(b["split"]), int(b["width"]))
    restore_widths(model, info)
    return model


def restore_widths(model: SplitModel, info: dict[str, Any]) -> None:
    """Each bottleneck of ``model`` at the width the described run's full model ran it
    (``infer_width``: the widest trained so far), within the pair's width."""
    for b in info.get("bottlenecks") or []:
        pair = model.bottleneck(int(b["split"]))
        if pair is not None:
            pair.infer_width = min(pair.width, max(1, int(b.get("infer_width", b["width"]))))


def _info_from_config(config: Path) -> dict[str, Any]:
    """For runs whose state.json has no ``model_info``: the shapes from the config's data set."""
    from sfl_core.config.run import ConfigError, load_run_config
    from sfl_core.data.builtin import DatasetError, load_dataset

    try:
        cfg = load_run_config(config)
        data = load_dataset(cfg.data.dataset, cfg.data.root, cfg.data.image_size)
    except (ConfigError, DatasetError) as exc:
        raise ExportError(str(exc)) from None
    return describe_model(run_model(cfg, data.input_shape, data.num_classes), cfg.data.dataset, data.preprocessing)


def load_global_model(run_dir: Path, config: Optional[Path] = None) -> tuple[SplitModel, dict[str, Any]]:
    """The run's global model with its checkpointed weights, in eval mode, and its run state."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"no run directory {run_dir}")
    try:
        weights, st = ckpt.load(run_dir)
        weights = delivered_weights(*split_state(weights))   # e.g. the average over rounds, where the run kept one
    except ckpt.CheckpointError as exc:   # missing, torn, corrupted, foreign: one line naming the file
        raise ExportError(str(exc)) from None
    info = st.get("model_info")
    if info is None:
        if config is None:
            raise ExportError(f"{run_dir / ckpt.MODEL_FILE} has no model_info (the run predates it): "
                              "pass the run's config with --config run.yaml")
        info = _info_from_config(config)
    if st.get("model") not in (None, info["name"]):
        raise ExportError(f"checkpoint in {run_dir} is for model {st.get('model')!r}, not {info['name']!r}")
    try:
        model = rebuild_model(info)
        model.load_state_dict(weights)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ExportError(f"{run_dir / ckpt.MODEL_FILE} does not fit model {info.get('name')!r}: {exc}") from None
    return model.eval(), {**st, "model_info": info}


def export_run(run_dir: Path, out: Path, split: Optional[int] = None,
               config: Optional[Path] = None) -> dict[str, Any]:
    """Export the run's global model (``split=None``) or its client portion ``blocks[:split]``
    (with the encoder of a bottleneck at ``split``) to ``out``; return the sidecar."""
    model, st = load_global_model(run_dir, config)
    module: Any = model   # the whole model, or its client portion
    if split is not None:
        try:
            model.check_split(split)
        except ValueError as exc:
            raise ExportError(str(exc)) from None
        module = model.client(split)
    whole = split is None or split == model.num_blocks
    info = st.get("model_info") or {}
    extra = {"run": st.get("run"), "round": st.get("round"), "dataset": info.get("dataset"),
             "preprocessing": info.get("preprocessing"), "num_blocks": model.num_blocks}
    pair = model.bottleneck(split) if split is not None else None
    if pair is not None:
        extra["bottleneck_width"] = pair.width
    return export_onnx(module, out, input_shape=model.input_shape, model_name=model.name,
                       num_classes=model.num_classes, split=split, class_names=info.get("classes"), output_kind="logits" if whole else "activations",
                       extra=extra)
