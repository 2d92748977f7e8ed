"""A run on the devices' own data, through the one engine (simulation): the task contract,
fleet-wide standardisation, the server's validation folder, federated evaluation, resume;
and the user's own model (a file, a layer list) with its architecture fingerprint.

Devices' data are real PNG folders written here from scikit-learn's digits (real images,
real labels), with unequal sizes, a missing class and a corrupt file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from coordinator.api import RunError

from simulation import run_simulation
from coordinator.registry import Registry
from sfl_core.wire import codec as wire
from sfl_core.config.run import ConfigError, load_run_config, task_from_wire
from sfl_core.model.fingerprint import architecture, digest, first_difference
from sfl_core.data.local import load_local
from sfl_core.model.zoo import build_model
from sfl_core.data.preprocessing import ChannelStats
from sfl_core.wire.protocol import Message, register_body
from sfl_core.model.user_models import normalise_layers, register_layers, resolve_agent_model

from helpers import MODEL_FILE, NAMES, write_fleet

PIL = pytest.importorskip("PIL.Image")

def write_run(root: Path, **over) -> Path:
    cfg = {"run": "own", "model": "small_cnn", "strategy": "sfl", "rounds": 3, "local_iters": 15,
           "batch_size": 16, "lr": 0.05, "momentum": 0.5,
           "task": {"classes": NAMES, "input_shape": [1, 8, 8]},
           "eval": {"data": "server", "federated_every": 1},
           "fleet": [{"profile": "rpi4", "data": "pi-1"}, {"profile": "rpi4", "data": "pi-2"},
                     {"profile": "jetson-nano", "data": "pi-3"}],
           "output_dir": "out"}
    cfg.update(over)
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fleet")
    write_fleet(root)
    return root


def test_a_fleet_trains_on_its_own_folders_with_constants_from_all_devices(fleet, tmp_path):
    cfg = load_run_config(write_run(fleet, output_dir=str(tmp_path / "out")))
    history, engine = run_simulation(cfg)
    # federated standardisation: exactly the statistics of the union of the devices' training images
    task = cfg.task
    union = torch.cat([load_local(fleet / d, task).train.x for d in ("pi-1", "pi-2", "pi-3")])
    assert engine.validation.normalization.mean[0] == pytest.approx(float(union.double().mean()), rel=1e-9)
    assert engine.validation.normalization.std[0] == pytest.approx(float(union.double().std()), rel=1e-9)
    # labels by name: the device without 'three' registered a zero count there, 'four' stays index 4
    counts = {a.agent_id: a.label_counts for a in engine.registry.agents.values()}
    assert counts["sim-001"][3] == 0 and counts["sim-001"][4] > 0 and sum(counts["sim-002"]) == 320   # 400 images, 80 held out, the broken file skipped
    # the server scores on its own validation folder, the devices on their held-out splits
    assert len(engine.validation.y) == 300 and history[-1]["accuracy"] > history[0]["accuracy"] + 0.3
    fed = history[-1]["federated"]
    assert set(fed["agents"]) == {"sim-002"} and fed["count"] == 80     # only pi-3 holds a val/ split
    assert fed["accuracy"] == fed["agents"]["sim-002"]["accuracy"]
    # the same model on held-out images of the same kind: the devices' figure rises and tracks the server's
    assert fed["accuracy"] > history[1]["federated"]["accuracy"] + 0.1, [h.get("federated") for h in history]
    assert abs(fed["accuracy"] - history[-1]["accuracy"]) < 0.2
    # the exported record is what training used
    st = json.loads((tmp_path / "out" / "state.json").read_text())
    pre = st["model_info"]["preprocessing"]
    assert pre["mean"] == list(engine.validation.normalization.mean) and pre["classes"] == NAMES
    assert st["normalize"] == engine.validation.normalization.to_wire()


def test_a_resumed_run_keeps_the_constants_of_round_1(fleet, tmp_path):
    path = write_run(fleet, rounds=1, output_dir=str(tmp_path / "out"))
    _, first = run_simulation(load_run_config(path))
    path = write_run(fleet, rounds=2, output_dir=str(tmp_path / "out"),
                     fleet=[{"profile": "rpi4", "data": "pi-1"}, {"profile": "rpi4", "data": "pi-2"}])
    history, again = run_simulation(load_run_config(path), resume=True)
    assert again.normalization == first.normalization      # not recomputed from the two devices left
    assert [h["round"] for h in history] == [0, 1, 2]


def test_without_server_validation_data_the_run_says_so_and_trains(fleet, tmp_path, caplog):
    cfg = load_run_config(write_run(fleet, rounds=2, eval={"federated_every": 2}, output_dir=str(tmp_path / "o")))
    history, _ = run_simulation(cfg)
    assert "no validation data on the server" in caplog.text
    assert history[-1]["accuracy"] is None and history[-1]["federated"]["accuracy"] > 0.3
    assert "federated" not in history[1]                      # every 2 rounds


def test_given_constants_are_used_as_given(fleet, tmp_path):
    cfg = load_run_config(write_run(fleet, rounds=1, output_dir=str(tmp_path / "o"),
                                    task={"classes": NAMES, "input_shape": [1, 8, 8],
                                          "normalize": {"mean": [0.5], "std": [0.25]}}))
    _, engine = run_simulation(cfg)
    assert engine.validation.normalization.mean == (0.5,) and engine.validation.normalization.std == (0.25,)
    assert float(engine.validation.x.min()) == pytest.approx(-2.0)     # (0 - 0.5) / 0.25


def test_a_device_whose_data_does_not_fit_stops_the_simulation_with_one_line(fleet, tmp_path):
    bad = tmp_path / "bad" / "horse"
    bad.mkdir(parents=True)
    PIL.fromarray(np.zeros((8, 8), np.uint8), "L").save(bad / "0.png")
    cfg = load_run_config(write_run(fleet, output_dir=str(tmp_path / "o"),
                                    fleet=[{"profile": "rpi4", "data": str(tmp_path / "bad")}]))
    with pytest.raises(RunError, match=r"horse: class 'horse' is not one of the run's classes"):
        run_simulation(cfg)
    with pytest.raises(ConfigError, match=r"field 'fleet\[0\].count': one data path is one device: expected count 1 with 'data', got 2"):
        load_run_config(write_run(fleet, fleet=[{"profile": "rpi4", "data": "pi-1", "count": 2}]))
    with pytest.raises(ConfigError, match=r"a device's own 'data' needs a 'task' section"):
        load_run_config(write_run(fleet, task=None, eval={}))


def test_a_users_model_file_next_to_the_run_file_trains_and_exports(fleet, tmp_path):
    from coordinator.export import export_run
    from sfl_core.model.onnx_export import OnnxPredictor, preprocess_raw

    (fleet / "my_models.py").write_text(MODEL_FILE)
    cfg = load_run_config(write_run(fleet, model="my_models.py:build_net", strategy="auto",
                                    output_dir=str(tmp_path / "out")))
    assert cfg.model == "build_net"
    history, engine = run_simulation(cfg)
    assert history[-1]["accuracy"] > 0.6
    meta = export_run(tmp_path / "out", tmp_path / "m.onnx")
    assert meta["classes"] == NAMES
    # raw server images through the sidecar's preprocessing reproduce the coordinator's accuracy
    files = sorted((fleet / "server" / "val").rglob("*.png"))
    raw = np.stack([np.asarray(PIL.open(f)) for f in files])
    labels = np.array([NAMES.index(f.parent.name) for f in files])
    predictor = OnnxPredictor(tmp_path / "m.onnx")
    pred = predictor.run(preprocess_raw(raw, predictor.meta["preprocessing"])).argmax(1)
    assert (pred == labels).mean() == pytest.approx(history[-1]["accuracy"], abs=1e-9)


def test_model_file_errors_are_one_line(tmp_path):
    (tmp_path / "m.py").write_text("def build(shape, n):\n    return 1 / 0\n")
    (tmp_path / "broken.py").write_text("import no_such_module\n")
    base = {"run": "x", "min_agents": 1}
    for model, match in (("m.py:nothing", r"has no function 'nothing'"),
                         ("broken.py:f", r"importing it failed: ModuleNotFoundError"),
                         ("missing.py:f", r"no such model file"),
                         ("m.py:small_cnn", r"built-in model's name")):
        (tmp_path / "run.yaml").write_text(yaml.safe_dump({**base, "model": model}))
        with pytest.raises(ConfigError, match=match) as err:
            load_run_config(tmp_path / "run.yaml")
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"install m.py on this device and pass --model-file PATH"):
        resolve_agent_model("m.py", "build", [str(tmp_path / "other.py")])


def test_a_layer_list_is_validated_named_by_content_and_built_alike_everywhere():
    spec = [[{"conv": 8}, "relu"], [{"conv": {"out": 16, "kernel": 3}}, "relu", "maxpool"], ["flatten", "linear"]]
    name = register_layers(spec)
    assert name == register_layers(json.loads(json.dumps(spec)))      # as it arrives from the wire
    m = build_model(name, (1, 8, 8), 10)
    assert m.num_blocks == 3 and m.split_points == (1, 2)
    assert m(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    for bad, match in (([{"conv": 8}], "a list of 2 to"), ([{"lstm": 4}, "linear"], "unknown layer 'lstm'"),
                       ([{"conv": {"out": 8, "kernle": 3}}, "linear"], "unknown option"),
                       ([{"dropout": 2}, "linear"], r"dropout.p: expected a number in \[0, 1\)"),
                       ([["flatten"], [{"linear": 5}]], None)):
        if match is None:
            with pytest.raises(ValueError, match=r"last block outputs \(5,\), expected \(10,\)"):
                build_model(register_layers(bad), (1, 8, 8), 10)
        else:
            with pytest.raises(ValueError, match=match):
                normalise_layers(bad)
    from sfl_core.config.run import run_config_from_dict
    with pytest.raises(ConfigError, match=r"field 'model': expected a valid layer list .*unknown layer"):
        run_config_from_dict({"run": "x", "min_agents": 1, "model": {"layers": [{"lstm": 4}, "linear"]}})


def test_the_fingerprint_names_the_first_difference():
    a = architecture(build_model("small_cnn", (1, 8, 8), 10))
    b = architecture(build_model("small_cnn", (1, 8, 8), 9))
    assert digest(a) != digest(b) and first_difference(a, a) == ""
    assert first_difference(a, b).startswith("tensor ") and "10" in first_difference(a, b)
    assert "more tensor(s)" in first_difference(a, a[:-1])


def _register(**extra) -> Message:
    from sfl_core.config.run import load_profile
    body = register_body(index=0, profile=load_profile("rpi4"), measured={}, label_counts=[1, 1], num_samples=2,
                         emulate=False, resume={}, privacy={}, extra=extra)
    return Message("register", "r", "a1", body)


def test_the_coordinator_refuses_another_model_and_bad_statistics_at_registration():
    reg = Registry(2, channels=1, architecture="abc")
    with pytest.raises(wire.WireError, match=r"its model is not the run's \(architecture xyz, the run's abc\)"):
        reg.register(_register(architecture="xyz"))
    with pytest.raises(wire.WireError, match="channel_stats"):
        reg.register(_register(channel_stats={"count": 4, "sum": [1.0, 2.0], "sumsq": [1.0, 2.0]}))
    reg.register(_register(architecture="abc", channel_stats=ChannelStats(4, (1.0,), (1.0,)).to_wire()))
    assert reg.channel_stats["a1"].count == 4
    with pytest.raises(wire.WireError, match="does not standardise from the devices' data"):
        Registry(2).register(_register(channel_stats=ChannelStats(4, (1.0,), (1.0,)).to_wire()))


def test_an_agent_of_a_task_run_needs_the_constants_with_its_assignment():
    from edge_agent.agent import AgentCore, LocalData
    core = AgentCore("a1", "r", LocalData(torch.rand(8, 1, 8, 8), torch.zeros(8, dtype=torch.long), 2), (1, 8, 8),
                     standardise=True)
    with pytest.raises(wire.WireError, match="assign.normalize: missing"):
        core._standardise(None)
    core._standardise({"mean": [0.5], "std": [0.5]})
    assert torch.allclose(core.data.x, (core._scaled - 0.5) / 0.5)
    with pytest.raises(ValueError, match="positive stds"):
        core._standardise({"mean": [0.5], "std": [0.0]})
    assert task_from_wire({"classes": ["a", "b"], "input_shape": [1, 8, 8]}).normalize == "federated"


# ---------------------------------------------------------------- the commands around it

def _cli(app, *args: str):
    from typer.testing import CliRunner
    return CliRunner().invoke(app, list(args))


def test_check_data_says_what_a_device_holds_and_whether_it_fits(fleet, tmp_path):
    from cli.agent import app

    (fleet / "my_models.py").write_text(MODEL_FILE)
    run = write_run(fleet, model="my_models.py:build_net")
    agent_yaml = tmp_path / "agent.yaml"
    agent_yaml.write_text(yaml.safe_dump({"profile": "rpi4", "data": str(fleet / "pi-3"),
                                          "model_file": [str(fleet / "my_models.py")]}))
    res = _cli(app, "check-data", "--config", str(agent_yaml), "--run-config", str(run), "--format", "json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["fits"] is True and report["train_samples"] == 320 and report["val_samples"] == 80
    assert report["label_counts"] == list(report["train"].values()) and report["skipped"] == 1
    assert report["skipped_files"][0].startswith(str(fleet / "pi-3" / "train" / "five" / "broken.png"))
    text = _cli(app, "check-data", "--data", str(fleet / "pi-2"), "--run-config", str(run), "--model-file",
                str(fleet / "my_models.py"))
    assert text.exit_code == 0 and "three 0, four" in text.output and "fits the run" in text.output
    alone = _cli(app, "check-data", "--data", str(fleet / "pi-2"), "--run-config", str(run))
    assert alone.exit_code == 2 and "install my_models.py on this device and pass --model-file" in alone.output
    survey = _cli(app, "check-data", "--data", str(fleet / "pi-2"))
    assert survey.exit_code == 0 and "train/: eight" in survey.output and "8x8 L" in survey.output
    (tmp_path / "odd" / "horse").mkdir(parents=True)
    PIL.fromarray(np.zeros((8, 8), np.uint8), "L").save(tmp_path / "odd" / "horse" / "0.png")
    bad = _cli(app, "check-data", "--data", str(tmp_path / "odd"), "--run-config", str(run), "--model-file",
               str(fleet / "my_models.py"))
    assert bad.exit_code == 2 and "class 'horse' is not one of the run's classes" in bad.output
    assert "Traceback" not in bad.output


def test_check_data_resolves_the_model_exactly_as_start_does(fleet, tmp_path):
    """Issue 63 item 1, both directions: a device whose own model file builds another network
    is refused (start would refuse it), and a run config copied alone into another folder
    fits with the device's right --model-file (start would accept it). A run config without a
    fleet is checked too: the fleet is the coordinator's business."""
    from cli.agent import app

    (fleet / "my_models.py").write_text(MODEL_FILE)
    run = write_run(fleet, model="my_models.py:build_net")
    other = tmp_path / "device-b" / "my_models.py"
    other.parent.mkdir()
    other.write_text(MODEL_FILE.replace("Conv2d(c, 16", "Conv2d(c, 24").replace("Conv2d(16, 32", "Conv2d(24, 32"))
    assert other.read_text() != MODEL_FILE
    res = _cli(app, "check-data", "--data", str(fleet / "pi-2"), "--run-config", str(run), "--model-file", str(other))
    assert res.exit_code == 2 and "this device's model 'build_net' is not the run's (tensor 0" in res.output, res.output
    elsewhere = tmp_path / "copied" / "run.yaml"
    elsewhere.parent.mkdir()
    raw = yaml.safe_load(run.read_text())
    raw.pop("fleet")
    elsewhere.write_text(yaml.safe_dump(raw))
    res = _cli(app, "check-data", "--data", str(fleet / "pi-2"), "--run-config", str(elsewhere), "--model-file",
               str(fleet / "my_models.py"))
    assert res.exit_code == 0 and "fits the run" in res.output, res.output
    assert "Traceback" not in res.output


def test_plan_and_models_work_on_a_task_run_with_a_users_model(fleet):
    from cli.coord import app

    (fleet / "my_models.py").write_text(MODEL_FILE)
    run = write_run(fleet, model="my_models.py:build_net", strategy="auto")
    res = _cli(app, "plan", "-c", str(run))
    assert res.exit_code == 0, res.output
    assert "auto's assignment" in res.output and "jetson-nano" in res.output
    res = _cli(app, "models", "-c", str(run))
    assert res.exit_code == 0 and "build_net input (1, 8, 8)" in res.output and "2:Sequential" in res.output


def test_a_missing_server_validation_folder_is_one_line_and_exit_2(fleet, tmp_path):
    from cli.coord import app

    run = write_run(fleet, eval={"data": "no-such-folder"}, output_dir=str(tmp_path / "o"))
    res = _cli(app, "simulate", "-c", str(run))
    assert res.exit_code == 2 and "no-such-folder: no such file or directory" in res.output
    assert "Traceback" not in res.output


def test_the_run_description_carries_the_fingerprint_where_code_is_installed_on_each_side(fleet, tmp_path):
    from coordinator.api import run_dataset, run_info_body
    from sfl_core.config.run import run_config_from_dict

    (fleet / "my_models.py").write_text(MODEL_FILE)
    own = load_run_config(write_run(fleet))                                        # a task run, zoo model
    bench_user = load_run_config(write_run(fleet, task=None, eval={}, model="my_models.py:build_net",
                                           fleet=[{"profile": "rpi4"}], data={"dataset": "digits"}))
    bench_zoo = run_config_from_dict({"run": "z", "fleet": ["rpi4"], "model": "small_cnn"})
    for cfg, carried in ((own, True), (bench_user, True), (bench_zoo, False)):
        body = run_info_body(cfg, run_dataset(cfg))
        assert ("architecture" in body) == carried, cfg.model
    lines = run_info_body(bench_user, run_dataset(bench_user))["architecture"]
    assert lines == architecture(build_model("build_net", (1, 8, 8), 10))
