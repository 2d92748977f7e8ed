"""A fleet on its own data, with real processes over a real Mosquitto: a coordinator with its
own validation folder and a user's ``nn.Sequential`` from a file, three agent processes each
with its own image folder (unequal sizes, one without a class, one with a corrupt file, one
with photos of another pixel size, resized as the run says),
``normalize: federated``, federated evaluation; two agents that do not fit are refused with
one line and exit 2 without stopping the fleet; the exported ONNX model reproduces the
coordinator's accuracy from raw pixels (``sfl-agent predict --raw``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import MODEL_FILE, NAMES, REPO, coordinator_key, finish, logs, start_coord, write_fleet

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PIL = pytest.importorskip("PIL.Image")


def _agent(broker: str, tmp_path: Path, name: str, data: Path, model_file: Path, profile: str = "rpi4"):
    log = open(tmp_path / f"agent-{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "cli.agent", "start", "--profile", profile, "--broker", broker,
                             "--run", "own", "--agent-id", name, "--data", str(data), "--model-file", str(model_file),
                             "--verbose", "--coordinator-key", coordinator_key(tmp_path / "out")], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def test_three_devices_train_on_their_own_folders_and_the_export_reproduces_the_accuracy(mosquitto, tmp_path):
    write_fleet(tmp_path)
    for f in (tmp_path / "pi-2").rglob("*.png"):    # another camera: 16x16 photos, resized by the run
        PIL.open(f).resize((16, 16), PIL.NEAREST).save(f)
    (tmp_path / "my_models.py").write_text(MODEL_FILE)
    # an edited copy on one device: another width, so another model
    (tmp_path / "edited").mkdir()
    (tmp_path / "edited" / "my_models.py").write_text(MODEL_FILE.replace("16", "24"))
    (tmp_path / "horses" / "horse").mkdir(parents=True)
    PIL.fromarray(np.zeros((8, 8), np.uint8), "L").save(tmp_path / "horses" / "horse" / "0.png")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": "own", "model": "my_models.py:build_net", "strategy": "sfl", "rounds": 3, "local_iters": 15,
        "batch_size": 16, "lr": 0.05, "momentum": 0.5, "step_timeout_s": 30, "register_timeout_s": 120,
        "task": {"classes": NAMES, "input_shape": [1, 8, 8], "normalize": "federated", "resize": [8, 8]},
        "eval": {"data": "server", "federated_every": 1},
        "fleet": [{"profile": "rpi4", "count": 2}, {"profile": "jetson-nano"}], "output_dir": str(tmp_path / "out")}))
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    model = tmp_path / "my_models.py"
    misfits = [_agent(mosquitto.url, tmp_path, "horse", tmp_path / "horses", model),
               _agent(mosquitto.url, tmp_path, "edited", tmp_path / "pi-1", tmp_path / "edited" / "my_models.py")]
    agents = [_agent(mosquitto.url, tmp_path, f"pi-{i}", tmp_path / f"pi-{i}", model,
                     "jetson-nano" if i == 3 else "rpi4") for i in (1, 2, 3)]
    assert finish(misfits, 120) == [2, 2], logs(tmp_path)
    horse = (tmp_path / "agent-horse.log").read_text()
    assert "class 'horse' is not one of the run's classes (zero, one" in horse and "Traceback" not in horse
    edited = (tmp_path / "agent-edited.log").read_text()
    assert re.search(r"is not the run's \(tensor 0: the run has 'blocks.0.0.weight 16x1x3x3 float32 Conv2d', "
                     r"this device has 'blocks.0.0.weight 24x1x3x3 float32 Conv2d'\)", edited), edited
    assert finish([coord, *agents], 240) == [0, 0, 0, 0], logs(tmp_path)
    pi1 = (tmp_path / "agent-pi-1.log").read_text()
    # the constants, once combined, are published in the run description too: no agent re-registers
    assert re.search(r"INFO sfl.agent: the run description of run own changed, signed by our coordinator: "
                     r"normalize: None -> \{'mean': \[0\.\d+\], 'std': \[0\.\d+\]\}", pi1), pi1
    assert "registering again" not in pi1
    pi3 = (tmp_path / "agent-pi-3.log").read_text()
    assert "skipped 1 unreadable file(s)" in pi3 and "broken.png" in pi3
    assert re.search(r"loaded 1\d\d samples from .*pi-2 \(images\): zero \d+, one \d+, two \d+, three 0, four",
                     (tmp_path / "agent-pi-2.log").read_text())   # no 'three' folder: 'four' is still label 4
    registry = json.loads((tmp_path / "out" / "state.json").read_text())["registry"]
    assert registry["pi-2"]["label_counts"][3] == 0 and registry["pi-2"]["label_counts"][4] > 0
    history = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [h["round"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.3
    assert sorted(history[-1]["completed"]) == ["pi-1", "pi-2", "pi-3"]
    fed = history[-1]["federated"]
    assert set(fed["agents"]) == {"pi-3"} and fed["count"] == 80 and fed["accuracy"] > 0.3
    coord_log = (tmp_path / "coord.log").read_text()
    assert "standardisation from 3 agent(s)" in coord_log
    # export, then predict from raw pixels of the server's folder
    out = subprocess.run([sys.executable, "-m", "cli.coord", "export", str(tmp_path / "out"), "--onnx",
                          str(tmp_path / "m.onnx")], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    files = sorted((tmp_path / "server" / "val").rglob("*.png"))
    np.savez(tmp_path / "val.npz", x=np.stack([np.asarray(PIL.open(f)) for f in files]),
             y=np.array([NAMES.index(f.parent.name) for f in files]))
    pred = subprocess.run([sys.executable, "-m", "cli.agent", "predict", str(tmp_path / "m.onnx"),
                           str(tmp_path / "val.npz"), "--raw", "--labels", str(tmp_path / "val.npz")],
                          capture_output=True, text=True, cwd=REPO)
    assert pred.returncode == 0, pred.stderr
    acc = float(re.search(r"accuracy: ([0-9.]+) \(", pred.stdout + pred.stderr)[1])
    assert acc == pytest.approx(history[-1]["accuracy"], abs=1e-4)
