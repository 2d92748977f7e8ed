"""ONNX to the edge: exported models match torch, and export -> predict works end to end.

Tolerances: onnxruntime and torch run the same float32 ops, but in different orders (BN is
folded into the convs by the exporter's constant folding, and the kernels sum differently),
so outputs differ by float32 rounding, ~1e-6 relative here. rtol 1e-4 with an atol of 1e-4
of the output's scale leaves room for other CPUs' kernels without hiding a wrong graph
(a wrong op or weight is off by the output's own magnitude).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from sfl_core.model.zoo import MODEL_NAMES, SplitModel, build_model
from sfl_core.model.onnx_export import OnnxError, OnnxPredictor, export_onnx, load_inputs, read_sidecar

REPO = Path(__file__).resolve().parent.parent

# small but real per-model inputs; the big CIFAR nets (vgg16, alexnet) export in < 1 s at 32x32
SHAPES: dict[str, tuple[int, ...]] = {
    "small_cnn": (1, 28, 28), "resnet8": (3, 32, 32), "vgg_mini": (1, 28, 28), "vgg11": (3, 32, 32),
    "vgg16": (3, 32, 32), "alexnet": (3, 32, 32), "mobilenet_v1": (3, 32, 32), "cnn1d": (9, 128),
}


def _trained_like(model: SplitModel) -> SplitModel:
    """Random BN statistics and affine parameters, so eval-mode BN is not the identity and the
    export's BN folding is really checked (fresh BN has mean 0, var 1, weight 1, bias 0)."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.2)
            m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            with torch.no_grad():
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.randn(n, generator=g) * 0.1)
    return model.eval()


def _compare(module: torch.nn.Module, path: Path, x: torch.Tensor) -> float:
    with torch.no_grad():
        ref = module(x).numpy()
    got = OnnxPredictor(path, threads=1).run(x.numpy())
    assert got.shape == ref.shape
    scale = max(float(np.abs(ref).max()), 1e-6)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * scale)
    return float(np.abs(got - ref).max())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_onnx_matches_torch(name: str, tmp_path: Path) -> None:
    """Whole model and the default client portion: onnxruntime equals torch (eval mode), at a
    batch size other than the traced one (the batch axis is dynamic)."""
    torch.manual_seed(0)
    shape = SHAPES[name]
    model = _trained_like(build_model(name, shape, 10))
    x = torch.randn(3, *shape)   # traced at batch 2: 3 proves the dynamic axis

    meta = export_onnx(model, tmp_path / f"{name}.onnx", input_shape=shape, model_name=name, num_classes=10)
    assert meta == read_sidecar(tmp_path / f"{name}.onnx")
    assert meta["input_shape"] == list(shape) and meta["output_shape"] == [10] and meta["split"] is None
    assert meta["num_classes"] == 10 and meta["classes"] == [str(i) for i in range(10)]
    assert meta["opset"] == 17 and meta["torch"] == torch.__version__ and meta["output"] == "logits"
    err_whole = _compare(model, tmp_path / f"{name}.onnx", x)

    s = model.default_split
    client = model.client(s)
    meta = export_onnx(client, tmp_path / f"{name}-c{s}.onnx", input_shape=shape, model_name=name,
                       num_classes=10, split=s, output_kind="activations")
    assert meta["split"] == s and meta["output"] == "activations"
    err_client = _compare(client, tmp_path / f"{name}-c{s}.onnx", x)
    assert not any(m.training for m in model.modules())   # export restored the modes, not set them
    print(f"onnx max abs error {name}: whole {err_whole:.3g}, client[:{s}] {err_client:.3g}")   # pytest -s


def test_onnx_bottleneck_client_portion(tmp_path: Path) -> None:
    """A HeteroSFL client portion ends in the bottleneck encoder (a weight *slice*); the whole
    model runs its decoder at infer_width < width."""
    torch.manual_seed(0)
    model = _trained_like(build_model("vgg_mini", (1, 28, 28), 10))
    pair = model.add_bottleneck(3, 64)
    pair.infer_width = 16
    x = torch.randn(2, 1, 28, 28)
    export_onnx(model.client(3), tmp_path / "c.onnx", input_shape=(1, 28, 28), model_name="vgg_mini",
                num_classes=10, split=3, output_kind="activations")
    assert read_sidecar(tmp_path / "c.onnx")["output_shape"] == [64, 7, 7]
    err = _compare(model.client(3), tmp_path / "c.onnx", x)
    export_onnx(model, tmp_path / "m.onnx", input_shape=(1, 28, 28), model_name="vgg_mini", num_classes=10)
    err_whole = _compare(model, tmp_path / "m.onnx", x)
    print(f"onnx max abs error vgg_mini+bottleneck: whole {err_whole:.3g}, client[:3] {err:.3g}")


def test_predictor_validates_inputs(tmp_path: Path) -> None:
    model = build_model("small_cnn", (1, 8, 8), 10)
    path = tmp_path / "m.onnx"
    export_onnx(model, path, input_shape=(1, 8, 8), model_name="small_cnn", num_classes=10)
    p = OnnxPredictor(path)
    assert p.run(np.zeros((1, 8, 8), np.float32)).shape == (1, 10)   # one sample is a batch of 1
    with pytest.raises(OnnxError, match=r"expected \(N, 1, 8, 8\)"):
        p.run(np.zeros((4, 1, 28, 28), np.float32))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(OnnxError, match="without pickle"):
        load_inputs(tmp_path / "obj.npy")
    np.savez(tmp_path / "two.npz", a=np.zeros(3), b=np.zeros(3))
    with pytest.raises(OnnxError, match="no array named 'x'"):
        load_inputs(tmp_path / "two.npz")
    np.savez(tmp_path / "x.npz", x=np.ones((2, 1, 8, 8), np.float64))
    assert load_inputs(tmp_path / "x.npz").dtype == np.float32


def _cli(module: str, *args: str, block_torch: bool = False) -> subprocess.CompletedProcess:
    if block_torch:
        # `python -m cli.agent ...` with `import torch` made to fail: predict must not need it
        code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = 'sfl-agent'; "
                f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
        cmd = [sys.executable, "-c", code, *args]
    else:
        cmd = [sys.executable, "-m", module, *args]
    env = dict(os.environ, COLUMNS="400")   # rich wraps at 80 columns otherwise, splitting the messages
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def test_export_and_predict_cli(tmp_path: Path) -> None:
    """A real (1-round, simulated) run -> `sfl-coord export` -> `sfl-agent predict`: the device's
    predictions equal torch's on the checkpointed model, and score the run's accuracy."""
    from simulation import run_simulation
    from coordinator.export import load_global_model
    from sfl_core.config.run import load_run_config
    from sfl_core.data.builtin import load_dataset

    out = tmp_path / "run"
    cfg = {"run": "onnx", "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid", "seed": 0},
           "fleet": [{"profile": "s2fl-high-high", "count": 2}], "rounds": 1, "strategy": "sfl",
           "batch_size": 32, "lr": 0.1, "momentum": 0.9, "local_iters": 40, "output_dir": str(out)}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    history, _ = run_simulation(load_run_config(tmp_path / "run.yaml"), device="cpu")
    run_acc = history[-1]["accuracy"]
    assert run_acc > 0.5, history

    data = load_dataset("digits")
    x, y = data.x_test.numpy(), data.y_test.numpy()
    np.save(tmp_path / "x.npy", x)

    r = _cli("cli.coord", "export", str(out), "--onnx", str(tmp_path / "m.onnx"))
    assert r.returncode == 0, r.stderr
    assert "m.onnx" in r.stderr and "(N, 1, 8, 8)" in r.stderr
    meta = json.loads((tmp_path / "m.json").read_text())
    assert meta["model"] == "small_cnn" and meta["split"] is None and meta["round"] == 1
    assert meta["dataset"] == "digits" and meta["input_shape"] == [1, 8, 8]

    np.save(tmp_path / "y.npy", y)
    r = _cli("cli.agent", "predict", str(tmp_path / "m.onnx"), str(tmp_path / "x.npy"),
             "--output", str(tmp_path / "preds.json"), "--show", "3", "--labels", str(tmp_path / "y.npy"))
    assert r.returncode == 0, r.stderr
    header = next(l for l in r.stdout.splitlines() if "probability" in l)
    assert "predicted" in header and "true" in header and "label" not in header   # never reads as ground truth
    doc = json.loads((tmp_path / "preds.json").read_text())
    assert f"accuracy: {doc['accuracy']:.4f}" in r.stderr
    assert doc["accuracy"] == pytest.approx(run_acc, abs=1e-9)   # the device scores what the run measured
    preds = doc["predictions"]
    got = np.array([p["class"] for p in preds])
    model, _ = load_global_model(out)
    with torch.no_grad():
        expected = model(data.x_test).argmax(1).numpy()
    assert (got == expected).all()
    assert float((got == y).mean()) == pytest.approx(run_acc, abs=1e-9)   # the run evaluates on the same set
    assert all(0.0 < p["probability"] <= 1.0 for p in preds)

    # the client portion of the same run; predict refuses it (activations, not classes) -- without torch
    r = _cli("cli.coord", "export", str(out), "--onnx", str(tmp_path / "c.onnx"), "--split", "2")
    assert r.returncode == 0, r.stderr
    r = _cli("cli.agent", "predict", str(tmp_path / "c.onnx"), str(tmp_path / "x.npy"), block_torch=True)
    assert r.returncode == 2 and "client portion" in r.stderr, r.stderr
    # a shape mismatch is a clear error, also without torch; and one sample works
    np.save(tmp_path / "bad.npy", np.zeros((2, 28, 28), np.float32))
    r = _cli("cli.agent", "predict", str(tmp_path / "m.onnx"), str(tmp_path / "bad.npy"), block_torch=True)
    assert r.returncode == 2 and "expected (N, 1, 8, 8)" in r.stderr, r.stderr
    # raw pixels, prepared on the device with the constants the sidecar records: same answers
    from sfl_core.data.builtin import _read_digits
    raw_test = _read_digits()[2]                     # uint8 0..16, the same split as x
    assert meta["preprocessing"]["scale"] == 16.0 and meta["preprocessing"]["raw_shape"] == [1, 8, 8]
    np.save(tmp_path / "raw.npy", raw_test)
    r = _cli("cli.agent", "predict", str(tmp_path / "m.onnx"), str(tmp_path / "raw.npy"), "--raw",
             "--output", str(tmp_path / "raw.json"), block_torch=True)
    assert r.returncode == 0, r.stderr
    assert [p["class"] for p in json.loads((tmp_path / "raw.json").read_text())["predictions"]] == got.tolist()
    np.save(tmp_path / "short.npy", y[:5])
    r = _cli("cli.agent", "predict", str(tmp_path / "m.onnx"), str(tmp_path / "x.npy"),
             "--labels", str(tmp_path / "short.npy"), block_torch=True)
    assert r.returncode == 2 and f"expected {len(y)} labels" in r.stderr, r.stderr
    np.save(tmp_path / "one.npy", x[0])
    r = _cli("cli.agent", "predict", str(tmp_path / "m.onnx"), str(tmp_path / "one.npy"), block_torch=True)
    assert r.returncode == 0, r.stderr


def test_export_errors(tmp_path: Path) -> None:
    """No checkpoint, or a split the model does not have: red message, exit code 2."""
    from typer.testing import CliRunner

    from cli.coord import app
    from coordinator.export import describe_model
    from coordinator import state as ckpt

    runner = CliRunner(env={"COLUMNS": "400"})   # no rich line wrapping inside the messages
    (tmp_path / "empty").mkdir()
    res = runner.invoke(app, ["export", str(tmp_path / "empty"), "--onnx", str(tmp_path / "m.onnx")])
    assert res.exit_code == 2 and "no checkpoint" in res.output

    model = build_model("small_cnn", (1, 8, 8), 10)
    ckpt.save(tmp_path / "run", model.state_dict(), {"round": 1, "model": "small_cnn",
                                                     "model_info": describe_model(model, "digits")})
    res = runner.invoke(app, ["export", str(tmp_path / "run"), "--onnx", str(tmp_path / "m.onnx"), "--split", "9"])
    assert res.exit_code == 2 and "invalid split point 9" in res.output
    assert not (tmp_path / "m.onnx").exists()

    ckpt.save(tmp_path / "old", model.state_dict(), {"round": 1, "model": "small_cnn"})   # before model_info
    res = runner.invoke(app, ["export", str(tmp_path / "old"), "--onnx", str(tmp_path / "m.onnx")])
    assert res.exit_code == 2 and "--config" in res.output
    cfg = {"run": "old", "model": "small_cnn", "data": {"dataset": "digits"}, "fleet": ["s2fl-high-high"]}
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(cfg))
    res = runner.invoke(app, ["export", str(tmp_path / "old"), "--onnx", str(tmp_path / "m.onnx"),
                              "--config", str(tmp_path / "old.yaml")])
    assert res.exit_code == 0, res.output
    assert read_sidecar(tmp_path / "m.onnx")["input_shape"] == [1, 8, 8]


def test_rebuild_model_with_bottleneck() -> None:
    """state.json's model_info brings back a HeteroSFL bottleneck and the width it evaluates at."""
    from coordinator.export import describe_model, rebuild_model

    model = build_model("resnet8", (3, 32, 32), 10)
    model.add_bottleneck(2, 8).infer_width = 4
    info = json.loads(json.dumps(describe_model(model, "cifar10")))
    again = rebuild_model(info)
    again.load_state_dict(model.state_dict())   # strict: same keys and shapes
    assert again.bottleneck(2).width == 8 and again.bottleneck(2).infer_width == 4
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(again.eval()(x), model.eval()(x))


def test_preprocess_raw_matches_the_training_pipeline() -> None:
    """Raw images through `preprocess_raw` (numpy only) equal the data set's tensors, with and
    without the bilinear resize a run's `data.image_size` asks for."""
    from sfl_core.data.builtin import _read_digits, load_dataset
    from sfl_core.model.onnx_export import OnnxError, preprocess_raw

    raw = _read_digits()[2]
    for size in (None, 12, 5):
        ds = load_dataset("digits", image_size=size)
        got = preprocess_raw(raw, ds.preprocessing)
        np.testing.assert_allclose(got, ds.x_test.numpy(), rtol=0, atol=2e-5)
    ds = load_dataset("digits")
    assert preprocess_raw(raw[0, 0], ds.preprocessing).shape == (1, 1, 8, 8)      # one image, no axes
    assert preprocess_raw(raw[:, 0], ds.preprocessing).shape == raw.shape        # N images, no channel axis
    with pytest.raises(OnnxError, match="expected"):
        preprocess_raw(np.zeros((2, 3, 8, 8)), ds.preprocessing)
    with pytest.raises(OnnxError, match="no 'preprocessing' record"):
        preprocess_raw(raw, None)
