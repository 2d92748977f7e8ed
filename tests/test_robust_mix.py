"""The mix of classes a device registered, checked against the labels it sends
(:mod:`sfl_core.options.robust.mix`, ``robust.mix_limit``): honest devices' labels, drawn by
the agent's own sampler from the package's label-skewed shards, stay under the limit; a claim
its labels refute is named, counted towards quarantine and replaced for the planners; and under
MergeSFL's selection by label mix, two devices claiming an even mix no longer take the rounds."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_agent.agent import BatchSampler
from simulation.adversary import Attack
from simulation.run import run_simulation
from sfl_core.config.run import run_config_from_dict
from sfl_core.data.builtin import load_dataset
from sfl_core.data.partition import label_counts, shard_for_agent
from sfl_core.options.robust.config import RobustConfig
from sfl_core.options.robust.mix import deviations, shown_mix

LIMIT = RobustConfig().mix_limit


def test_honest_devices_labels_stay_under_the_limit_on_skewed_shards():
    """Every device of 20-device Dirichlet 0.1 and 0.5 partitions of the digits (seeds 0-4), its
    labels of 1 to 12 rounds of 10 steps of batches of 4 to 32 as its sampler draws them: far
    under the limit (the worst is under 4; a refuted claim is over 5)."""
    y = load_dataset("digits").y_train.numpy()
    worst = -math.inf
    for alpha in (0.1, 0.5):
        for seed in range(5):
            for i in range(20):
                idx = shard_for_agent(y, i, 20, "dirichlet", alpha=alpha, seed=seed, num_classes=10)
                mine = y[idx]
                claimed = label_counts(mine, 10)
                sampler = BatchSampler(len(mine), seed=seed * 1000 + i)
                sent = np.zeros(10, dtype=int)
                for rounds in range(1, 13):
                    batch = 4 * (1 + (i + rounds) % 8)
                    for _ in range(10):
                        sent += np.bincount(mine[sampler.next(batch).numpy()], minlength=10)
                    worst = max(worst, deviations(claimed, sent.tolist()))
    assert worst < LIMIT - 1, worst


def test_a_claim_the_labels_refute_lies_far_over_the_limit():
    held = [120, 0, 0, 25, 0, 0, 0, 0, 15, 0]
    even = [16] * 10
    sent = [96, 0, 0, 21, 0, 0, 0, 0, 11, 0]      # one round's labels drawn from what it holds
    assert deviations(held, sent) < 2
    assert deviations(even, sent) > 3 * LIMIT
    assert deviations(held, [*sent[:1], 1, *sent[2:]]) == math.inf   # a class it claimed none of
    assert deviations(held, [0] * 10) == 0.0 and deviations([5, 0, 0], [9, 0, 0]) == 0.0


def test_the_mix_shown_keeps_the_claimed_total():
    assert shown_mix([96, 0, 0, 21, 0, 0, 0, 0, 11, 0], 160) == [120, 0, 0, 26, 0, 0, 0, 0, 14, 0]
    assert sum(shown_mix([1, 1, 1], 10)) == 10
    with pytest.raises(ValueError):
        shown_mix([0, 0], 5)


def _mergesfl(tmp_path: Path, name: str, **robust) -> dict:
    return run_config_from_dict({
        "run": name, "model": "small_cnn", "strategy": "sfl", "server_mode": "merged",
        "mergesfl": {"select": True, "regulate": True, "max_agents": 5},
        "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.1, "seed": 0},
        "fleet": [{"profile": "s2fl-mid-mid", "count": 20}], "rounds": 12, "batch_size": 16, "lr": 0.05,
        "local_iters": 10, "seed": 0, "output_dir": str(tmp_path / name), **({"robust": robust} if robust else {})})


def test_devices_claiming_an_even_mix_no_longer_take_mergesfls_rounds(tmp_path, caplog):
    """Two of twenty devices register their samples as an even mix of the ten classes and train
    honestly on what they hold (a few classes). MergeSFL's KL selection, which picks the devices
    whose merged mix is nearest the fleet's, takes them in most rounds with the check off, and
    the model learns little beyond their classes. With the default, their first round's labels
    refute the claim: each is named in the first round it takes part in, planned from then on by the
mix it showed, and seldom picked again;
    the run learns as the honest fleet does."""
    liars = ["sim-000", "sim-001"]
    attacks = {a: Attack("even_mix") for a in liars}

    off, _ = run_simulation(_mergesfl(tmp_path, "off", mix_limit=0), device="cpu", attacks=attacks)
    with caplog.at_level("WARNING", logger="sfl.coord"):
        checked, engine = run_simulation(_mergesfl(tmp_path, "on"), device="cpu", attacks=attacks)
    honest, _ = run_simulation(_mergesfl(tmp_path, "honest"), device="cpu")

    def their_rounds(history: list[dict]) -> int:
        return sum(a in r["selected"] for r in history[1:] for a in liars)

    assert their_rounds(off) >= 12, [r["selected"] for r in off]             # of 24 liar-rounds
    assert off[-1]["accuracy"] < honest[-1]["accuracy"] - 0.3, (off[-1]["accuracy"], honest[-1]["accuracy"])
    assert their_rounds(checked) <= 4, [r["selected"] for r in checked]
    assert checked[-1]["accuracy"] > honest[-1]["accuracy"] - 0.05, (checked[-1]["accuracy"], honest[-1]["accuracy"])
    refuted = {a: r["round"] for r in checked for a in (r.get("robust") or {}).get("mix_refuted", {})}
    first = {a: min(r["round"] for r in checked[1:] if a in r["selected"]) for a in liars}
    assert refuted == first, (refuted, first)      # each in the first round it took part in
    assert not any((r.get("robust") or {}).get("mix_refuted") for r in honest)
    lines = [rec.getMessage() for rec in caplog.records if "the mix of classes" in rec.getMessage()]
    assert len(lines) == 2 and all("disagrees with the labels it sent" in x for x in lines), lines
    for a in liars:   # the planners now read what it holds, its claimed total kept
        info = engine.registry.agents[a]
        assert sum(info.label_counts) == info.num_samples and max(info.label_counts) > info.num_samples // 3
    from coordinator.web import FleetPage   # the operator's fleet page names them until they are cleared
    rows = {row["agent"]: row for row in FleetPage(tmp_path / "on").state()["fleet"]}
    for a in liars:   # a round it takes part in later, unflagged, clears it
        later = any(a in r["selected"] for r in checked if r["round"] > refuted[a])
        assert later or "its registered mix of classes refuted by its labels" in rows[a]["flagged"], rows[a]
    assert all(rows[a]["flagged"] == "" for a in rows if a not in liars)


def test_a_server_workers_label_counts_reach_the_leaders_check():
    """With server workers each counts the labels of its own agents' rows; the leader adds the
    workers' counts (a malformed one is named and ignored) and checks every agent's claim at
    the round's end, correcting the registry the planners read."""
    from types import SimpleNamespace

    from coordinator.option_host import OptionHost
    from sfl_core.model.zoo import build_model
    from sfl_core.options.robust.option import Robust

    class Host(OptionHost):
        def __init__(self, robust, fleet):
            self.options, self.lines = [robust], []
            self.registry = SimpleNamespace(agents=fleet)
            self.model = build_model("small_cnn", (1, 8, 8), 10)

        def log(self, text, *, warning=False):
            self.lines.append(text)

        def quarantine(self, agent_id, why):
            self.lines.append(f"quarantined {agent_id}")

    fleet = {"even": SimpleNamespace(label_counts=[10] * 10, num_samples=100),
             "true": SimpleNamespace(label_counts=[60, 40] + [0] * 8, num_samples=100)}
    robust = Robust(run_config_from_dict({"model": "small_cnn", "min_agents": 2}), build_model("small_cnn", (1, 8, 8), 10))
    host = Host(robust, fleet)
    robust._start_round(1)
    host.merge_worker_findings(1, [{"robust": {"sent": {"even": [50, 30] + [0] * 8, "true": [31, 19] + [0] * 8}}},
                                   {"robust": {"sent": {"even": [10, 10] + [0] * 8, "bad": [1, -1]}}}])
    assert robust.sent == {"even": [60, 40] + [0] * 8, "true": [31, 19] + [0] * 8}
    assert sum("malformed" in line for line in host.lines) == 1
    assignments = {a: SimpleNamespace(mode="split", split=1, width=0, batch_size=4, tau=2, window=1, lr=0.1)
                   for a in fleet}
    start = {"w": torch.zeros(3)}
    clients = {a: {"w": torch.full((3,), 0.1)} for a in fleet}
    robust.screen(host, 1, start, clients, {a: 1.0 for a in fleet}, assignments, {})
    assert list(robust.round_metrics()["mix_refuted"]) == ["even"]
    assert fleet["even"].label_counts == [60, 40] + [0] * 8 and fleet["true"].label_counts == [60, 40] + [0] * 8
