"""A device's own data: every source format, the label contract, bad files, fleet-wide standardisation.

Fixtures are written by the tests themselves (real PNG/JPEG/npz/npy/CSV/Parquet/Arrow files
and Hugging Face data sets saved to disk); nothing large is committed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sfl_core.config.run import ConfigError, run_config_from_dict, task_from_wire
from sfl_core.data.builtin import DatasetError
from sfl_core.data.local import describe_kind, load_local
from sfl_core.data.preprocessing import ChannelStats, Normalization

PIL = pytest.importorskip("PIL.Image")

CLASSES = ["cat", "dog", "bird"]


def task(**kw):
    d = {"classes": CLASSES, "input_shape": [3, 8, 8], **kw}
    return task_from_wire(d, "test")


def write_png(path, size=(8, 8), value=None, mode="RGB", fmt="PNG"):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(abs(hash(str(path))) % 2**32)
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    arr = rng.integers(0, 256, shape, dtype=np.uint8) if value is None else np.full(shape, value, np.uint8)
    PIL.fromarray(arr, mode).save(path, fmt)
    return arr


def test_an_image_folder_maps_class_folders_by_the_runs_names_not_by_what_the_device_has(tmp_path):
    # this device has no 'dog': 'bird' must still be label 2, not 1
    for i in range(3):
        write_png(tmp_path / "train" / "cat" / f"{i}.png")
    for i in range(2):
        write_png(tmp_path / "train" / "bird" / f"{i}.jpg", fmt="JPEG")
    write_png(tmp_path / "val" / "dog" / "0.png")
    d = load_local(tmp_path, task())
    assert d.kind == "images"
    assert d.train.label_counts(3) == [3, 0, 2]
    assert d.val is not None and d.val.label_counts(3) == [0, 1, 0]
    assert d.train.x.shape == (5, 3, 8, 8) and d.train.x.dtype == torch.float32
    assert 0.0 <= float(d.train.x.min()) and float(d.train.x.max()) <= 1.0   # scaled by 255, not standardised


def test_pixels_are_read_exactly_and_grey_images_take_the_runs_channels(tmp_path):
    arr = write_png(tmp_path / "cat" / "a.png", value=51, mode="L")
    write_png(tmp_path / "dog" / "b.png", value=102, mode="L")
    grey = task(input_shape=[1, 8, 8])
    d = load_local(tmp_path, grey)
    assert d.kind == "images" and d.val is None
    assert torch.allclose(d.train.x[0], torch.full((1, 8, 8), 51 / 255))
    rgb = load_local(tmp_path, task())   # converted like torchvision's ImageFolder does: convert('RGB')
    assert rgb.train.x.shape == (2, 3, 8, 8) and arr.shape == (8, 8)


def test_a_class_the_run_does_not_know_is_an_error_naming_the_folder(tmp_path):
    write_png(tmp_path / "cat" / "a.png")
    write_png(tmp_path / "horse" / "b.png")
    with pytest.raises(DatasetError, match=r"horse: class 'horse' is not one of the run's classes \(cat, dog, bird\)"):
        load_local(tmp_path, task())


def test_a_corrupt_image_is_skipped_and_named_or_fatal_on_request(tmp_path):
    for i in range(2):
        write_png(tmp_path / "cat" / f"{i}.png")
    bad = tmp_path / "cat" / "broken.png"
    bad.write_bytes((tmp_path / "cat" / "0.png").read_bytes()[:60])   # truncated
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    d = load_local(tmp_path, task())
    assert len(d.train) == 2
    assert [p for p, _ in d.skipped] == [str(bad), str(tmp_path / "cat" / "notes.txt")]
    assert "unreadable image" in d.skipped[0][1]
    with pytest.raises(DatasetError, match=r"broken\.png: unreadable image .*bad_files: fail"):
        load_local(tmp_path, task(), bad_files="fail")


def test_a_device_left_with_nothing_usable_is_an_error(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "x.png").write_bytes(b"garbage")
    with pytest.raises(DatasetError, match=r"no usable training sample \(1 skipped, the first .*x\.png"):
        load_local(tmp_path, task())
    for i in range(60):                                   # sixty bad files: one short line, not sixty
        (tmp_path / "cat" / f"bad-{i:02d}-with-a-long-name.png").write_bytes(b"garbage")
    with pytest.raises(DatasetError) as err:
        load_local(tmp_path, task())
    assert "(61 skipped, the first " in str(err.value) and "bad-01" not in str(err.value), str(err.value)


def test_an_image_of_another_size_is_an_error_naming_both_sizes_unless_the_run_resizes(tmp_path):
    write_png(tmp_path / "cat" / "big.png", size=(12, 10))
    with pytest.raises(DatasetError, match=r"big\.png: image is 12x10 \(width x height\), the run's inputs are 8x8"):
        load_local(tmp_path, task())
    d = load_local(tmp_path, task(resize=[8, 8]))
    assert d.train.x.shape == (1, 3, 8, 8)
    with pytest.raises(ConfigError, match="resize"):
        task(resize=[4, 4])


def test_npz_arrays_with_a_held_out_split_and_class_names_as_labels(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (10, 3, 8, 8), dtype=np.uint8)
    np.savez(tmp_path / "d.npz", x=x, y=np.array(["cat", "bird"] * 5), x_val=x[:4], y_val=np.array([0, 1, 2, 0]))
    d = load_local(tmp_path / "d.npz", task())
    assert d.kind == "arrays" and d.train.label_counts(3) == [5, 0, 5] and d.val.label_counts(3) == [2, 1, 1]
    assert torch.allclose(d.train.x, torch.from_numpy(x.astype(np.float32)) / 255)


@pytest.mark.parametrize("case,match", [
    ("channels_last", r"channels-last \(4, 8, 8, 3\) \(N, H, W, C\); expected \(N, 3, 8, 8\)"),
    ("floats", r"holds floats \(float32\) where raw integers 0\.\.255 are expected"),
    ("bad_label", r"label 7 is outside 0\.\.2"),
    ("unknown_name", r"class name\(s\) 'horse' are not among the run's classes"),
    ("shape", r"samples are \(3, 6, 6\), the run's inputs are \(3, 8, 8\)"),
    ("object", r"cannot read it as \.npz without pickle"),
])
def test_wrong_arrays_are_one_line_naming_the_file(tmp_path, case, match):
    x = np.zeros((4, 3, 8, 8), np.uint8)
    y = np.zeros(4, np.int64)
    if case == "channels_last":
        x = x.transpose(0, 2, 3, 1)
    elif case == "floats":
        x = x.astype(np.float32)
    elif case == "bad_label":
        y[1] = 7
    elif case == "unknown_name":
        y = np.array(["cat", "horse", "cat", "dog"])
    elif case == "shape":
        x = np.zeros((4, 3, 6, 6), np.uint8)
    elif case == "object":
        y = np.array([{"a": 1}] * 4, dtype=object)
    np.savez(tmp_path / "bad.npz", x=x, y=y)
    with pytest.raises(DatasetError, match=match) as err:
        load_local(tmp_path / "bad.npz", task())
    assert "bad.npz" in str(err.value) and "\n" not in str(err.value)


def test_floats_are_fine_where_the_task_says_the_inputs_are_already_scaled(tmp_path):
    np.save(tmp_path / "x.npy", np.random.default_rng(1).normal(size=(6, 3, 8, 8)).astype(np.float32))
    np.save(tmp_path / "y.npy", np.array([0, 1, 2, 0, 1, 2]))
    d = load_local(tmp_path, task(scale=1))
    assert d.kind == "arrays" and len(d.train) == 6 and d.val is None


def test_single_channel_arrays_may_omit_the_channel_axis(tmp_path):
    np.savez(tmp_path / "m.npz", x=np.zeros((3, 8, 8), np.uint8), y=np.array([0, 1, 1]))
    assert load_local(tmp_path / "m.npz", task(input_shape=[1, 8, 8])).train.x.shape == (3, 1, 8, 8)


def sensor_task(**kw):
    return task_from_wire({"classes": ["idle", "walk"], "input_shape": [3], "scale": 1, **kw}, "test")


def test_a_csv_table_with_a_bad_row_skipped_and_named(tmp_path):
    (tmp_path / "log.csv").write_text("ax,ay,az,activity\n0.1,0.2,0.3,walk\n1,2,oops,idle\n0.5,0.5,0.5,idle\n")
    d = load_local(tmp_path / "log.csv", sensor_task(label_column="activity"))
    assert d.kind == "table" and d.train.x.tolist() == [[pytest.approx(0.1), pytest.approx(0.2), pytest.approx(0.3)],
                                                        [0.5, 0.5, 0.5]]
    assert d.train.y.tolist() == [1, 0]
    assert d.skipped == [(f"{tmp_path / 'log.csv'}: row 2", "a feature value is missing or not a number")]
    with pytest.raises(DatasetError, match="no label column 'label'"):
        load_local(tmp_path / "log.csv", sensor_task())
    with pytest.raises(DatasetError, match=r"row 1: class 'walk' is not one of the run's classes"):
        load_local(tmp_path / "log.csv", task_from_wire({"classes": ["idle", "run"], "input_shape": [3], "scale": 1,
                                                         "label_column": "activity"}, "t"))


def test_parquet_and_arrow_tables_and_a_train_val_folder(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.feather as feather
    import pyarrow.parquet as pq
    table = pa.table({"a": [1.0, 2.0, 3.0], "b": [0.0, 1.0, 0.0], "c": [5, 6, 7], "label": ["walk", "idle", "walk"]})
    pq.write_table(table, tmp_path / "train.parquet")
    feather.write_feather(table.slice(0, 2), tmp_path / "val.arrow")
    d = load_local(tmp_path, sensor_task())
    assert d.kind == "table" and len(d.train) == 3 and len(d.val) == 2
    assert d.train.y.tolist() == [1, 0, 1] and d.train.x[2].tolist() == [3.0, 0.0, 7.0]
    only = load_local(tmp_path / "val.arrow", sensor_task(features=["c", "a", "b"]))
    assert only.train.x[0].tolist() == [5.0, 1.0, 0.0]


def test_a_hugging_face_dataset_saved_to_disk_and_an_imagefolder_builder(tmp_path):
    datasets = pytest.importorskip("datasets")
    # ClassLabel names in another order than the run's: mapped by name
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["bird", "cat"])})
    imgs = [PIL.fromarray(np.full((8, 8, 3), v, np.uint8)) for v in (10, 20, 30)]
    ds = datasets.Dataset.from_dict({"image": imgs, "label": [0, 1, 0]}, features=features)
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "hf"))
    d = load_local(tmp_path / "hf", task())
    assert d.kind == "huggingface" and d.train.y.tolist() == [2, 0, 2] and d.val.y.tolist() == [0]
    assert torch.allclose(d.train.x[1], torch.full((3, 8, 8), 20 / 255))
    for i in range(2):
        write_png(tmp_path / "folder" / "dog" / f"{i}.png")
    write_png(tmp_path / "folder" / "cat" / "0.png")
    d2 = load_local(f"hf:imagefolder:{tmp_path / 'folder'}", task())
    assert sorted(d2.train.y.tolist()) == [0, 1, 1]


def test_the_reader_is_chosen_by_what_the_path_is(tmp_path):
    with pytest.raises(DatasetError, match="no such file or directory"):
        describe_kind(tmp_path / "missing")
    (tmp_path / "x.npy").write_bytes(b"")
    with pytest.raises(DatasetError, match="give the folder holding x.npy and y.npy"):
        describe_kind(tmp_path / "x.npy")
    assert describe_kind(tmp_path) == "arrays"


def test_federated_statistics_equal_the_statistics_of_the_union():
    g = torch.Generator().manual_seed(0)
    parts = [torch.rand(n, 3, 4, 4, generator=g) * (i + 1) for i, n in enumerate((5, 17, 9))]
    norm = ChannelStats.combine(ChannelStats.of(p) for p in parts)
    union = torch.cat(parts).transpose(0, 1).reshape(3, -1).double()
    assert norm.mean == pytest.approx(union.mean(1).tolist(), rel=1e-9)
    assert norm.std == pytest.approx(union.std(1).tolist(), rel=1e-9)
    x = norm.apply(torch.cat(parts))
    assert x.mean(dim=(0, 2, 3)).abs().max() < 1e-5
    back = Normalization.from_wire(norm.to_wire(), 3)
    assert back == norm
    with pytest.raises(ValueError, match="positive stds"):
        Normalization.from_wire({"mean": [0, 0, 0], "std": [1, 0, 1]}, 3)
    with pytest.raises(ValueError, match="sums of squares"):
        ChannelStats.from_wire({"count": 3, "sum": [1.0], "sumsq": [float("nan")]}, 1)


def test_the_task_is_validated_in_the_run_config():
    base = {"run": "t", "min_agents": 1}
    cfg = run_config_from_dict({**base, "task": {"classes": ["a", "b"], "input_shape": [1, 8, 8],
                                                 "normalize": {"mean": [0.5], "std": [0.25]}}})
    assert cfg.task.num_classes == 2 and cfg.task.normalize == ((0.5,), (0.25,))
    for bad, match in ((["a", "a"], "distinct class names"), (["a"], "at least two")):
        with pytest.raises(ConfigError, match=match):
            run_config_from_dict({**base, "task": {"classes": bad, "input_shape": [1, 8, 8]}})
    with pytest.raises(ConfigError, match=r"task.normalize.*1 means"):
        run_config_from_dict({**base, "task": {"classes": ["a", "b"], "input_shape": [1, 8, 8],
                                               "normalize": {"mean": [0, 0], "std": [1, 1]}}})
    with pytest.raises(ConfigError, match=r"eval.data.*needs a 'task' section"):
        run_config_from_dict({**base, "eval": {"data": "val"}})


def test_converted_and_resized_images_are_said_once_in_the_devices_line(tmp_path):
    """Issue 63 item 7: RGB photos in a grey task, and photos of another size under task.resize,
    were converted and resized silently; the device's one line (check-data, start) now says so."""
    from edge_agent.own_data import describe

    (tmp_path / "cat").mkdir()
    (tmp_path / "dog").mkdir()
    for i in range(3):
        PIL.fromarray(np.full((8, 8, 3), 200, np.uint8), "RGB").save(tmp_path / "cat" / f"{i}.png")
        PIL.fromarray(np.zeros((16, 16), np.uint8), "L").save(tmp_path / "dog" / f"{i}.png")
    t = task(input_shape=[1, 8, 8], resize=[8, 8])
    d = load_local(tmp_path, t)
    line = describe(d, t)
    assert "converted to L: 3 RGB image(s)" in line, line
    assert "resized to 8x8 (task.resize): 3 of 16x16" in line, line
    plain = tmp_path / "plain"
    (plain / "cat").mkdir(parents=True)
    PIL.fromarray(np.zeros((8, 8), np.uint8), "L").save(plain / "cat" / "0.png")
    assert load_local(plain, t).notes == []                       # nothing done, nothing said
