"""The shaped-links bench's parts that need no root: its calibration of the simulation from a
lock-step run (bench/pipeline_shaped.py) and its goodput probe both ways at once
(bench/link_goodput.py). The bench itself makes network namespaces and runs as root."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers import REPO, bench_module



@pytest.fixture(scope="module")
def shaped():
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))      # the bench scripts import their helpers as 'common'
    return bench_module("pipeline_shaped")


def _as_measured(history):
    """A virtual clock's record as a wall clock's reads: an agent's ``server_s`` is the server
    seconds charged to it, its ``time_s`` leaves out the coordinator's own seconds (no agent's
    watch holds them; the round's does)."""
    out = [history[0]]
    for r in history[1:]:
        agents = {a: {**x, "time_s": x["time_s"] - x.get("coordinator_s", 0.0),
                      "server_s": x["time_s"] - x["client_s"] - x["transfer_s"] - x.get("coordinator_s", 0.0)}
                  for a, x in r["agents"].items()}
        out.append({**r, "agents": agents})
    return out


def test_the_calibration_recovers_the_rates_and_the_overhead_a_run_was_timed_with(shaped, tmp_path, monkeypatch):
    """Simulate a lock-step run at known device and server rates and coordinator overhead, read
    it as the bench reads a measured run, and calibrate from a simulation at other rates: the
    calibration gives back the rates and the overhead (what the windows' predictions stand on)."""
    monkeypatch.setattr(shaped, "LINKS", shaped.HOME)
    args = SimpleNamespace(rounds=2, local_iters=4)
    truth = shaped.Calibration(compute_flops=[2e9, 3e9, 4e9], server_flops=2e9, overhead_s=0.002)
    true_fleet = shaped.profiles(tmp_path, 3, truth.compute_flops, tag="-true")
    paths = shaped.profiles(tmp_path, 3)
    config = shaped.run_config(tmp_path, "cal", 1, 0, args, paths)
    timed = shaped.simulated_run(config, "truth", true_fleet, truth.server_flops, truth.overhead_s)
    at_profiles = shaped.simulated_run(config, "profiles", server_flops=shaped.CAL_SERVER_FLOPS)
    cal = shaped.calibrated(_as_measured(timed), at_profiles, shaped.CAL_SERVER_FLOPS, args.local_iters)
    got = dataclasses.asdict(cal)
    for key, want in dataclasses.asdict(truth).items():
        assert got[key] == pytest.approx(want, rel=0.02), key


def test_the_goodput_probe_measures_both_ways_at_once():
    """``link_goodput.py ... both``: each end sends while it receives over one connection and
    prints what it received per second."""
    script, nbytes = str(REPO / "bench" / "link_goodput.py"), str(4 * 1024 * 1024)
    server = subprocess.Popen([sys.executable, script, "serve", "127.0.0.1", "0", "both", nbytes],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        ready = server.stdout.readline().split()
        assert ready[0] == "ready"
        client = subprocess.run([sys.executable, script, "connect", "127.0.0.1", ready[1], "both", nbytes],
                                capture_output=True, text=True, timeout=60, check=True)
        up, down = float(server.communicate(timeout=60)[0].split()[-1]), float(client.stdout.split()[-1])
        assert up > 0 and down > 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
