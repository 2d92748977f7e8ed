"""Loading the standard image data sets from the formats their authors distribute.

Why this module reads the raw formats itself instead of using torchvision: edge devices
(Jetsons, Raspberry Pis) often lack torchvision wheels, the machines have no internet, and
the security rule of the project forbids unpickling anything from disk, which rules out the
CIFAR-10 *python* distribution. The formats are simple enough to parse with
``numpy.frombuffer`` in a few lines, with every header checked so that a wrong or truncated
file fails with a message naming the file and what was expected.

Results are cached per process (several in-process agents load the same set); callers must
treat the returned tensors as read-only and copy before modifying them in place.
"""

from __future__ import annotations

import gzip
import tarfile
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from sfl_core.extras import import_optional
from sfl_core.plugins import load_entry_points

__all__ = ["DATASET_NAMES", "Dataset", "DatasetError", "load_dataset", "clear_cache", "dataset_names",
           "register_dataset", "input_shape_of"]

DATASET_NAMES = ("digits", "mnist", "fashion-mnist", "cifar10")

_INPUT_SHAPES = {"digits": (1, 8, 8), "mnist": (1, 28, 28), "fashion-mnist": (1, 28, 28), "cifar10": (3, 32, 32)}

ENTRY_POINT_GROUP = "sfl_edge.datasets"


@dataclass(frozen=True)
class _Plugin:
    """A data set added with :func:`register_dataset`."""

    loader: Callable[[Optional[str]], tuple]
    scale: float
    num_classes: int
    input_shape: Optional[tuple[int, ...]]
    needs_root: bool


_PLUGINS: dict[str, _Plugin] = {}


def register_dataset(name: str, loader: Callable[[Optional[str]], tuple], *, scale: float = 255.0,
                     num_classes: int = 10, input_shape: Optional[Sequence[int]] = None, needs_root: bool = False,
                     replace: bool = False) -> None:
    """Add a data set, so run configs and agents can name it (``data.dataset``).

    ``loader(root)`` (``root``: the run's ``data.root``, or ``None``) returns
    ``(x_train, y_train, x_test, y_test)`` as numpy arrays: ``x`` raw non-negative integer
    pixels (or sensor counts) shaped ``(N, C, ...)``, ``y`` class indices below
    ``num_classes``. The product scales by ``scale`` and standardises each channel with the
    train set's statistics, exactly as for the built-in sets (and records the constants in
    exported models). ``input_shape`` (per sample) lets commands such as
    ``sfl-coord models -c`` work without loading the data. Agents load the data set by
    name, so they must register it too: declare an entry point in the
    ``sfl_edge.datasets`` group (loaded on first use).
    """
    if not isinstance(name, str) or not name or name != name.strip().lower() or ":" in name or "/" in name:
        raise DatasetError(f"data set name must be a lower-case word, got {name!r}")
    if name in DATASET_NAMES or (name in _PLUGINS and not replace):
        raise DatasetError(f"data set {name!r} is already registered (pass replace=True to override a plugin)")
    if not callable(loader):
        raise DatasetError(f"data set {name!r}: loader must be callable, got {loader!r}")
    if not scale > 0 or isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise DatasetError(f"data set {name!r}: expected scale > 0 and num_classes >= 2")
    _PLUGINS[name] = _Plugin(loader, float(scale), num_classes,
                             tuple(int(d) for d in input_shape) if input_shape is not None else None, bool(needs_root))
    clear_cache()


def dataset_names() -> tuple[str, ...]:
    """Every data set a config may name: the built-in ones, then registered and entry-point ones."""
    _load_entry_points()
    return DATASET_NAMES + tuple(_PLUGINS)


def _load_entry_points() -> None:
    """Register the data sets installed packages declare in the ``sfl_edge.datasets`` group (each
    entry point: a loader; optional attributes ``scale``, ``num_classes``, ``input_shape``,
    ``needs_root``)."""
    load_entry_points(ENTRY_POINT_GROUP, lambda name, loader: register_dataset(
        name, loader, scale=getattr(loader, "scale", 255.0), num_classes=getattr(loader, "num_classes", 10),
        input_shape=getattr(loader, "input_shape", None), needs_root=getattr(loader, "needs_root", False)),
        {*DATASET_NAMES, *_PLUGINS}, "data set")


def input_shape_of(name: str, image_size: int | None = None) -> tuple[int, ...]:
    """The per-sample shape data set ``name`` feeds a model (after ``image_size``), without loading it."""
    key = _canonical_name(name)
    if key in _PLUGINS:
        shape = _PLUGINS[key].input_shape
        if shape is None and not _PLUGINS[key].needs_root:
            shape = load_dataset(key).input_shape
        if shape is None:
            raise DatasetError(f"data set {key!r}: register it with input_shape= (it needs a root to be read)")
    else:
        shape = _INPUT_SHAPES[key]
    return (shape[0], image_size, image_size) if image_size and len(shape) == 3 else tuple(shape)

FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")  # Debian dataset-fashion-mnist
CIFAR10_BINARY_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"

_IDX_UBYTE = 0x08
_CIFAR_RECORD = 1 + 3 * 32 * 32  # label byte + 3072 pixel bytes (R, G, B planes, row-major)
_CIFAR_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
_CIFAR_TEST = "test_batch.bin"
_CIFAR_DIR = "cifar-10-batches-bin"
_CIFAR_PY_DIR = "cifar-10-batches-py"


class DatasetError(ValueError):
    """Bad path or wrong file format; the message names the path and what was expected."""


@dataclass
class Dataset:
    """A train/test split as tensors ready for training.

    ``x_*`` are float32 ``(N, C, H, W)`` normalised per channel with the *train* set's mean
    and std (the test set uses the same constants, so no test information leaks in);
    ``y_*`` are int64 class labels in ``[0, num_classes)``.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    # how raw pixels became ``x_*`` (recorded in exported models, so a device can prepare its
    # own inputs): ``(x / scale - mean[c]) / std[c]`` per channel, after a bilinear resize
    # (``align_corners=False``) to ``resize`` when set
    preprocessing: dict = field(default_factory=dict)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, e.g. ``(1, 28, 28)``."""
        return tuple(self.x_train.shape[1:])


# --------------------------------------------------------------------------- public entry


def load_dataset(name: str, root: str | Path | None = None, image_size: int | None = None) -> Dataset:
    """Load data set ``name`` (one of :data:`DATASET_NAMES`) from ``root``.

    - ``digits``: scikit-learn's bundled 8x8 digits, fixed stratified 80/20 split; ``root`` ignored.
    - ``mnist`` / ``fashion-mnist``: a directory with the four official idx files, gzipped or raw.
      For ``fashion-mnist`` with ``root=None`` the Debian location
      ``/usr/share/datasets/fashion-mnist`` is tried.
    - ``cifar10``: the *binary* distribution: the ``cifar-10-batches-bin`` folder, its parent,
      the ``cifar-10-binary.tar.gz`` archive, or a folder holding that archive.

    ``image_size`` resizes every image to ``image_size x image_size`` (bilinear, after
    normalisation): how 28x28 MNIST-style data feeds a model built for 32x32 CIFAR inputs
    (VGG's five poolings need at least 32). Agents and coordinator resize alike.

    Raises :class:`DatasetError` for an unknown name, a missing path or a malformed file.
    """
    key = _canonical_name(name)
    if image_size is not None and (isinstance(image_size, bool) or int(image_size) != image_size or image_size < 1):
        raise DatasetError(f"image_size must be a positive integer, got {image_size!r}")
    if key == "digits" or (key in _PLUGINS and root is None and not _PLUGINS[key].needs_root):
        return _load_sized(key, "", image_size)
    if root is None:
        if key == "fashion-mnist" and FASHION_MNIST_SYSTEM_DIR.is_dir():
            root = FASHION_MNIST_SYSTEM_DIR
        else:
            hint = (
                f" (also looked in {FASHION_MNIST_SYSTEM_DIR}, installed by the Debian package "
                "dataset-fashion-mnist)"
                if key == "fashion-mnist"
                else ""
            )
            raise DatasetError(f"data set {key!r} needs a root directory with its files{hint}")
    path = Path(root).expanduser()
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory (expected the {key} data set files)")
    return _load_sized(key, str(path.resolve()), image_size)


def clear_cache() -> None:
    """Drop the in-process cache (tests, or to free memory after the last agent loaded)."""
    _load_cached.cache_clear()
    _resized_cached.cache_clear()


def _load_sized(key: str, root: str, image_size: int | None) -> Dataset:
    ds = _load_cached(key, root)
    if image_size is None or (ds.x_train.dim() == 4 and tuple(ds.x_train.shape[2:]) == (image_size, image_size)):
        return ds
    if ds.x_train.dim() != 4:
        raise DatasetError(f"image_size: data set {key!r} does not hold images")
    return _resized_cached(key, root, int(image_size))


@lru_cache(maxsize=4)
def _resized_cached(key: str, root: str, size: int) -> Dataset:
    ds = _load_cached(key, root)

    def resize(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], x.shape[1], size, size, dtype=x.dtype)
        for i in range(0, x.shape[0], 8192):   # bounded peak memory
            out[i:i + 8192] = torch.nn.functional.interpolate(x[i:i + 8192], size=(size, size), mode="bilinear",
                                                               align_corners=False)
        return out
    return Dataset(ds.name, resize(ds.x_train), ds.y_train, resize(ds.x_test), ds.y_test, ds.num_classes,
                   {**ds.preprocessing, "resize": [size, size]})


def _canonical_name(name: str) -> str:
    raw = str(name).strip().lower()
    if raw not in DATASET_NAMES and raw not in _PLUGINS:
        _load_entry_points()
    if raw in _PLUGINS:
        return raw
    key = raw.replace("_", "-")
    key = {"fmnist": "fashion-mnist", "fashionmnist": "fashion-mnist", "cifar-10": "cifar10"}.get(key, key)
    if key not in DATASET_NAMES:
        raise DatasetError(f"unknown data set {name!r}; expected one of {', '.join(dataset_names())}")
    return key


@lru_cache(maxsize=8)
def _load_cached(key: str, root: str) -> Dataset:
    num_classes = 10
    if key in _PLUGINS:
        xtr, ytr, xte, yte = _read_plugin(key, root or None)
        scale, num_classes = _PLUGINS[key].scale, _PLUGINS[key].num_classes
    elif key == "digits":
        xtr, ytr, xte, yte, scale = _read_digits()
    elif key in ("mnist", "fashion-mnist"):
        xtr, ytr, xte, yte = _read_mnist_dir(Path(root))
        scale = 255.0
    else:
        xtr, ytr, xte, yte = _read_cifar10(Path(root))
        scale = 255.0
    x_train, x_test, mean, std = _normalise(xtr, xte, scale)
    return Dataset(
        name=key,
        x_train=x_train,
        y_train=torch.from_numpy(ytr.astype(np.int64)),
        x_test=x_test,
        y_test=torch.from_numpy(yte.astype(np.int64)),
        num_classes=num_classes,
        preprocessing={"scale": scale, "mean": [float(m) for m in mean], "std": [float(v) for v in std],
                       "resize": None, "raw_shape": list(xtr.shape[1:])},
    )


def _read_plugin(key: str, root: Optional[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A registered loader's arrays, checked as strictly as the built-in readers check files."""
    plugin = _PLUGINS[key]
    try:
        out = plugin.loader(root)
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(f"data set {key!r}: its loader failed: {exc}") from None
    if not isinstance(out, tuple) or len(out) != 4:
        raise DatasetError(f"data set {key!r}: the loader must return (x_train, y_train, x_test, y_test)")
    xtr, ytr, xte, yte = (np.asarray(a) for a in out)
    for what, x, y in (("train", xtr, ytr), ("test", xte, yte)):
        if x.dtype.kind not in "iu" or x.ndim < 3 or len(x) == 0 or (x.size and x.min() < 0):
            raise DatasetError(f"data set {key!r}: x_{what} must be non-negative integers shaped (N, C, ...), "
                               f"got dtype {x.dtype}, shape {x.shape}")
        if y.dtype.kind not in "iu" or y.shape != (len(x),) or (y.size and not 0 <= y.min() <= y.max()
                                                                  < plugin.num_classes):
            raise DatasetError(f"data set {key!r}: y_{what} must be {len(x)} class indices in "
                               f"0..{plugin.num_classes - 1}, got dtype {y.dtype}, shape {y.shape}")
    if xtr.shape[1:] != xte.shape[1:]:
        raise DatasetError(f"data set {key!r}: train samples are {xtr.shape[1:]}, test samples {xte.shape[1:]}")
    return xtr, ytr, xte, yte


def _normalise(x_train: np.ndarray, x_test: np.ndarray, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Scale raw pixels to [0, 1], then standardise each channel with train-set statistics.

    Raw pixels are small integers (uint8), so per-channel statistics come exactly from a
    histogram: no float64 copy of a 60,000-image array is needed on a small device.
    """
    channels = x_train.shape[1]
    mean = np.empty(channels, dtype=np.float64)
    std = np.empty(channels, dtype=np.float64)
    for c in range(channels):
        hist = np.bincount(x_train[:, c].reshape(-1), minlength=256).astype(np.float64)
        values = np.arange(hist.size, dtype=np.float64) / scale
        n = hist.sum()
        mean[c] = (hist * values).sum() / n
        var = (hist * (values - mean[c]) ** 2).sum() / max(n - 1, 1)
        std[c] = max(float(np.sqrt(var)), 1e-8)
    shape = (1, channels) + (1,) * (x_train.ndim - 2)
    m = torch.from_numpy(mean.astype(np.float32)).view(shape)
    s = torch.from_numpy(std.astype(np.float32)).view(shape)
    out = []
    for x in (x_train, x_test):
        t = torch.from_numpy(x.astype(np.float32))  # astype copies: writable, independent of file buffers
        out.append(t.div_(scale).sub_(m).div_(s))
    return out[0], out[1], mean.astype(np.float32), std.astype(np.float32)


# --------------------------------------------------------------------------- digits


def _read_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    datasets = import_optional("sklearn.datasets", "the digits data set", DatasetError)
    load_digits = datasets.load_digits
    train_test_split = import_optional("sklearn.model_selection", "the digits data set", DatasetError).train_test_split

    bunch = load_digits()
    x = bunch.images.astype(np.uint8).reshape(-1, 1, 8, 8)  # integer pixel values 0..16
    y = bunch.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return xtr, ytr, xte, yte, 16.0


# --------------------------------------------------------------------------- MNIST idx


def _idx_candidates(stem: str) -> list[str]:
    """Accept the official names, gzipped or not, and the dotted variant some mirrors use."""
    dotted = stem.replace("-idx", ".idx", 1)  # train-images.idx3-ubyte
    return [stem, stem + ".gz", dotted, dotted + ".gz"]


def _find_idx(root: Path, stem: str) -> Path:
    for cand in _idx_candidates(stem):
        p = root / cand
        if p.is_file():
            return p
    raise DatasetError(f"{root}: missing {stem} (expected one of {', '.join(_idx_candidates(stem))})")


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":  # gzip magic: decide by content, not by suffix
            return gzip.decompress(raw)
        return raw
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"{path}: cannot read ({exc}); expected a raw or gzip-compressed idx file") from exc


def _parse_idx(data: bytes, path: Path, ndim: int, tail: tuple[int, ...]) -> np.ndarray:
    """Parse an unsigned-byte idx file: magic 0x0000 08 ndim, big-endian int32 dims, data."""
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetError(f"{path}: file is {len(data)} bytes, too short for an idx{ndim} header")
    if data[0] != 0 or data[1] != 0 or data[2] != _IDX_UBYTE or data[3] != ndim:
        raise DatasetError(
            f"{path}: bad magic number {data[:4].hex()}; expected 000008{ndim:02x} (idx{ndim}, unsigned byte)"
        )
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">i4", count=ndim, offset=4))
    if dims[1:] != tail:
        raise DatasetError(f"{path}: sample shape {dims[1:]}; expected {tail}")
    expected = int(np.prod(dims))
    actual = len(data) - header
    if actual != expected:
        raise DatasetError(
            f"{path}: {actual} data bytes but the header {dims} promises {expected} (truncated or corrupt file)"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _read_idx_pair(root: Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    ipath = _find_idx(root, f"{prefix}-images-idx3-ubyte")
    lpath = _find_idx(root, f"{prefix}-labels-idx1-ubyte")
    images = _parse_idx(_read_bytes(ipath), ipath, 3, (28, 28))
    labels = _parse_idx(_read_bytes(lpath), lpath, 1, ())
    if len(images) != len(labels):
        raise DatasetError(f"{ipath} holds {len(images)} images but {lpath} holds {len(labels)} labels")
    if labels.size and labels.max() > 9:
        raise DatasetError(f"{lpath}: label {int(labels.max())} out of range; expected 0..9")
    return images.reshape(-1, 1, 28, 28), labels


def _read_mnist_dir(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if not root.is_dir():
        raise DatasetError(f"{root}: not a directory (expected the folder holding the idx files)")
    xtr, ytr = _read_idx_pair(root, "train")
    xte, yte = _read_idx_pair(root, "t10k")
    return xtr, ytr, xte, yte


# --------------------------------------------------------------------------- CIFAR-10 binary


def _pickle_error(where: Path | str) -> DatasetError:
    return DatasetError(
        f"{where}: this is the CIFAR-10 python (pickle) distribution, which is not loaded because "
        f"unpickling files is unsafe; download the binary version instead: {CIFAR10_BINARY_URL}"
    )


def _parse_cifar(data: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    if len(data) == 0 or len(data) % _CIFAR_RECORD:
        raise DatasetError(
            f"{where}: {len(data)} bytes is not a positive multiple of the {_CIFAR_RECORD}-byte "
            "CIFAR-10 record (1 label byte + 3072 pixel bytes); truncated or not the binary format"
        )
    rec = np.frombuffer(data, dtype=np.uint8).reshape(-1, _CIFAR_RECORD)
    labels = rec[:, 0]
    if labels.max() > 9:
        raise DatasetError(f"{where}: label byte {int(labels.max())} out of range; expected 0..9")
    return rec[:, 1:].reshape(-1, 3, 32, 32), labels


def _assemble_cifar(blobs: dict[str, tuple[bytes, str]], where: Path) -> tuple[np.ndarray, ...]:
    missing = [n for n in (*_CIFAR_TRAIN, _CIFAR_TEST) if n not in blobs]
    if missing:
        raise DatasetError(f"{where}: missing {', '.join(missing)} (expected the CIFAR-10 binary batches)")
    train = [_parse_cifar(*blobs[n]) for n in _CIFAR_TRAIN]
    xte, yte = _parse_cifar(*blobs[_CIFAR_TEST])
    return np.concatenate([t[0] for t in train]), np.concatenate([t[1] for t in train]), xte, yte


def _read_cifar_dir(folder: Path) -> tuple[np.ndarray, ...]:
    blobs: dict[str, tuple[bytes, str]] = {}
    for name in (*_CIFAR_TRAIN, _CIFAR_TEST):
        p = folder / name
        if p.is_file():
            blobs[name] = (p.read_bytes(), str(p))
    return _assemble_cifar(blobs, folder)


def _read_cifar_tar(archive: Path) -> tuple[np.ndarray, ...]:
    wanted = set(_CIFAR_TRAIN) | {_CIFAR_TEST}
    blobs: dict[str, tuple[bytes, str]] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                parts = Path(member.name).parts
                if _CIFAR_PY_DIR in parts:
                    raise _pickle_error(archive)
                base = parts[-1] if parts else ""
                if member.isfile() and base in wanted and base not in blobs:
                    fh = tar.extractfile(member)  # read in memory; nothing is written to disk
                    if fh is not None:
                        blobs[base] = (fh.read(), f"{archive}:{member.name}")
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"{archive}: cannot read archive ({exc}); expected {CIFAR10_BINARY_URL}") from exc
    return _assemble_cifar(blobs, archive)


def _read_cifar10(root: Path) -> tuple[np.ndarray, ...]:
    """Resolve where the binary batches are, rejecting the pickle distribution on sight."""
    if root.is_file():
        if root.name.startswith("cifar-10-python"):
            raise _pickle_error(root)
        return _read_cifar_tar(root)
    if (root / "data_batch_1.bin").is_file():
        return _read_cifar_dir(root)
    if (root / _CIFAR_DIR).is_dir():
        return _read_cifar_dir(root / _CIFAR_DIR)
    if (root / "cifar-10-binary.tar.gz").is_file():
        return _read_cifar_tar(root / "cifar-10-binary.tar.gz")
    if (root / "data_batch_1").is_file() or (root / "batches.meta").is_file():
        raise _pickle_error(root)
    if (root / _CIFAR_PY_DIR).is_dir() or (root / "cifar-10-python.tar.gz").is_file():
        raise _pickle_error(root / _CIFAR_PY_DIR)
    raise DatasetError(
        f"{root}: no CIFAR-10 binary data found; expected data_batch_1..5.bin and test_batch.bin in this "
        f"folder or in {_CIFAR_DIR}/, or the archive cifar-10-binary.tar.gz ({CIFAR10_BINARY_URL})"
    )
