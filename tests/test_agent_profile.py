"""``sfl-agent profile --detect``: a device profile measured on the device, usable by a run as is.

Real processes, a real Mosquitto for the link. The numbers are this machine's, so the checks
are on their consistency: the file loads as a profile, its compute figure is the deepest
split's measured rate, its memory is the machine's, its link came through the broker.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sfl_core.config.run import load_profile, run_config_from_dict

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def agent(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.agent", "profile", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=150, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_detect_writes_a_profile_measured_through_the_broker(mosquitto, tmp_path):
    out = tmp_path / "my-board.yaml"
    p = agent("--detect", "--model", "vgg_mini", "--broker", mosquitto.url, "--output", str(out), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    prof = load_profile(str(out))
    assert prof.name == "my-board"
    rates = {int(s): float(r) for s, r in re.findall(r"#   split +(\d+): +[\d.]+ ms/sample +([\d.]+) GFLOP/s",
                                                        out.read_text())}
    assert sorted(rates) == [1, 2, 3, 4]   # vgg_mini's split points
    assert prof.compute_flops == pytest.approx(rates[4] * 1e9, rel=2e-3)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    runtime = re.search(r"# memory_bytes: RAM (\d+) MiB less the agent runtime's (\d+) MiB", out.read_text())
    assert runtime and int(runtime.group(1)) == round(ram / 2**20)
    assert 100 < int(runtime.group(2)) < 2000   # an interpreter with torch and a model: hundreds of MiB
    assert prof.memory_bytes == pytest.approx(ram - int(runtime.group(2)) * 2**20, abs=2**20)
    assert prof.link_bytes_per_s > 1e6 and prof.downlink == prof.link_bytes_per_s   # loopback; symmetric
    assert 0 < prof.latency_s < 0.5
    assert "echoed through mqtt://127.0.0.1" in prof.source
    # a run uses it as it is
    cfg = run_config_from_dict({"run": "mine", "model": "vgg_mini", "data": {"dataset": "digits"},
                                "fleet": [{"profile": str(out), "count": 2}]}, "<test>")
    assert cfg.fleet[0].profile == str(out)


def test_detect_needs_the_link_and_takes_it_by_hand(tmp_path):
    p = agent("--detect", cwd=tmp_path)
    assert p.returncode == 2 and "--detect needs the link: --broker URL to measure it, or --link-mbps N" in p.stderr
    assert "Traceback" not in p.stderr
    p = agent("--detect", "--link-mbps", "8", "--name", "wifi-board", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = yaml.safe_load(p.stdout)
    assert doc["name"] == "wifi-board" and doc["link_bytes_per_s"] == 1e6 and "latency_s" not in doc
