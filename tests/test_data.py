"""Data set loaders: real MNIST/Fashion-MNIST files, generated idx and CIFAR-10 binary files."""

from __future__ import annotations

import gzip
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from sfl_core.data import builtin as data_mod
from sfl_core.data.builtin import DATASET_NAMES, Dataset, DatasetError, load_dataset
from helpers import DATASETS

SHARED = DATASETS


@pytest.fixture(autouse=True)
def _fresh_cache():
    data_mod.clear_cache()
    yield
    data_mod.clear_cache()


# --------------------------------------------------------------------------- helpers


def idx_bytes(arr: np.ndarray) -> bytes:
    arr = np.asarray(arr, dtype=np.uint8)
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(struct.pack(">i", d) for d in arr.shape)
    return header + arr.tobytes()


def write_idx_set(root: Path, n_train: int = 20, n_test: int = 10, gz: bool = False, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.arange(n_train, dtype=np.uint8) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test, dtype=np.uint8) * 3) % 10,
    }
    root.mkdir(parents=True, exist_ok=True)
    for stem, arr in arrays.items():
        blob = idx_bytes(arr)
        if gz:
            (root / (stem + ".gz")).write_bytes(gzip.compress(blob))
        else:
            (root / stem).write_bytes(blob)
    return arrays


def cifar_batch(n: int, seed: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    pixels = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    rec = np.concatenate([labels[:, None], pixels], axis=1)
    return rec.tobytes(), labels, pixels.reshape(n, 3, 32, 32)


CIFAR_NAMES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]


def write_cifar_dir(folder: Path, n: int = 4) -> dict[str, tuple[bytes, np.ndarray, np.ndarray]]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for i, name in enumerate(CIFAR_NAMES):
        out[name] = cifar_batch(n, seed=i)
        (folder / name).write_bytes(out[name][0])
    (folder / "batches.meta.txt").write_text("\n".join(f"class{i}" for i in range(10)))
    return out


def unnormalise(x: torch.Tensor, ref_train_raw: np.ndarray) -> np.ndarray:
    """Invert the per-channel normalisation using statistics recomputed from raw train pixels."""
    raw = ref_train_raw.astype(np.float64) / 255.0
    axes = (0,) + tuple(range(2, raw.ndim))
    mean = raw.mean(axis=axes, keepdims=True)
    std = raw.std(axis=axes, ddof=1, keepdims=True)
    return np.rint((x.numpy().astype(np.float64) * std + mean) * 255.0)


# --------------------------------------------------------------------------- digits


def test_digits_zero_setup():
    ds = load_dataset("digits")
    assert isinstance(ds, Dataset) and ds.name == "digits"
    assert ds.input_shape == (1, 8, 8)
    assert len(ds.x_train) + len(ds.x_test) == 1797
    assert len(ds.x_test) == 360
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.num_classes == 10
    assert set(ds.y_train.tolist()) == set(range(10)) == set(ds.y_test.tolist())
    assert abs(float(ds.x_train.mean())) < 1e-4
    assert abs(float(ds.x_train.std()) - 1.0) < 1e-3
    # deterministic split, and cached
    data_mod.clear_cache()
    again = load_dataset("digits", root="/ignored")
    assert torch.equal(again.y_test, ds.y_test) and torch.equal(again.x_train, ds.x_train)
    assert load_dataset("DIGITS") is again


def test_dataset_names_and_unknown():
    assert DATASET_NAMES == ("digits", "mnist", "fashion-mnist", "cifar10")
    with pytest.raises(DatasetError, match="expected one of"):
        load_dataset("imagenet")


# --------------------------------------------------------------------------- real MNIST / Fashion-MNIST


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_real_idx_files(name):
    root = SHARED / name
    if not (root / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"{root} not available")
    ds = load_dataset(name, root)
    assert ds.input_shape == (1, 28, 28)
    assert ds.x_train.shape[0] == 60000 and ds.y_train.shape[0] == 60000
    assert ds.x_test.shape[0] == 10000 and ds.y_test.shape[0] == 10000
    assert int(ds.y_train.min()) == 0 and int(ds.y_train.max()) == 9
    assert int(ds.y_test.min()) == 0 and int(ds.y_test.max()) == 9
    assert abs(float(ds.x_train.mean())) < 1e-3
    assert abs(float(ds.x_train.std()) - 1.0) < 1e-3
    assert abs(float(ds.x_test.mean())) < 0.05  # same constants, different split
    if name == "fashion-mnist":
        assert torch.bincount(ds.y_train).tolist() == [6000] * 10
        assert torch.bincount(ds.y_test).tolist() == [1000] * 10
        # MANIFEST: pixel mean 0.2860 / std 0.3530 -> a zero pixel maps to -0.2860/0.3530
        assert float(ds.x_train.min()) == pytest.approx(-0.2860 / 0.3530, abs=2e-3)
    else:
        assert float(ds.x_train.min()) == pytest.approx(-0.1307 / 0.3081, abs=2e-3)
    assert load_dataset(name, str(root) + "/") is ds  # cached on the resolved root


# --------------------------------------------------------------------------- generated idx


@pytest.mark.parametrize("gz", [False, True])
def test_generated_idx_raw_and_gz(tmp_path, gz):
    arrays = write_idx_set(tmp_path, gz=gz)
    ds = load_dataset("mnist", tmp_path)
    assert ds.x_train.shape == (20, 1, 28, 28) and ds.x_test.shape == (10, 1, 28, 28)
    assert ds.y_train.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert ds.y_test.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
    raw_train = arrays["train-images-idx3-ubyte"][:, None]
    np.testing.assert_array_equal(unnormalise(ds.x_train, raw_train), raw_train)
    np.testing.assert_array_equal(unnormalise(ds.x_test, raw_train), arrays["t10k-images-idx3-ubyte"][:, None])


def test_dotted_idx_names(tmp_path):
    write_idx_set(tmp_path)
    for f in tmp_path.iterdir():
        f.rename(tmp_path / f.name.replace("-idx", ".idx"))
    assert load_dataset("fashion-mnist", tmp_path).x_train.shape[0] == 20


def test_idx_missing_dir_and_file(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_dataset("mnist", tmp_path / "nope")
    write_idx_set(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DatasetError, match="missing t10k-labels-idx1-ubyte"):
        load_dataset("mnist", tmp_path)


def test_idx_bad_magic(tmp_path):
    write_idx_set(tmp_path)
    p = tmp_path / "train-images-idx3-ubyte"
    blob = bytearray(p.read_bytes())
    blob[2] = 0x0D  # float instead of unsigned byte
    p.write_bytes(bytes(blob))
    with pytest.raises(DatasetError, match=r"train-images-idx3-ubyte: bad magic number 00000d03; expected 00000803"):
        load_dataset("mnist", tmp_path)


def test_idx_truncated(tmp_path):
    write_idx_set(tmp_path)
    p = tmp_path / "train-images-idx3-ubyte"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(DatasetError, match="train-images-idx3-ubyte.*truncated"):
        load_dataset("mnist", tmp_path)


def test_idx_truncated_gzip(tmp_path):
    write_idx_set(tmp_path, gz=True)
    p = tmp_path / "t10k-images-idx3-ubyte.gz"
    p.write_bytes(p.read_bytes()[:-30])
    with pytest.raises(DatasetError, match="t10k-images-idx3-ubyte.gz"):
        load_dataset("mnist", tmp_path)


def test_idx_wrong_dims_and_count_mismatch(tmp_path):
    write_idx_set(tmp_path)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(idx_bytes(np.zeros((20, 32, 32))))
    with pytest.raises(DatasetError, match=r"sample shape \(32, 32\); expected \(28, 28\)"):
        load_dataset("mnist", tmp_path)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(idx_bytes(np.zeros((19, 28, 28))))
    with pytest.raises(DatasetError, match="19 images but .* 20 labels"):
        load_dataset("mnist", tmp_path)


def test_fashion_mnist_default_root(monkeypatch, tmp_path):
    monkeypatch.setattr(data_mod, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "absent")
    with pytest.raises(DatasetError, match="dataset-fashion-mnist"):
        load_dataset("fashion-mnist")
    write_idx_set(tmp_path / "sys")
    monkeypatch.setattr(data_mod, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "sys")
    assert load_dataset("fashion-mnist").x_train.shape[0] == 20
    with pytest.raises(DatasetError, match="needs a root"):
        load_dataset("mnist")


# --------------------------------------------------------------------------- CIFAR-10 binary


def _check_cifar(ds: Dataset, batches: dict) -> None:
    assert ds.name == "cifar10" and ds.input_shape == (3, 32, 32)
    train = [batches[n] for n in CIFAR_NAMES[:5]]
    assert ds.y_train.tolist() == np.concatenate([b[1] for b in train]).tolist()
    assert ds.y_test.tolist() == batches["test_batch.bin"][1].tolist()
    raw_train = np.concatenate([b[2] for b in train])
    np.testing.assert_array_equal(unnormalise(ds.x_train, raw_train), raw_train)
    np.testing.assert_array_equal(unnormalise(ds.x_test, raw_train), batches["test_batch.bin"][2])
    # per-channel normalisation: every channel has mean ~0 and std ~1
    means = ds.x_train.mean(dim=(0, 2, 3))
    assert torch.allclose(means, torch.zeros(3), atol=1e-4)


def test_cifar_folder_and_parent(tmp_path):
    batches = write_cifar_dir(tmp_path / "cifar-10-batches-bin")
    _check_cifar(load_dataset("cifar10", tmp_path / "cifar-10-batches-bin"), batches)
    _check_cifar(load_dataset("cifar10", tmp_path), batches)


def test_cifar_tar_gz(tmp_path):
    batches = write_cifar_dir(tmp_path / "src" / "cifar-10-batches-bin")
    archive = tmp_path / "dl" / "cifar-10-binary.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar-10-batches-bin", arcname="cifar-10-batches-bin")
    _check_cifar(load_dataset("cifar10", archive), batches)
    data_mod.clear_cache()
    _check_cifar(load_dataset("cifar10", archive.parent), batches)  # folder holding the archive


def test_cifar_rejects_pickle_distribution(tmp_path):
    py = tmp_path / "cifar-10-batches-py"
    py.mkdir()
    sentinel = tmp_path / "unpickled"

    class Trap:  # creates the sentinel file if anyone ever unpickles it
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    payload = pickle.dumps({"data": Trap(), "labels": [0]})
    for name in ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch"]:
        (py / name).write_bytes(payload)
    (py / "batches.meta").write_bytes(payload)
    for root in (tmp_path, py):
        with pytest.raises(DatasetError, match=r"pickle.*cifar-10-binary\.tar\.gz"):
            load_dataset("cifar10", root)
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(py, arcname="cifar-10-batches-py")
    renamed = tmp_path / "download.tar.gz"
    renamed.write_bytes(archive.read_bytes())
    for root in (archive, renamed):
        with pytest.raises(DatasetError, match="pickle"):
            load_dataset("cifar10", root)
    assert not sentinel.exists()


def test_cifar_bad_record_size_and_missing(tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar_dir(folder)
    (folder / "data_batch_3.bin").write_bytes(b"\x00" * 3000)
    with pytest.raises(DatasetError, match=r"data_batch_3\.bin: 3000 bytes .* 3073-byte"):
        load_dataset("cifar10", folder)
    (folder / "test_batch.bin").unlink()
    with pytest.raises(DatasetError, match="missing test_batch.bin"):
        load_dataset("cifar10", folder)
    with pytest.raises(DatasetError, match="cifar-10-batches-bin: missing test_batch.bin"):
        load_dataset("cifar10", tmp_path)  # via the parent folder
    with pytest.raises(DatasetError, match="no CIFAR-10 binary data found"):
        empty = tmp_path / "empty"
        empty.mkdir()
        load_dataset("cifar10", empty)


def test_cifar_corrupt_archive(tmp_path):
    bad = tmp_path / "cifar-10-binary.tar.gz"
    bad.write_bytes(gzip.compress(b"not a tar")[:-5])
    with pytest.raises(DatasetError, match="cannot read archive"):
        load_dataset("cifar10", bad)
