"""A user's own model: from a Python file installed on each side, or a layer list in the run config.

Two ways besides the ``register_model`` plugin (docs/models.md, "Your own model"):

- ``model: my_models.py:build_net`` — a function in a file the operator installs on the
  coordinator *and* on every device. Each side imports its own copy; the code never travels
  over MQTT. The run description names only the file's base name and the function, and an
  agent imports a file only if it was given that file locally (``sfl-agent start
  --model-file my_models.py``). The function is called as ``build_net(input_shape,
  num_classes)`` and returns an ``nn.Sequential`` (each child a block), a module listing its
  ``blocks``, or a :class:`~sfl_core.model.zoo.SplitModel`.
- ``model: {layers: [...]}`` — a declarative list of layers from an allow-list, validated like
  any config field. It is data, not code, so it *does* travel in the run description and a
  device needs nothing of the user's. Each entry is one block (every block boundary is a
  candidate split); an entry that is a list of layers is one block of several layers.

Both are registered in the model zoo under a name (the function's name; ``layers-<digest>``
for a layer list), so FLOPs, activation bytes, ``plan``, ``models``, ``auto`` and ONNX export
work on them as on the built-in models. Either side checks the other's build with an
architecture fingerprint (:mod:`sfl_core.model.fingerprint`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from torch import nn

from sfl_core.model.zoo import MODEL_NAMES, register_model

__all__ = ["FILE_REF", "LAYERS", "build_layers", "describe_source", "layers_name", "layers_of", "model_source",
           "normalise_layers", "register_described", "register_file_model", "register_layers", "resolve_agent_model",
           "user_model_fields"]

FILE_REF = re.compile(r"^(?P<path>[^:]+\.py):(?P<func>[A-Za-z_][A-Za-z0-9_]*)(?::(?P<opts>.*))?$")
"""``FILE.py:FUNCTION[:options]`` in a run config's ``model``."""

_SOURCES: dict[str, tuple[str, str]] = {}
"""Model name -> (absolute file path, function) for models registered from files."""

_LAYER_SPECS: dict[str, Any] = {}
"""Model name -> the layer list it was registered from."""

MAX_LAYERS = 256


# --------------------------------------------------------------------------- files


def _import_file(path: Path) -> Any:
    """Import ``path`` as a module of its own (a unique name per file, so two files named alike
    do not shadow each other). ValueError in one line when it fails."""
    if not path.is_file():
        raise ValueError(f"{path}: no such model file")
    name = "sfl_user_model_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: any error is one line naming the file
        raise ValueError(f"{path}: importing it failed: {type(exc).__name__}: {exc}") from None
    sys.modules[name] = module
    return module


def register_file_model(path: str | Path, func: str) -> str:
    """Import ``func`` from the file at ``path`` and register it as the model ``func`` (lower-cased);
    the name it is registered under is returned. A zoo model's name is refused."""
    path = Path(path).resolve()
    name = func.lower()
    if name in MODEL_NAMES:
        raise ValueError(f"{path}:{func}: {name!r} is a built-in model's name; rename the function")
    builder = getattr(_import_file(path), func, None)
    if not callable(builder):
        raise ValueError(f"{path}: has no function {func!r}")

    def build(input_shape: tuple[int, ...], num_classes: int, *, width: float = 1.0, norm: str = "none") -> nn.Module:
        try:
            module = builder(tuple(input_shape), int(num_classes))
        except Exception as exc:  # the user's code
            raise ValueError(f"{path}:{func}({tuple(input_shape)}, {num_classes}) failed: "
                             f"{type(exc).__name__}: {exc}") from None
        return module

    register_model(name, build, norms=False, replace=True)  # type: ignore[arg-type]  # the zoo cuts a plain module
    _SOURCES[name] = (str(path), func)
    return name


def model_source(name: str) -> Optional[tuple[str, str]]:
    """(file, function) a model was registered from, or None for any other model."""
    return _SOURCES.get(name.partition(":")[0])


def resolve_agent_model(model_file: str, func: str, local_files: Sequence[str | Path]) -> str:
    """On a device: register the run's file model from the device's *own* copy (one of
    ``local_files``, matched by base name); ValueError naming what to install otherwise."""
    for f in local_files:
        if Path(f).name == model_file:
            return register_file_model(f, func)
    given = ", ".join(str(f) for f in local_files) or "none"
    raise ValueError(f"this run trains {model_file}:{func}: install {model_file} on this device and pass "
                     f"--model-file PATH (model files given: {given})")


def user_model_fields(model: str) -> dict[str, Any]:
    """What a run description says about a user's model so that agents can build it: the file's
    base name and function (agents use their own copy), or the layer list; {} for other models."""
    src = model_source(model)
    if src is not None:
        return {"model_file": Path(src[0]).name, "model_function": src[1]}
    layers = layers_of(model)
    return {"model_layers": layers} if layers is not None else {}


def register_described(info: dict[str, Any]) -> None:
    """Register the user's model a checkpoint's ``model_info`` describes (``sfl-coord export``
    in a new process): its file (on this machine) or its layer list."""
    source = info.get("source")
    if isinstance(source, dict) and {"file", "function"} <= set(source):
        register_file_model(source["file"], source["function"])
    elif info.get("layers") is not None:
        register_layers(info["layers"])


def describe_source(model: str) -> dict[str, Any]:
    """The ``model_info`` entries :func:`register_described` reads back."""
    src = model_source(model)
    if src is not None:
        return {"source": {"file": src[0], "function": src[1]}}
    layers = layers_of(model)
    return {"layers": layers} if layers is not None else {}


# --------------------------------------------------------------------------- layer lists

LAYERS: dict[str, dict[str, Any]] = {
    # name: {option: default (None = required)}
    "conv": {"out": None, "kernel": 3, "stride": 1, "padding": "same"},
    "conv1d": {"out": None, "kernel": 3, "stride": 1, "padding": "same"},
    "linear": {"out": "classes"},
    "batchnorm": {},
    "groupnorm": {"groups": 8},
    "layernorm": {},
    "relu": {}, "gelu": {}, "tanh": {}, "sigmoid": {}, "leakyrelu": {"slope": 0.01},
    "maxpool": {"size": 2}, "avgpool": {"size": 2}, "globalavgpool": {},
    "dropout": {"p": 0.5},
    "flatten": {},
}
"""The layers a run config may list, with their options."""


def _layer_entry(entry: Any, where: str) -> tuple[str, dict[str, Any]]:
    """``relu`` | ``{conv: 16}`` | ``{conv: {out: 16, kernel: 5}}`` -> (kind, full options)."""
    if isinstance(entry, str):
        kind, opts = entry, {}  # type: ignore[var-annotated]
    elif isinstance(entry, dict) and len(entry) == 1:
        kind, opts = next(iter(entry.items()))
        if kind not in LAYERS:
            raise ValueError(f"{where}: unknown layer {kind!r} (allowed: {', '.join(LAYERS)})")
        if opts is None:
            opts = {}
        elif not isinstance(opts, dict):
            defaults = LAYERS.get(kind, {})
            if not defaults:
                raise ValueError(f"{where}.{kind}: takes no value")
            opts = {next(iter(defaults)): opts}   # {conv: 16} = {conv: {out: 16}}
    else:
        raise ValueError(f"{where}: expected a layer name or {{layer: options}}, got {entry!r}")
    if kind not in LAYERS:
        raise ValueError(f"{where}: unknown layer {kind!r} (allowed: {', '.join(LAYERS)})")
    unknown = set(opts) - set(LAYERS[kind])
    if unknown:
        raise ValueError(f"{where}.{kind}: unknown option(s) {', '.join(sorted(unknown))} "
                         f"(options: {', '.join(LAYERS[kind]) or 'none'})")
    full = {**LAYERS[kind], **opts}
    missing = [k for k, v in full.items() if v is None]
    if missing:
        raise ValueError(f"{where}.{kind}: option(s) {', '.join(missing)} required")
    for k, v in full.items():
        if k == "padding" and v == "same":
            continue
        if k == "out" and v == "classes":
            continue
        if k == "p":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"{where}.{kind}.p: expected a number in [0, 1)")
        elif k == "slope":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{where}.{kind}.slope: expected a number >= 0")
        elif isinstance(v, bool) or not isinstance(v, int) or not (0 if k == "padding" else 1) <= v <= 65536:
            raise ValueError(f"{where}.{kind}.{k}: expected a positive integer"
                             + (" or 'same'" if k == "padding" else "") + (" or 'classes'" if k == "out" else ""))
    return kind, full


def normalise_layers(spec: Any, where: str = "model.layers") -> list[list[tuple[str, dict[str, Any]]]]:
    """Validate a layer list: a list of blocks, each a list of (kind, options)."""
    if not isinstance(spec, list) or not 2 <= len(spec) <= MAX_LAYERS:
        raise ValueError(f"{where}: expected a list of 2 to {MAX_LAYERS} blocks (layers, or lists of layers)")
    blocks = []
    for i, entry in enumerate(spec):
        items = entry if isinstance(entry, list) else [entry]
        if not items:
            raise ValueError(f"{where}[{i}]: an empty block")
        blocks.append([_layer_entry(e, f"{where}[{i}]" + (f"[{j}]" if isinstance(entry, list) else ""))
                       for j, e in enumerate(items)])
    return blocks


def layers_name(blocks: list[list[tuple[str, dict[str, Any]]]]) -> str:
    """The zoo name of a layer list: the same list gives the same name on every side."""
    return "layers-" + hashlib.sha256(json.dumps(blocks, sort_keys=True).encode()).hexdigest()[:10]


def _make(kind: str, o: dict[str, Any], shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if kind in ("conv", "conv1d"):
        conv = nn.Conv2d if kind == "conv" else nn.Conv1d
        pad = o["kernel"] // 2 if o["padding"] == "same" else o["padding"]
        return conv(shape[0], o["out"], o["kernel"], stride=o["stride"], padding=pad)
    if kind == "linear":
        return nn.Linear(shape[-1], num_classes if o["out"] == "classes" else o["out"])
    if kind == "batchnorm":
        return {1: nn.BatchNorm1d, 2: nn.BatchNorm1d, 3: nn.BatchNorm2d}[len(shape)](shape[0])
    if kind == "groupnorm":   # groups must divide the channels: else one group (LayerNorm-like)
        return nn.GroupNorm(o["groups"] if shape[0] % o["groups"] == 0 else 1, shape[0])
    if kind == "layernorm":
        return nn.LayerNorm(list(shape))
    if kind in ("maxpool", "avgpool"):
        pool = {("maxpool", 3): nn.MaxPool2d, ("avgpool", 3): nn.AvgPool2d,
                ("maxpool", 2): nn.MaxPool1d, ("avgpool", 2): nn.AvgPool1d}.get((kind, len(shape)))
        if pool is None:
            raise ValueError(f"{kind} needs feature maps, got per-sample shape {shape}")
        return pool(o["size"])
    if kind == "globalavgpool":
        return nn.AdaptiveAvgPool2d(1) if len(shape) == 3 else nn.AdaptiveAvgPool1d(1)
    if kind == "dropout":
        return nn.Dropout(o["p"])
    if kind == "leakyrelu":
        return nn.LeakyReLU(o["slope"])
    return {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "flatten": nn.Flatten}[kind]()


def build_layers(blocks: list[list[tuple[str, dict[str, Any]]]], input_shape: tuple[int, ...],
                 num_classes: int) -> nn.Sequential:
    """The ``nn.Sequential`` of a validated layer list, sizing each layer from a dry run."""
    import torch

    shape = tuple(input_shape)
    out = []
    for i, block in enumerate(blocks):
        layers = []
        for kind, o in block:
            try:
                layer = _make(kind, o, shape, num_classes)
                with torch.no_grad():
                    shape = tuple(layer.eval()(torch.zeros(2, *shape)).shape[1:])
            except (RuntimeError, ValueError, IndexError) as exc:
                raise ValueError(f"model.layers[{i}].{kind}: does not fit its input of shape {shape} "
                                 f"({str(exc).splitlines()[0]})") from None
            if any(d < 1 for d in shape):
                raise ValueError(f"model.layers[{i}].{kind}: its output would be empty ({shape})")
            layers.append(layer)
        out.append(layers[0] if len(layers) == 1 else nn.Sequential(*layers))
    if shape != (num_classes,):
        raise ValueError(f"model.layers: the last block outputs {shape}, expected ({num_classes},) class scores "
                         f"(end with flatten and linear)")
    return nn.Sequential(*out)


def register_layers(spec: Any) -> str:
    """Validate a layer list and register it; its zoo name is returned."""
    blocks = normalise_layers(spec)
    name = layers_name(blocks)

    def build(input_shape: tuple[int, ...], num_classes: int, *, width: float = 1.0, norm: str = "none"
              ) -> nn.Module:
        return build_layers(blocks, input_shape, num_classes)

    register_model(name, build, norms=False, replace=True)  # type: ignore[arg-type]  # the zoo cuts a plain module
    _LAYER_SPECS[name] = spec
    return name



def layers_of(name: str) -> Optional[Any]:
    """The layer list a ``layers-<digest>`` model was registered from (what the run description carries)."""
    return _LAYER_SPECS.get(name.partition(":")[0])

