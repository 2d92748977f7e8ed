"""docs/tutorial-own-data.md, executed: every shell block, in order, in a fresh directory, as a
user would paste them (the install line aside: the package under test is installed already).
The embedded broker's port is replaced by a free one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port
from helpers import REPO

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]
TUTORIAL = REPO / "docs" / "tutorial-own-data.md"


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_every_command_of_the_tutorial_runs_and_ends_with_an_accurate_exported_model(tmp_path):
    blocks = shell_blocks(TUTORIAL.read_text())
    assert blocks[0].strip() == "pip install 'sfl-edge[coordinator,predict]'" and len(blocks) == 8
    port = str(free_port())
    script = "set -euo pipefail\n" + "\n".join(b.replace("1883", port) for b in blocks[1:])
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "Traceback" not in out and "same shard" not in out, out[-6000:]
    # step 4: each device fits; the nano's corrupt file is named
    assert out.count("fits the run") == 3 and "broken.png" in out
    # step 5: the simulation says which folder each simulated device read
    assert re.search(r"sim-000 \(rpi4\): \S*devices/pi-1\n", out) and re.search(r"sim-002 \(jetson-nano\): \S*devices/nano", out)
    assert re.search(r"loaded \d+ samples from devices/pi-2 \(images\): .*three 0, four \d+", out), out[-4000:]
    # step 7: the exported model classifies the server's photos as the coordinator measured
    metrics = (tmp_path / "runs" / "photos" / "metrics.jsonl").read_text().splitlines()
    import json
    last = json.loads(metrics[-1])
    assert last["round"] == 5 and last["accuracy"] > 0.8 and last["federated"]["count"] == 110
    acc = float(re.search(r"accuracy: ([0-9.]+) \(\d+/300 against the class folders of server/val\)", out)[1])
    assert acc == pytest.approx(last["accuracy"], abs=1e-4)
