"""A device's own data, in the formats people keep it in, read under the run's task contract.

``load_local(path, task)`` looks at what ``path`` is and reads it:

- an image folder in the ImageFolder layout: ``path/<class>/*`` or ``path/train/<class>/*``
  with an optional ``path/val/`` (or ``test/``) beside it as the held-out split; PNG, JPEG,
  BMP, GIF, WebP, TIFF read with Pillow;
- arrays: an ``.npz`` with ``x``/``y`` (optional ``x_val``/``y_val``), or a folder holding
  ``x.npy`` and ``y.npy`` (optional ``x_val.npy``/``y_val.npy``); read without pickle;
- a table: ``.csv``, ``.parquet`` or Arrow (``.arrow``/``.feather``), or a folder holding
  ``train.<ext>`` and optionally ``val.<ext>``/``test.<ext>``: feature columns plus the
  label column the task names (``task.label_column``);
- Hugging Face ``datasets``: a folder written by ``save_to_disk``, or ``hf:BUILDER:PATH``
  for a ``load_dataset`` builder such as ``hf:imagefolder:photos`` or ``hf:csv:log.csv``
  (the optional extra ``sfl-edge[datasets]``).

Why labels are mapped by name: a device that lacks a class folder would otherwise shift
every later label by one (sorted folder names), silently. Here class folders and label
values are the task's class *names*; integer labels in arrays are indices into that list.
A class a device does not have is fine (its label counts say so); a name the run does not
know is an error naming the folder or file.

What is returned is *scaled* (``raw / task.scale``) and resized only if the task says so;
standardisation comes later, with constants the whole fleet agrees on
(:mod:`sfl_core.data.preprocessing`). Errors are :class:`~sfl_core.data.builtin.DatasetError` with one
line naming the file and what was expected; an unreadable file is skipped and counted
(``bad_files="skip"``) or fatal (``"fail"``).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from sfl_core.config.run import TaskConfig
from sfl_core.data.builtin import DatasetError

# one image reader for training and for predict (torch-free there)
from sfl_core.model.onnx_export import IMAGE_MODES, IMAGE_SUFFIXES, read_image, unreadable_image_errors

__all__ = ["DeviceData", "Split", "IMAGE_SUFFIXES", "TABLE_SUFFIXES", "load_local", "describe_kind", "survey"]

TABLE_SUFFIXES = (".csv", ".parquet", ".arrow", ".feather")
_VAL_NAMES = ("val", "validation", "test")
MAX_NAMED = 5
"""Skipped files named in messages (the rest are counted)."""


@dataclass
class Split:
    """Samples ready for standardisation: ``x`` float32 ``(N, *input_shape)`` (scaled, resized
    if the task resizes), ``y`` int64 indices into the task's classes."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def label_counts(self, num_classes: int) -> list[int]:
        return torch.bincount(self.y, minlength=num_classes).tolist()


@dataclass
class DeviceData:
    """What a device holds: its training split, an optional held-out split, and what was skipped."""

    path: str
    kind: str
    train: Split
    val: Optional[Split] = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was done to readable files (images converted to the run's channels, resized)."""

    def summary(self, task: TaskConfig) -> dict[str, Any]:
        """JSON-ready: what ``check-data`` prints and the agent logs at start."""
        return {"path": self.path, "kind": self.kind, "input_shape": list(self.train.x.shape[1:]),
                "train": dict(zip(task.classes, self.train.label_counts(task.num_classes))),
                "train_samples": len(self.train),
                "val": dict(zip(task.classes, self.val.label_counts(task.num_classes))) if self.val else None,
                "val_samples": len(self.val) if self.val else 0,
                "skipped": len(self.skipped), "skipped_files": [f"{p}: {why}" for p, why in self.skipped[:MAX_NAMED]],
                "notes": list(self.notes)}


class _Skips:
    """Collects unreadable files (with ``fail`` the first one ends the load), and what was done
    to the readable ones silently otherwise: images of another mode converted, images resized."""

    def __init__(self, bad_files: str):
        self.fail = bad_files == "fail"
        self.items: list[tuple[str, str]] = []
        self.modes: dict[str, int] = {}
        self.resized: dict[tuple[int, int], int] = {}

    def notes(self, task: TaskConfig) -> list[str]:
        """One phrase per kind of change, for the device's one line (check-data and start)."""
        out = []
        target = IMAGE_MODES.get(task.input_shape[0]) if task.input_shape else None
        converted = {m: n for m, n in self.modes.items() if m != target}
        if converted and target is not None:
            out.append(f"converted to {target}: " + ", ".join(f"{n} {m} image(s)" for m, n in sorted(converted.items())))
        if self.resized:
            sizes = ", ".join(f"{n} of {w}x{h}" for (w, h), n in sorted(self.resized.items()))
            out.append(f"resized to {task.input_shape[2]}x{task.input_shape[1]} (task.resize): {sizes}")
        return out

    def __call__(self, where: str, why: str) -> None:
        if self.fail:
            raise DatasetError(f"{where}: {why} (data.bad_files: fail; 'skip' skips such files)")
        self.items.append((where, why))


# --------------------------------------------------------------------------- entry


def describe_kind(path: str | Path) -> str:
    """Which reader ``load_local`` picks for ``path`` (without reading the data)."""
    text = str(path)
    if text.startswith("hf:"):
        return "huggingface"
    p = Path(text).expanduser()
    if not p.exists():
        raise DatasetError(f"{p}: no such file or directory (expected the device's data)")
    if p.is_file():
        if p.suffix.lower() == ".npz":
            return "arrays"
        if p.suffix.lower() in TABLE_SUFFIXES:
            return "table"
        if p.suffix.lower() == ".npy":
            raise DatasetError(f"{p}: give the folder holding x.npy and y.npy, not one .npy file")
        raise DatasetError(f"{p}: not a data file this agent reads (expected a folder, .npz, "
                           f"{', '.join(TABLE_SUFFIXES)})")
    if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
        return "huggingface"
    if (p / "x.npy").is_file():
        return "arrays"
    if any((p / f"train{s}").is_file() for s in TABLE_SUFFIXES):
        return "table"
    return "images"


def load_local(path: str | Path, task: TaskConfig, bad_files: str = "skip") -> DeviceData:
    """Read the device data at ``path`` under ``task`` (see the module docstring)."""
    kind = describe_kind(path)
    skips = _Skips(bad_files)
    readers: dict[str, Callable[..., tuple[Split, Optional[Split]]]] = {
        "images": _image_folder, "arrays": _arrays, "table": _tables, "huggingface": _huggingface}
    reader = readers[kind]
    train, val = reader(Path(str(path)).expanduser() if kind != "huggingface" else str(path), task, skips)
    if len(train) == 0:   # one line an operator reads: the count and the first file, not all of them
        first = f"{skips.items[0][0]}: {skips.items[0][1]}" if skips.items else ""
        raise DatasetError(f"{path}: no usable training sample" + (f" ({len(skips.items)} skipped, the first {first})"
                                                                    if first else ""))
    return DeviceData(str(path), kind, train, val, skips.items, skips.notes(task))


def survey(path: str | Path, limit: int = 200) -> dict[str, Any]:
    """What ``path`` holds, without a task to read it under (``sfl-agent check-data`` without a
    run config): the reader it takes and a few lines on classes, shapes and sizes."""
    kind = describe_kind(path)
    lines: list[str] = []
    p = Path(str(path)).expanduser()
    if kind == "images":
        from PIL import Image
        for split_dir in ([p / "train"] + [p / n for n in _VAL_NAMES]) if (p / "train").is_dir() else [p]:
            if not split_dir.is_dir():
                continue
            sizes: dict[str, int] = {}
            counts = {}
            for d in sorted(x for x in split_dir.iterdir() if x.is_dir() and not x.name.startswith(".")):
                files = [f for f in sorted(d.rglob("*")) if f.is_file() and not f.name.startswith(".")]
                counts[d.name] = len(files)
                for f in files[:max(1, limit // 10)]:
                    try:
                        with Image.open(f) as im:
                            key = f"{im.size[0]}x{im.size[1]} {im.mode}"
                    except (OSError, ValueError, SyntaxError):
                        key = "unreadable"
                    sizes[key] = sizes.get(key, 0) + 1
            lines.append(f"{split_dir.name}/: " + ", ".join(f"{c} {n}" for c, n in counts.items())
                         + f" (files per class folder; sampled sizes: {', '.join(f'{k} x{v}' for k, v in sizes.items())})")
    elif kind == "arrays":
        arrays = {}
        if p.is_file():
            with np.load(p, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        else:
            arrays = {f.stem: np.load(f, allow_pickle=False, mmap_mode="r") for f in sorted(p.glob("*.npy"))}
        for k, a in arrays.items():
            extra = ""
            if k.startswith("y") and a.ndim == 1:
                values, n = np.unique(np.asarray(a), return_counts=True)
                extra = "; labels " + ", ".join(f"{v} {c}" for v, c in list(zip(values.tolist(), n.tolist()))[:20])
            lines.append(f"{k}: shape {tuple(a.shape)} dtype {a.dtype}{extra}")
    elif kind == "table":
        files = [p] if p.is_file() else [f for f in sorted(p.iterdir()) if f.suffix.lower() in TABLE_SUFFIXES]
        for f in files:
            cols = _read_csv(f) if f.suffix.lower() == ".csv" else _read_arrow(f)
            rows = len(next(iter(cols.values()))) if cols else 0
            lines.append(f"{f.name}: {rows} rows, columns {', '.join(cols)}")
    else:
        lines.append("a Hugging Face data set: give --run-config to read it (its label column comes from the task)")
    return {"kind": kind, "lines": lines}


# --------------------------------------------------------------------------- image folders


def _class_index(task: TaskConfig, name: str, where: Path | str) -> int:
    try:
        return task.classes.index(name)
    except ValueError:
        raise DatasetError(f"{where}: class {name!r} is not one of the run's classes "
                           f"({', '.join(task.classes)})") from None


def _image_folder(root: Path, task: TaskConfig, skips: _Skips) -> tuple[Split, Optional[Split]]:
    if len(task.input_shape) != 3:
        raise DatasetError(f"{root}: an image folder, but the run's input_shape {list(task.input_shape)} is not "
                           f"[channels, height, width]")
    train_dir = root / "train" if (root / "train").is_dir() else root
    val_dir = next((root / n for n in _VAL_NAMES if train_dir != root and (root / n).is_dir()), None)
    subdirs = {d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")}
    if train_dir == root and subdirs and subdirs <= set(_VAL_NAMES):   # only a held-out folder: all of it
        train_dir = root / sorted(subdirs)[0]
    train = _read_class_folders(train_dir, task, skips)
    val = _read_class_folders(val_dir, task, skips) if val_dir is not None else None
    return train, val


def _read_class_folders(folder: Path, task: TaskConfig, skips: _Skips) -> Split:
    classes = sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise DatasetError(f"{folder}: no class folders (expected {folder}/<class>/<image>, classes "
                           f"{', '.join(task.classes)})")
    xs: list[torch.Tensor] = []
    ys: list[int] = []
    for d in classes:
        label = _class_index(task, d.name, d)
        for f in sorted(d.rglob("*")):
            if not f.is_file() or f.name.startswith("."):
                continue
            if f.suffix.lower() not in IMAGE_SUFFIXES:
                skips(str(f), f"not an image ({', '.join(IMAGE_SUFFIXES)})")
                continue
            x = _read_image(f, task, skips)
            if x is not None:
                xs.append(x)
                ys.append(label)
    return _split(xs, ys, task)


def _read_image(path: Path | str, task: TaskConfig, skips: _Skips, source: Any = None) -> Optional[torch.Tensor]:
    """One image as scaled ``(C, H, W)`` float32, or None when skipped. ``source``: what to open
    instead of ``path`` (a Hugging Face row's bytes); ``path`` names it in messages."""
    channels, height, width = task.input_shape
    if channels not in IMAGE_MODES:
        raise DatasetError(f"{path}: the run's images have {channels} channels; image folders hold 1 (grey), "
                           f"3 (RGB) or 4 (RGBA)")
    try:
        arr = read_image(path if source is None else source, channels, skips.modes)
    except unreadable_image_errors() as exc:
        skips(str(path), f"unreadable image ({exc})")
        return None
    x = torch.from_numpy(arr.astype(np.float32)).div_(task.scale)
    if tuple(x.shape[1:]) != (height, width):
        if task.resize is None:
            raise DatasetError(f"{path}: image is {x.shape[2]}x{x.shape[1]} (width x height), the run's inputs are "
                               f"{width}x{height}; resize it, or set task.resize in the run config")
        size = (int(x.shape[2]), int(x.shape[1]))
        skips.resized[size] = skips.resized.get(size, 0) + 1
        x = _resize(x, (height, width))
    return x


def _resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear, ``align_corners=False``, no antialiasing: what ``sfl-agent predict --raw`` does."""
    return torch.nn.functional.interpolate(x[None], size=size, mode="bilinear", align_corners=False)[0]


def _split(xs: Sequence[torch.Tensor], ys: Sequence[int], task: TaskConfig) -> Split:
    if not xs:
        return Split(torch.empty((0, *task.input_shape)), torch.empty(0, dtype=torch.int64))
    return Split(torch.stack(list(xs)), torch.tensor(list(ys), dtype=torch.int64))


# --------------------------------------------------------------------------- arrays


def _arrays(path: Path, task: TaskConfig, skips: _Skips) -> tuple[Split, Optional[Split]]:
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files if k in ("x", "y", "x_val", "y_val")}
        except (ValueError, OSError, EOFError) as exc:
            raise DatasetError(f"{path}: cannot read it as .npz without pickle ({exc})") from None
        names = {k: f"{path}[{k}]" for k in arrays}
    else:
        arrays, names = {}, {}
        for k in ("x", "y", "x_val", "y_val"):
            f = path / f"{k}.npy"
            if f.is_file():
                try:
                    arrays[k] = np.load(f, allow_pickle=False)
                except (ValueError, OSError, EOFError) as exc:
                    raise DatasetError(f"{f}: cannot read it as .npy without pickle ({exc})") from None
                names[k] = str(f)
    for need in ("x", "y"):
        if need not in arrays:
            raise DatasetError(f"{path}: no array {need!r} (expected x and y, optionally x_val and y_val)")
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise DatasetError(f"{path}: x_val and y_val go together")
    train = _array_split(arrays["x"], arrays["y"], names["x"], names["y"], task)
    val = _array_split(arrays["x_val"], arrays["y_val"], names["x_val"], names["y_val"], task) \
        if "x_val" in arrays else None
    return train, val


def _array_split(x: np.ndarray, y: np.ndarray, xname: str, yname: str, task: TaskConfig) -> Split:
    shape = tuple(task.input_shape)
    if x.dtype.kind not in "biuf":
        raise DatasetError(f"{xname}: expected numbers, got dtype {x.dtype}")
    if x.dtype.kind == "f" and task.scale != 1.0:
        raise DatasetError(f"{xname}: holds floats ({x.dtype}) where raw integers 0..{task.scale:g} are expected "
                           f"(task.scale {task.scale:g}); for inputs already scaled set task.scale: 1")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        raise DatasetError(f"{xname}: holds NaN or infinite values")
    if len(shape) == 3 and shape[0] == 1 and x.ndim == 3 and x.shape[1:] == shape[1:]:
        x = x[:, None]                       # single-channel images without a channel axis
    if x.ndim == len(shape) + 1 and len(shape) == 3 and x.shape[-1] == shape[0] and x.shape[1:3] == shape[1:] \
            and x.shape[1:] != shape:
        raise DatasetError(f"{xname}: channels-last {tuple(x.shape)} (N, H, W, C); expected (N, {', '.join(map(str, shape))})"
                           f": store x.transpose(0, 3, 1, 2)")
    resized = False
    if x.ndim == len(shape) + 1 and len(shape) == 3 and task.resize is not None and x.shape[1] == shape[0] \
            and x.shape[2:] != shape[1:]:
        resized = True
    elif x.ndim != len(shape) + 1 or tuple(x.shape[1:]) != shape:
        raise DatasetError(f"{xname}: samples are {tuple(x.shape[1:])}, the run's inputs are {shape}")
    labels = _labels(y, len(x), yname, task)
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).div_(task.scale)
    if resized and task.resize is not None:
        t = torch.nn.functional.interpolate(t, size=tuple(task.resize), mode="bilinear", align_corners=False)
    return Split(t, labels)


def _labels(y: np.ndarray, n: int, where: str, task: TaskConfig) -> torch.Tensor:
    """Integer class indices, or class names (strings) mapped through the task's list."""
    y = np.asarray(y)
    if y.shape != (n,):
        raise DatasetError(f"{where}: expected {n} labels (one per sample), got shape {y.shape}")
    if y.dtype.kind in "iu":
        if n and (y.min() < 0 or y.max() >= task.num_classes):
            raise DatasetError(f"{where}: label {int(y.max() if y.max() >= task.num_classes else y.min())} is "
                               f"outside 0..{task.num_classes - 1} (the run's {task.num_classes} classes)")
        return torch.from_numpy(y.astype(np.int64))
    if y.dtype.kind in "US":
        index = {c: i for i, c in enumerate(task.classes)}
        names = [v.decode() if isinstance(v, bytes) else str(v) for v in y.tolist()]
        unknown = sorted({v for v in names if v not in index})
        if unknown:
            raise DatasetError(f"{where}: class name(s) {', '.join(map(repr, unknown[:MAX_NAMED]))} are not among "
                               f"the run's classes ({', '.join(task.classes)})")
        return torch.tensor([index[v] for v in names], dtype=torch.int64)
    raise DatasetError(f"{where}: labels must be class indices (integers) or class names (strings), "
                       f"got dtype {y.dtype}")


# --------------------------------------------------------------------------- tables


def _tables(path: Path, task: TaskConfig, skips: _Skips) -> tuple[Split, Optional[Split]]:
    if path.is_file():
        return _read_table(path, task, skips), None
    train = next(path / f"train{s}" for s in TABLE_SUFFIXES if (path / f"train{s}").is_file())
    val = next((path / f"{n}{s}" for n in _VAL_NAMES for s in TABLE_SUFFIXES if (path / f"{n}{s}").is_file()), None)
    return _read_table(train, task, skips), _read_table(val, task, skips) if val is not None else None


def _read_table(path: Path, task: TaskConfig, skips: _Skips) -> Split:
    if len(task.input_shape) != 1:
        raise DatasetError(f"{path}: a table, but the run's input_shape {list(task.input_shape)} is not "
                           f"[features]")
    columns = _read_csv(path) if path.suffix.lower() == ".csv" else _read_arrow(path)
    return _table_split(columns, str(path), task, skips)


def _read_csv(path: Path) -> dict[str, list[Any]]:
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if not header:
                raise DatasetError(f"{path}: empty file (expected a header row naming the columns)")
            cols: dict[str, list[Any]] = {h.strip(): [] for h in header}
            if len(cols) != len(header):
                raise DatasetError(f"{path}: repeated column names in the header")
            names = list(cols)
            for row in reader:
                if not row:
                    continue
                for i, name in enumerate(names):
                    cols[name].append(row[i].strip() if i < len(row) else None)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DatasetError(f"{path}: cannot read it as CSV ({exc})") from None
    return cols


def _read_arrow(path: Path) -> dict[str, list[Any]]:
    try:
        import pyarrow.feather as feather
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet/Arrow needs pyarrow: pip install 'sfl-edge[tables]'") from None
    try:
        table = pq.read_table(path) if path.suffix.lower() == ".parquet" else feather.read_table(path)
    except Exception as exc:  # pyarrow raises its own error types for bad files
        raise DatasetError(f"{path}: cannot read it as {path.suffix[1:]} ({str(exc).splitlines()[0]})") from None
    return {name: table.column(name).to_pylist() for name in table.column_names}


def _table_split(columns: dict[str, list[Any]], where: str, task: TaskConfig, skips: _Skips) -> Split:
    if task.label_column not in columns:
        raise DatasetError(f"{where}: no label column {task.label_column!r} (columns: {', '.join(columns)}); "
                           f"set task.label_column")
    features = list(task.features) if task.features else [c for c in columns if c != task.label_column]
    missing = [c for c in features if c not in columns]
    if missing:
        raise DatasetError(f"{where}: no feature column(s) {', '.join(missing)} (columns: {', '.join(columns)})")
    if len(features) != task.input_shape[0]:
        raise DatasetError(f"{where}: {len(features)} feature columns, the run's input_shape is "
                           f"{list(task.input_shape)}; name them in task.features")
    index = {c: i for i, c in enumerate(task.classes)}
    xs, ys = [], []
    labels = columns[task.label_column]
    for row, label in enumerate(labels):
        line = f"{where}: row {row + 1}"
        name = None if label is None else str(label)
        if name is None or name == "":
            skips(line, "no label")
            continue
        if name not in index:
            raise DatasetError(f"{line}: class {name!r} is not one of the run's classes ({', '.join(task.classes)})")
        try:
            values = [float(columns[c][row]) for c in features]
        except (TypeError, ValueError):
            skips(line, "a feature value is missing or not a number")
            continue
        if not all(math.isfinite(v) for v in values):
            skips(line, "a feature value is NaN or infinite")
            continue
        xs.append(values)
        ys.append(index[name])
    x = torch.tensor(xs, dtype=torch.float32).reshape(len(xs), len(features)).div_(task.scale)
    return Split(x, torch.tensor(ys, dtype=torch.int64))


# --------------------------------------------------------------------------- Hugging Face datasets


def _huggingface(path: str, task: TaskConfig, skips: _Skips) -> tuple[Split, Optional[Split]]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{path}: Hugging Face data sets need the optional extra: "
                           f"pip install 'sfl-edge[datasets]'") from None
    try:
        if path.startswith("hf:"):
            builder, _, where = path[3:].partition(":")
            if not builder or not where:
                raise DatasetError(f"{path}: expected hf:BUILDER:PATH, e.g. hf:imagefolder:photos or hf:csv:log.csv")
            p = Path(where).expanduser()
            loaded = datasets.load_dataset(builder, data_dir=str(p)) if p.is_dir() else \
                datasets.load_dataset(builder, data_files=str(p))
        else:
            loaded = datasets.load_from_disk(path)
    except DatasetError:
        raise
    except Exception as exc:   # datasets raises many types (FileNotFoundError, its own)
        raise DatasetError(f"{path}: cannot load it with Hugging Face datasets ({str(exc).splitlines()[0]})") from None
    if isinstance(loaded, datasets.DatasetDict):
        train_key = "train" if "train" in loaded else next(iter(loaded))
        val_key = next((k for k in ("validation", "val", "test") if k in loaded and k != train_key), None)
        parts = loaded[train_key], loaded[val_key] if val_key else None
    else:
        parts = loaded, None
    return _hf_split(parts[0], f"{path}", task, skips), \
        (_hf_split(parts[1], f"{path}", task, skips) if parts[1] is not None else None)


def _hf_split(ds: Any, where: str, task: TaskConfig, skips: _Skips) -> Split:
    import datasets

    features = ds.features
    label_col = task.label_column if task.label_column in features else None
    if label_col is None:
        raise DatasetError(f"{where}: no label column {task.label_column!r} (columns: {', '.join(features)}); "
                           f"set task.label_column")
    image_cols = [c for c, f in features.items() if isinstance(f, datasets.Image)]
    label_feature = features[label_col]
    names = label_feature.names if isinstance(label_feature, datasets.ClassLabel) else None

    def label_name(v: Any) -> str:
        return names[v] if names is not None and isinstance(v, int) else str(v)

    if not image_cols:   # a table: every other numeric column is a feature
        cols = {c: ds[c] for c in features}
        if names is not None:
            cols[label_col] = [label_name(v) for v in cols[label_col]]
        return _table_split(cols, where, task, skips)
    col = image_cols[0]
    xs, ys = [], []
    index = {c: i for i, c in enumerate(task.classes)}
    # undecoded, so that one corrupt image is one skipped row, not an exception mid-iteration
    for i, row in enumerate(ds.cast_column(col, datasets.Image(decode=False))):
        name = label_name(row[label_col])
        if name not in index:
            raise DatasetError(f"{where}: row {i}: class {name!r} is not one of the run's classes "
                               f"({', '.join(task.classes)})")
        image = row[col] or {}
        source = io.BytesIO(image["bytes"]) if image.get("bytes") else image.get("path")
        if source is None:
            skips(f"{where}: row {i}", "no image")
            continue
        x = _read_image(image.get("path") or f"{where}: row {i}", task, skips, source=source)
        if x is not None:
            xs.append(x)
            ys.append(index[name])
    return _split(xs, ys, task)

