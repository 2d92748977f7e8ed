"""bench/regimes.py: the time model of each method (pure functions) and a --quick end-to-end run
(tiny real training on the bundled digits, then the sweep; numbers not meaningful)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import bench_module

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"


@pytest.fixture(scope="module")
def regimes():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))      # the bench scripts import their helpers as 'common'
    return bench_module("regimes")


def workload(regimes, model="resnet8", split=4, shape=(3, 32, 32)):
    return regimes.Workload(model, split, shape, batch=32, tau=5, server_flops=5e10)


def test_fleet_axes(regimes):
    fleet = regimes.make_fleet(16, 4, 10, 1e10, 2e6)
    comp, link = [c for c, _ in fleet], [r for _, r in fleet]
    assert max(comp) / min(comp) == pytest.approx(16) and max(link) / min(link) == pytest.approx(4)
    assert math.prod(comp) ** 0.1 == pytest.approx(1e10) and math.prod(link) ** 0.1 == pytest.approx(2e6)
    assert sorted(regimes.pairing(10)) == list(range(10))
    assert regimes.make_fleet(1, 1, 10, 1e10, 2e6) == [(1e10, 2e6)] * 10


def test_fedavg_round_grows_with_weight_bytes(regimes):
    w = workload(regimes)
    fleet = regimes.make_fleet(4, 4, 10, 1e10, 2e6)
    base = regimes.fedavg_round(w, fleet)["round_s"]
    whole = w.costs[w.whole]
    w.costs[w.whole] = dataclasses.replace(whole, client_param_bytes=2 * whole.client_param_bytes)
    bigger = regimes.fedavg_round(w, fleet)["round_s"]
    # the same agent stays slowest here: 2|W| more bytes over its link
    assert bigger > base
    assert bigger - base <= 2 * whole.client_param_bytes / min(r for _, r in fleet) + 1e-9


def test_methods_on_a_homogeneous_fleet_reduce_to_sfl(regimes):
    w = workload(regimes, "resnet8", 3)
    fleet = regimes.make_fleet(1, 1, 10, 1e10, 2e6)
    sfl = regimes.sfl_round(w, fleet)["round_s"]
    assert regimes.fedfc_round(w, fleet)["round_s"] == pytest.approx(sfl)
    merge = regimes.mergesfl_round(w, fleet)
    assert merge["round_s"] == pytest.approx(sfl, rel=1e-6) and set(merge["batches"]) == {32.0}
    het = regimes.hetero_round(w, fleet)
    assert het["compression"] == 1 and set(het["widths"]) == {het["full_width"]}
    s2 = regimes.s2fl_round(w, fleet)
    assert len(set(s2["splits"])) == 1 and s2["splits"][0] in w.candidates
    assert s2["round_s"] == pytest.approx(regimes.sfl_round(w, fleet, s2["splits"][0])["round_s"])


def test_mergesfl_batches_equalise_and_keep_samples(regimes):
    w = workload(regimes, "resnet8", 3)
    fleet = regimes.make_fleet(16, 16, 10, 1e10, 2e6)
    plan = regimes.mergesfl_round(w, fleet)
    assert sum(plan["batches"]) == pytest.approx(32 * 10, rel=1e-3)
    times = [regimes.agent_time(w, w.split, c, r, samples=5 * b) for (c, r), b in zip(fleet, plan["batches"])]
    assert max(times) == pytest.approx(plan["round_s"], rel=1e-3)   # the JSON keeps batches to 2 decimals
    assert min(times) == pytest.approx(max(times), rel=1e-3)    # nobody at the 1-sample floor here
    assert plan["round_s"] < regimes.sfl_round(w, fleet)["round_s"]


def test_s2fl_median_rule_and_fedfc_classes(regimes):
    w = workload(regimes, "resnet8", 3)
    fleet = regimes.make_fleet(64, 1, 9, 1e10, 2e6)
    plan = regimes.s2fl_round(w, fleet)
    times = {(i, s): regimes.agent_time(w, s, c, r) for i, (c, r) in enumerate(fleet) for s in w.candidates}
    med = sorted(times.values())[len(times) // 2]
    for i, s in enumerate(plan["splits"]):
        assert abs(times[i, s] - med) == pytest.approx(min(abs(times[i, k] - med) for k in w.candidates))
    assert regimes.fedfc_splits([1, 8, 64], (2, 4, 7), 7) == [2, 4, 7]
    assert regimes.fedfc_splits([5, 5], (2, 4, 7), 7) == [7, 7]
    assert regimes.fedfc_round(w, fleet)["splits"] == sorted(regimes.fedfc_round(w, fleet)["splits"])
    assert regimes.time_to_target("S2FL", {"warmup_round_s": [1.0, 2.0, 3.0], "round_s": 0.5}, 5) == 7.0


def test_hetero_rounds_interpolation(regimes):
    runs = {"a": {"compression": 2.0, "rounds": 10}, "b": {"compression": 16.0, "rounds": 16}}
    assert regimes.hetero_rounds(1.0, runs) == 10 and regimes.hetero_rounds(64.0, runs) == 16
    assert regimes.hetero_rounds(math.sqrt(32), runs) == pytest.approx(13)


def test_quick_run_writes_consistent_json(regimes, tmp_path):
    threads = torch.get_num_threads()
    try:
        regimes.main(["--quick", "--data", "digits", "--out", str(tmp_path), "--work", str(tmp_path / "runs")])
    finally:
        torch.set_num_threads(threads)
    doc = json.loads((tmp_path / "regimes-quick.json").read_text())
    rtt = doc["rounds_to_target"]
    assert set(rtt["methods"]) == set(regimes.BENCH_METHODS)
    assert all(v["rounds"] >= 1 for v in rtt["methods"].values())
    for m, runs in doc["training"]["runs"].items():
        for run in runs:
            assert run["config"]["rounds"] == 2 and [r["round"] for r in run["curve"]] == [0, 1, 2]
    assert doc["training"]["runs"]["FedFC"][0]["config"]["profile_splits"]
    for m in ("FedAvg", "SFL", "HeteroSFL", "FedFC"):      # the time model charges what the engine charges
        assert doc["engine_check"][m]["engine_over_model"] == pytest.approx(1.0, abs=0.15)
    assert [p["name"] for p in doc["panels"]] == ["resnet8@4", "small_cnn@3"]   # sorted by rho
    assert doc["panels"][0]["rho"] < doc["panels"][1]["rho"]
    for panel in doc["panels"]:
        assert len(panel["cells"]) == 4
        for cell in panel["cells"]:
            t = {m: v["time_to_target_s"] for m, v in cell["methods"].items()}
            assert set(t) == set(regimes.METHODS) and all(x > 0 for x in t.values())
            assert all(v["round_s"] > 0 for v in cell["methods"].values())
            assert cell["winner"] == min(t, key=t.get) and cell["ranking"][0] == cell["winner"]
            assert cell["speedup_vs_runner_up"] >= 1 and cell["speedup_vs_fedavg"] >= 1
            assert cell["speedup_vs_fedavg"] == pytest.approx(t["FedAvg"] / t[cell["winner"]])
    # FedAvg moves the whole model: a bigger link spread slows its slowest agent down
    fa = {(c["compute_ratio"], c["link_ratio"]): c["methods"]["FedAvg"]["round_s"] for c in doc["panels"][1]["cells"]}
    assert fa[1.0, 16.0] > fa[1.0, 1.0]
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "regimes-quick.png").stat().st_size > 0
