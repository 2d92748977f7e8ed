"""bench/coordinator_load.py's time between rounds, and the bound it puts on server workers.

The figures come from the agents' own clock readings (assignment in, weights out); here on
hand-made readings whose answer is known, including a window that cuts a boundary.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from helpers import bench_module

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def coordinator_load():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))      # the bench scripts import their helpers as 'common'
    return bench_module("coordinator_load")


def _round(r: int, assign: list[float], weights: list[float]) -> list[tuple]:
    """An agent's readings per round: (agent, round, step, kind, time, bytes)."""
    return ([(f"a{i}", r, 0, "assign", t, 1) for i, t in enumerate(assign)]
            + [(f"a{i}", r, 4, "weights", t, 0) for i, t in enumerate(weights)])


def test_the_time_between_rounds_its_share_and_amdahls_bound(coordinator_load):
    # round 1 ends at 9.0; round 2's assignments reach its agents by 10.0 and 10.5, ...
    times = (_round(1, [0.0, 0.5], [8.0, 9.0]) + _round(2, [10.0, 10.5], [18.0, 19.0])
             + _round(3, [20.5, 21.0], [28.0, 29.0]))
    t0, t1 = 10.0, 29.0        # the measured window: round 2's first assignment to round 3's last weights
    got = coordinator_load.round_boundaries(times, t0, t1)
    # between 1 and 2: 9.0 -> 10.5, of which 10.0 -> 10.5 in the window; between 2 and 3: 19.0 -> 21.0
    b = (0.5 + 2.0) / 19.0
    assert got["boundary_pct"] == pytest.approx(100 * b)
    assert got["boundary_ms_p50"] == pytest.approx(2000.0)     # only boundaries wholly measured
    assert got["amdahl_4"] == pytest.approx(1 / (b + (1 - b) / 4))
    assert 1 < got["amdahl_4"] < 4


def test_the_score_the_workers_share_is_not_counted_serial(coordinator_load):
    """Of the time between rounds, the score of the model is split among the server workers: only
    the rest bounds them. Counted serial, the bound would lie below what four workers can reach."""
    times = (_round(1, [0.0, 0.5], [8.0, 9.0]) + _round(2, [10.0, 10.5], [18.0, 19.0])
             + _round(3, [20.5, 21.0], [28.0, 29.0]))
    got = coordinator_load.round_boundaries(times, 10.0, 29.0, scored_s=0.95)
    b, scored = 2.5 / 19.0, 0.95 / 19.0
    assert got["boundary_pct"] == pytest.approx(100 * b)
    assert got["scored_pct"] == pytest.approx(100 * scored)
    assert got["serial_pct"] == pytest.approx(100 * (b - scored))
    assert got["amdahl_4"] == pytest.approx(1 / (b - scored + (1 - b + scored) / 4))
    assert got["amdahl_4"] > coordinator_load.round_boundaries(times, 10.0, 29.0)["amdahl_4"]
    # a score longer than the time between rounds (clock readings apart) leaves nothing negative
    assert coordinator_load.round_boundaries(times, 10.0, 29.0, scored_s=5.0)["serial_pct"] == 0.0


def test_no_median_from_one_round_and_no_bound_from_several_workers(coordinator_load):
    # one measured round, one agent: the time before its assignment lies outside the window
    times = _round(1, [0.0], [5.0]) + _round(2, [6.0], [11.0])
    one = coordinator_load.round_boundaries(times, 6.0, 11.0)
    assert one["boundary_ms_p50"] is None and one["boundary_pct"] == 0.0
    assert one["amdahl_4"] == pytest.approx(4.0)     # nothing serial in the window: four workers, four times
    two = coordinator_load.round_boundaries(times, 6.0, 11.0, one_worker=False)
    assert two["amdahl_4"] is None     # a share measured with several workers bounds nothing about one


def test_n_server_workers_against_one_at_the_same_load(coordinator_load):
    """``--server-workers 1 2 4``: each count over one worker at the same load level and codec
    setting, beside Amdahl's bound from the one-worker run's serial share; a load level without a
    one-worker run has no comparison."""
    def run(workers: int, agents: int, steps_per_s: float, serial_pct: float = 10.0, level: int = 3) -> dict:
        return {"zstd_level": level, "agents": agents, "server_workers": workers,
                "agent_steps_per_s": steps_per_s, "serial_pct": serial_pct}

    results = [run(1, 100, 600.0, serial_pct=20.0), run(2, 100, 900.0), run(4, 100, 1500.0),
               run(1, 500, 700.0, serial_pct=0.0), run(4, 500, 2100.0), run(2, 100, 800.0, level=0)]
    got = coordinator_load.worker_scaling(results)
    assert [(s["agents"], s["server_workers"]) for s in got] == [(100, 2), (100, 4), (500, 4)]
    assert [s["x_one_worker"] for s in got] == pytest.approx([1.5, 2.5, 3.0])
    assert got[0]["amdahl_bound"] == pytest.approx(1 / (0.2 + 0.8 / 2))
    assert got[1]["amdahl_bound"] == pytest.approx(1 / (0.2 + 0.8 / 4))
    assert got[2]["amdahl_bound"] is None   # no time between rounds measured: no bound from it


def test_set_gives_the_coordinators_run_config_its_settings(coordinator_load, tmp_path):
    """``--set`` pairs become the run config's settings, a dotted key a section's, merged into the
    bench's own settings; a pair without a key and a value is refused."""
    assert coordinator_load.settings(["robust.label_margin=0", "norm_stats.freeze_after=1", "eval_samples=512",
                                      "robust.aggregate=median"]) == {
        "robust": {"label_margin": 0, "aggregate": "median"}, "norm_stats": {"freeze_after": 1}, "eval_samples": 512}
    for bad in ("robust.label_margin", "=1", "robust.=1", "eval_samples="):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            coordinator_load.settings([bad])
    args = SimpleNamespace(model="vgg11", dataset_name="mnist", dataset_root=None, rounds=3, split=4, batch=8, tau=5,
                           codec="fp16", zstd_level=3, window=1, set=["eval_samples=512", "robust.label_margin=0"])
    cfg = yaml.safe_load(coordinator_load.write_config(tmp_path, args, 20, 20).read_text())
    assert cfg["eval_samples"] == 512 and cfg["robust"] == {"label_margin": 0} and cfg["model"] == "vgg11"
