"""ONNX to the edge: export a zoo model (or a client portion) and run it with onnxruntime.

Why ONNX: a board that only has to *use* the trained model (classify its own sensor or
camera data) should not need a torch build for its CPU — Jetson and Raspberry Pi wheels are
large and version-fragile, onnxruntime and numpy are small and everywhere. So this module
splits in two halves with different import needs:

- :func:`export_onnx` (coordinator side) imports torch and onnx *inside* the function;
- :class:`OnnxPredictor`, :func:`load_inputs` and :func:`read_sidecar` (device side) need only
  numpy, json and onnxruntime. Importing this module never imports torch, so
  ``sfl-agent predict`` runs on a board without it.

Every ``.onnx`` file gets a JSON *sidecar* (same stem, ``.json``): model name, per-sample
input shape, classes, split (``null`` = whole model), opset, torch version. It is what
lets ``predict`` validate inputs and name classes without the model code. No pickle
anywhere: ``.npy``/``.npz`` inputs are read with ``allow_pickle=False``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from sfl_core.extras import import_optional

if TYPE_CHECKING:  # type hints only: importing torch here would defeat the torch-free predict path
    from torch import nn

__all__ = ["OPSET", "INPUT_NAME", "OUTPUT_NAME", "OnnxError", "sidecar_path", "export_onnx", "read_sidecar",
           "load_inputs", "OnnxPredictor", "softmax"]

OPSET = 17
"""Opset 17: supported by every onnxruntime this package accepts (>= 1.16) and by the
TorchScript exporter of every torch in ``>=2.0,<3``; the zoo needs nothing newer."""
INPUT_NAME = "input"
OUTPUT_NAME = "output"
SIDECAR_FORMAT = "sfl-edge-onnx/1"


class OnnxError(ValueError):
    """A bad model file, sidecar or input array; the message says what was expected."""


def sidecar_path(onnx_path: str | Path) -> Path:
    """``model.onnx`` -> ``model.json``."""
    return Path(onnx_path).with_suffix(".json")


# =========================================================================== export (torch)


def export_onnx(module: "nn.Module", path: str | Path, *, input_shape: Sequence[int], model_name: str,
                num_classes: int, split: int | None = None, output_kind: str = "logits",
                class_names: Sequence[str] | None = None, opset: int = OPSET,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``module`` (a whole zoo model, or ``model.client(split)``) to ``path`` as ONNX with
    a dynamic batch axis, plus its JSON sidecar; return the sidecar's content.

    ``input_shape`` is per sample. ``output_kind`` is ``"logits"`` for a whole model (or a
    client portion that is the whole model) and ``"activations"`` for a proper client portion
    — ``predict`` refuses the latter. The module is exported in eval mode (BatchNorm uses its
    running statistics) and every submodule's training flag is restored afterwards. Uses the TorchScript
    exporter (``dynamo=False``): it needs only the ``onnx`` package and handles every zoo
    block, whereas the dynamo exporter would pull in onnxscript and is much slower here.
    """
    import torch

    # before torch's exporter, which would fail deep inside with a traceback of its own
    onnx = import_optional("onnx", "export to ONNX", OnnxError)
    path = Path(path)
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d < 1 for d in shape):
        raise OnnxError(f"input shape must be positive ints, got {tuple(input_shape)!r}")
    if output_kind not in ("logits", "activations"):
        raise OnnxError(f"output_kind must be 'logits' or 'activations', got {output_kind!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    # per-module flags, not module.train(old): a client portion is a fresh Sequential (training)
    # around blocks shared with the global model (maybe eval); restoring recursively would flip them
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        # batch 2, not 1: tracing at batch 1 could bake a size-1 batch into reshapes
        dummy = torch.zeros(2, *shape)
        with torch.no_grad():
            out_shape = tuple(int(d) for d in module(dummy).shape[1:])
        with warnings.catch_warnings():
            # the TorchScript exporter is deprecated in favour of dynamo (see the docstring for why we keep it)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*TorchScript-based ONNX export.*")
            torch.onnx.export(module, (dummy,), str(tmp), dynamo=False, opset_version=int(opset),
                              input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                              dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                              do_constant_folding=True)
    except Exception:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for m, training in modes:
            m.training = training
    onnx.checker.check_model(str(tmp))
    os.replace(tmp, path)  # never leave a half-written model where a device would pick it up
    names = [str(c) for c in class_names] if class_names is not None else [str(i) for i in range(int(num_classes))]
    if len(names) != int(num_classes):
        raise OnnxError(f"{len(names)} class names for {num_classes} classes")
    meta: dict[str, Any] = {
        "format": SIDECAR_FORMAT, "model": model_name, "input_name": INPUT_NAME, "output_name": OUTPUT_NAME,
        "input_shape": list(shape), "output_shape": list(out_shape), "output": output_kind,
        "split": None if split is None else int(split), "num_classes": int(num_classes), "classes": names,
        "opset": int(opset), "torch": str(torch.__version__), **(extra or {}),
    }
    side = sidecar_path(path)
    side_tmp = side.with_name(side.name + ".tmp")
    side_tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(side_tmp, side)
    return meta


# =========================================================================== run (numpy + onnxruntime)


def read_sidecar(onnx_path: str | Path) -> dict[str, Any] | None:
    """The sidecar of ``onnx_path``, or ``None`` when there is none (an ONNX file from elsewhere)."""
    side = sidecar_path(onnx_path)
    if not side.exists():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as exc:
        raise OnnxError(f"{side}: not a readable JSON sidecar ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("input_shape"), list):
        raise OnnxError(f"{side}: not an sfl-edge sidecar (expected an object with 'input_shape')")
    return meta


def load_labels(path: str | Path, n: int, num_classes: int) -> np.ndarray:
    """The true classes of ``n`` inputs: a ``.npy`` of integers, or the ``y`` array of a ``.npz``.

    Refuses pickle, non-integer data, a count that is not ``n`` and classes outside the model's.
    """
    path = Path(path)
    if not path.is_file():
        raise OnnxError(f"no labels file {path}")
    try:
        if path.suffix.lower() == ".npz":
            with np.load(path, allow_pickle=False) as z:
                keys = list(z.keys())
                if "y" not in keys and len(keys) != 1:
                    raise OnnxError(f"{path}: no array named 'y' (arrays: {keys})")
                arr = z["y" if "y" in keys else keys[0]]
        else:
            arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        if isinstance(exc, OnnxError):
            raise
        raise OnnxError(f"{path}: cannot read it as a numpy array without pickle ({exc})") from None
    arr = np.asarray(arr).reshape(-1) if np.ndim(arr) == 0 else np.asarray(arr)
    if arr.dtype.kind not in "iu":
        raise OnnxError(f"{path}: labels must be integers (class indices), got dtype {arr.dtype}")
    if arr.ndim != 1 or len(arr) != n:
        raise OnnxError(f"{path}: expected {n} labels (one per input row), got shape {tuple(arr.shape)}")
    if len(arr) and (arr.min() < 0 or arr.max() >= num_classes):
        raise OnnxError(f"{path}: labels must lie in 0..{num_classes - 1}, got {arr.min()}..{arr.max()}")
    return arr.astype(np.int64)


def load_inputs(path: str | Path) -> np.ndarray:
    """Read a ``.npy`` array, or the ``x`` array of a ``.npz`` (its only array if there is no ``x``).

    Refuses pickled object arrays (``allow_pickle=False``) and non-numeric data; returns float32.
    """
    path = Path(path)
    if not path.is_file():
        raise OnnxError(f"no input file {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            arr = np.load(path, allow_pickle=False)
        elif suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                keys = list(z.keys())
                if "x" in keys:
                    arr = z["x"]
                elif len(keys) == 1:
                    arr = z[keys[0]]
                else:
                    raise OnnxError(f"{path}: no array named 'x' (arrays: {keys})")
        else:
            raise OnnxError(f"{path}: inputs must be a .npy file or a .npz file with key 'x'")
    except (ValueError, OSError) as exc:
        if isinstance(exc, OnnxError):
            raise
        raise OnnxError(f"{path}: cannot read it as a numpy array without pickle ({exc})") from None
    if arr.dtype.kind not in "biuf":
        raise OnnxError(f"{path}: expected numeric data, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax, stable for large logits."""
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _resize_axis(x: np.ndarray, size: int, axis: int) -> np.ndarray:
    """Linear resampling along one axis exactly as ``torch.nn.functional.interpolate`` does with
    ``mode="bilinear", align_corners=False`` (no antialiasing): half-pixel centres, clamped at 0."""
    n = x.shape[axis]
    src = np.maximum((np.arange(size, dtype=np.float64) + 0.5) * (n / size) - 0.5, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), n - 1)
    i1 = np.minimum(i0 + 1, n - 1)
    w = (src - i0).astype(np.float32)
    shape = [1] * x.ndim
    shape[axis] = size
    w = w.reshape(shape)
    return np.take(x, i0, axis=axis) * (1 - w) + np.take(x, i1, axis=axis) * w


def preprocess_raw(x: np.ndarray, prep: dict[str, Any] | None) -> np.ndarray:
    """Raw pixels (``(N, C, H, W)``, ``(N, H, W)`` or one image) prepared the way the run
    prepared its training data, from the ``preprocessing`` record of the exported sidecar:
    scale, bilinear resize when the run resized, then per-channel standardisation."""
    if not prep or "mean" not in prep:
        raise OnnxError("the model's sidecar has no 'preprocessing' record (exported before it existed, or "
                        "not image data): prepare the inputs yourself and leave out --raw")
    mean = np.asarray(prep["mean"], dtype=np.float32)
    std = np.asarray(prep["std"], dtype=np.float32)
    raw_shape = tuple(int(d) for d in prep.get("raw_shape") or ())
    x = np.asarray(x, dtype=np.float32)
    if len(raw_shape) == 1:                        # table rows: features standardised one by one
        x = x[None] if x.shape == raw_shape else x
        if x.ndim != 2 or x.shape[1] != raw_shape[0]:
            raise OnnxError(f"raw inputs of shape {x.shape}: expected (N, {raw_shape[0]}) table rows")
        x = x / np.float32(prep.get("scale", 1.0))
        return np.ascontiguousarray((x - mean.reshape(1, -1)) / std.reshape(1, -1), dtype=np.float32)
    if raw_shape and x.shape == raw_shape[1:] and raw_shape[0] == 1:
        x = x[None, None]                          # one single-channel image
    elif raw_shape and x.shape == raw_shape:
        x = x[None]                                # one image
    elif raw_shape and x.ndim == 3 and raw_shape[0] == 1 and x.shape[1:] == raw_shape[1:]:
        x = x[:, None]                             # N single-channel images without a channel axis
    elif not raw_shape and x.ndim == 3 and len(mean) == 1:
        x = x[:, None]                             # the same, where the run resized photos of any size
    if x.ndim != 4 or x.shape[1] != len(mean):
        raise OnnxError(f"raw inputs of shape {x.shape}: expected (N, {len(mean)}, H, W) images"
                        + (f" of {raw_shape[1]}x{raw_shape[2]} pixels" if len(raw_shape) == 3 else ""))
    x = x / np.float32(prep.get("scale", 1.0))
    if prep.get("resize"):
        h, w = (int(v) for v in prep["resize"])
        x = _resize_axis(_resize_axis(x, h, 2), w, 3)
    return np.ascontiguousarray((x - mean.reshape(1, -1, 1, 1)) / std.reshape(1, -1, 1, 1), dtype=np.float32)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
IMAGE_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
"""Pillow's mode for a model's input channels (grey, RGB, RGBA)."""


def read_image(source: Any, channels: int, modes: dict[str, int] | None = None) -> np.ndarray:
    """One image as raw ``(C, H, W)`` pixels, converted to ``channels`` as torchvision's
    ``ImageFolder`` converts (``convert('RGB')``): what training reads and ``predict --raw``
    reads alike. ``source``: a path or a file object. Check ``channels`` against
    :data:`IMAGE_MODES` first; a bad file raises one of :func:`unreadable_image_errors`.
    ``modes``: counts of the files' own Pillow modes, kept where given (what was converted)."""
    from PIL import Image

    with Image.open(source) as im:
        im.load()
        if modes is not None:
            modes[im.mode] = modes.get(im.mode, 0) + 1
        arr = np.asarray(im.convert(IMAGE_MODES[channels]))
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def unreadable_image_errors() -> tuple[type[BaseException], ...]:
    """What Pillow raises for a corrupt, truncated or oversized image file."""
    from PIL import Image
    return (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def load_raw_images(path: str | Path, prep: dict[str, Any] | None, classes: Sequence[str] | None = None
                    ) -> tuple[np.ndarray, np.ndarray | None, list[str]]:
    """Photos as the model takes them: one image file, or a folder of them (searched
    recursively), each prepared with :func:`preprocess_raw`. Where every image sits in a
    folder named after one of ``classes`` (a ``val/<class>/`` layout), those are its true
    classes. Returns (inputs, true classes or None, file names)."""
    path = Path(path)
    if not prep or "mean" not in prep:
        raise OnnxError("the model's sidecar has no 'preprocessing' record: photos cannot be prepared for it")
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise OnnxError(f"{path}: no images ({', '.join(IMAGE_SUFFIXES)})")
    if len(prep["mean"]) not in IMAGE_MODES:
        raise OnnxError(f"the model takes {len(prep['mean'])}-channel inputs, not images")
    raw_shape = tuple(int(d) for d in prep.get("raw_shape") or ())
    xs = []
    for f in files:
        try:
            arr = read_image(f, len(prep["mean"]))
        except unreadable_image_errors() as exc:
            raise OnnxError(f"{f}: unreadable image ({exc})") from None
        if not prep.get("resize") and raw_shape and arr.shape != raw_shape:
            raise OnnxError(f"{f}: image is {arr.shape[2]}x{arr.shape[1]} (width x height), the model takes "
                            f"{raw_shape[2]}x{raw_shape[1]}")
        xs.append(preprocess_raw(arr[None], prep)[0])
    truth = None
    if classes is not None and path.is_dir() and all(f.parent != path and f.parent.name in classes for f in files):
        truth = np.array([list(classes).index(f.parent.name) for f in files], dtype=np.int64)
    return np.stack(xs), truth, [str(f) for f in files]


class OnnxPredictor:
    """An onnxruntime session (CPU) over an exported model, with input validation.

    The per-sample input shape comes from the sidecar, or from the ONNX input when there is
    no sidecar and all its non-batch dims are fixed.
    """

    def __init__(self, path: str | Path, *, threads: int | None = None) -> None:
        ort = import_optional("onnxruntime", "running an exported model", OnnxError)

        self.path = Path(path)
        if not self.path.is_file():
            raise OnnxError(f"no model file {self.path}")
        self.meta: dict[str, Any] = read_sidecar(self.path) or {}
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = int(threads)
        try:
            self.session = ort.InferenceSession(str(self.path), sess_options=opts,
                                                providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types for bad files
            raise OnnxError(f"{self.path}: onnxruntime cannot load it ({exc})") from None
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.output_name = self.session.get_outputs()[0].name
        onnx_dims = list(inp.shape[1:])
        if "input_shape" in self.meta:
            self.input_shape = tuple(int(d) for d in self.meta["input_shape"])
            fixed = [(i, d) for i, d in enumerate(onnx_dims) if isinstance(d, int)]
            if len(onnx_dims) != len(self.input_shape) or any(self.input_shape[i] != d for i, d in fixed):
                raise OnnxError(f"{sidecar_path(self.path)} says input shape {self.input_shape}, the ONNX model "
                                f"takes {tuple(onnx_dims)}: the sidecar belongs to another model")
        elif onnx_dims and all(isinstance(d, int) for d in onnx_dims):
            self.input_shape = tuple(onnx_dims)
        else:
            raise OnnxError(f"{self.path}: no sidecar {sidecar_path(self.path).name} and the ONNX input shape "
                            f"{tuple(inp.shape)} is not fixed; re-export it with `sfl-coord export`")

    @property
    def classes(self) -> list[str] | None:
        c = self.meta.get("classes")
        return [str(v) for v in c] if isinstance(c, list) else None

    def check(self, x: np.ndarray) -> np.ndarray:
        """``x`` as an ``(N, *input_shape)`` float32 batch; one sample (``input_shape``) becomes N = 1."""
        x = np.asarray(x, dtype=np.float32)
        if tuple(x.shape) == self.input_shape:
            x = x[None]
        if x.ndim != len(self.input_shape) + 1 or tuple(x.shape[1:]) != self.input_shape:
            raise OnnxError(f"inputs of shape {tuple(x.shape)} do not fit model {self.meta.get('model', self.path.name)}: "
                            f"expected (N, {', '.join(map(str, self.input_shape))}) or one sample "
                            f"{self.input_shape}")
        if x.shape[0] == 0:
            raise OnnxError("no input rows")
        return np.ascontiguousarray(x)

    def run(self, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """Model outputs for ``x`` (validated by :meth:`check`), ``batch_size`` rows at a time."""
        x = self.check(x)
        outs = [self.session.run([self.output_name], {self.input_name: x[i:i + batch_size]})[0]
                for i in range(0, len(x), batch_size)]
        return np.concatenate(outs, axis=0)
