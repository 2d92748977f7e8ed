"""Devices that lie, through the real round engine (``run_simulation`` with attackers from
:mod:`simulation.adversary`): each defense of ``robust:`` bounds the attack and names the liars."""

from __future__ import annotations

import logging

import pytest

from coordinator.engine import RoundFailed
from sfl_core.config.run import run_config_from_dict
from simulation import run_simulation
from simulation.adversary import Attack, poison_data, trigger

ATTACKERS = ("sim-000", "sim-001", "sim-002")   # 30 % of 10


def _run(tmp_path, name: str, attack: Attack | None, rounds: int = 8, per_round: int | None = None, window: int = 1,
         **robust):
    spec = {"run": "robust", "model": "small_cnn", "strategy": "sfl", "server_mode": "merged", "window": window,
            "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 1.0}, "per_round": per_round,
            "fleet": [{"profile": "s2fl-mid-mid", "count": 10}], "rounds": rounds, "batch_size": 16, "lr": 0.05,
            "local_iters": 10, "robust": robust, "output_dir": str(tmp_path / name)}
    attacks = {a: attack for a in ATTACKERS} if attack is not None else None
    return run_simulation(run_config_from_dict(spec), device="cpu", attacks=attacks)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    history, _ = _run(tmp_path_factory.mktemp("clean"), "clean", None)
    assert all("robust" not in r for r in history), [r.get("robust") for r in history]   # the default: nobody flagged
    return history[-1]["accuracy"]


def test_scaled_updates_break_the_plain_average_and_clipping_bounds_them_and_names_the_attackers(tmp_path, clean):
    assert clean > 0.6
    try:        # the plain average blows up: it learns nothing, or every later upload is non-finite
        history, _ = _run(tmp_path, "mean", Attack("scale", factor=1000.0), aggregate="mean")
        collapsed = history[-1]["accuracy"] < 0.2
    except RoundFailed:
        collapsed = True
    assert collapsed
    history, _ = _run(tmp_path, "clip", Attack("scale", factor=1000.0), aggregate="clip")
    assert history[-1]["accuracy"] > clean - 0.1
    for record in history[1:4]:    # flagged three rounds in a row: quarantined, then never selected
        assert set(record["robust"]["clipped"]) == set(ATTACKERS)
        assert all(x > 20 for x in record["robust"]["clipped"].values())   # a change 1000x the others
    assert history[3]["robust"]["quarantined"] == list(ATTACKERS)
    assert all(set(r["selected"]).isdisjoint(ATTACKERS) for r in history[4:])


def test_updates_scaled_x10_pass_under_the_rounds_bound_and_the_peers_bound_names_and_quarantines_them(tmp_path,
                                                                                                        caplog):
    """Every device here gets the same assignment, so they are each other's peers: a tenfold
    change lies under the round's bound (10x) and over the peers' (4x)."""
    with caplog.at_level(logging.WARNING):
        history, _ = _run(tmp_path, "x10", Attack("scale", factor=10.0))
    for record in history[1:4]:
        assert "clipped" not in record["robust"]
        assert set(record["robust"]["clipped_by_peers"]) == set(ATTACKERS)
        assert all(4 < x < 10 for x in record["robust"]["clipped_by_peers"].values())
    assert history[3]["robust"]["quarantined"] == list(ATTACKERS)
    assert all(set(r["selected"]).isdisjoint(ATTACKERS) and "robust" not in r for r in history[4:])
    named = [m for m in caplog.messages if "typical change of its peers" in m]
    assert len(named) == 3 and all("sim-000 (" in m and "\n" not in m for m in named)   # once a round
    from coordinator.web import FleetPage
    rows = {row["agent"]: row for row in FleetPage(tmp_path / "x10").state()["fleet"]}
    assert rows["sim-000"]["flagged"].startswith("round 3: update left out (") and "its peers'" in rows["sim-000"]["flagged"]


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_coordinate_rules_hold_against_scaled_updates(tmp_path, clean, rule):
    history, _ = _run(tmp_path, rule, Attack("scale", factor=1000.0), aggregate=rule)
    assert history[-1]["accuracy"] > clean - 0.1


def test_multi_krum_leaves_out_random_weights_and_names_them(tmp_path, clean):
    history, _ = _run(tmp_path, "krum", Attack("random"), aggregate="multi_krum")
    assert all(r["robust"]["left_out"] == r["robust"]["outliers"] == list(ATTACKERS) for r in history[1:4])
    # with the attackers quarantined Multi-Krum still leaves f devices out, but names no outlier
    assert all(len(r["robust"]["left_out"]) == 2 and not r["robust"]["outliers"] for r in history[4:])
    assert history[-1]["accuracy"] > clean - 0.1


def test_replaced_weights_are_left_out_whatever_the_rounds_typical_change(tmp_path, clean, caplog):
    """Random weights stay out where the bound on the typical change would let them in (a fleet
    stuck at chance, whose honest changes grow; here a clip factor too large to be reached)."""
    with caplog.at_level(logging.WARNING):
        history, _ = _run(tmp_path, "replaced", Attack("random"), aggregate="clip", clip_factor=1e6)
    for record in history[1:4]:
        assert set(record["robust"]["replaced"]) == set(ATTACKERS) and "clipped" not in record["robust"]
        assert all(x > 1.2 for x in record["robust"]["replaced"].values())   # about sqrt(2): a fresh draw
    assert history[3]["robust"]["quarantined"] == list(ATTACKERS)
    assert all(set(r["selected"]).isdisjoint(ATTACKERS) for r in history[4:])
    assert any("as large as the weights it started from" in m and "sim-000" in m for m in caplog.messages)
    assert history[-1]["accuracy"] > clean - 0.1


def test_non_finite_weights_are_refused_the_sender_named_and_quarantined(tmp_path, clean, caplog):
    """Refused at decoding, each round they are sent in; flagged like a clipped update, so a
    device that sends them round after round stops taking honest devices' places."""
    with caplog.at_level(logging.WARNING):
        history, _ = _run(tmp_path, "nan", Attack("nan"))
    assert all(set(r["completed"]).isdisjoint(ATTACKERS) for r in history[1:])
    for record in history[1:4]:
        assert record["rejected"].get("invalid", 0) >= 3
        assert record["robust"]["refused"] == {a: "invalid weights" for a in ATTACKERS}
    assert history[3]["robust"]["quarantined"] == list(ATTACKERS)
    assert all(set(r["selected"]).isdisjoint(ATTACKERS) and "robust" not in r for r in history[4:])
    named = [m for m in caplog.messages if "weights from sim-000" in m]
    assert named and all("\n" not in m for m in named)
    assert any("sim-000" in m and "quarantine" in m and "refused" in m for m in caplog.messages)
    from coordinator.web import FleetPage
    rows = {row["agent"]: row for row in FleetPage(tmp_path / "nan").state()["fleet"]}
    assert rows["sim-000"]["flagged"] == "round 3: refused (invalid weights)"
    assert history[-1]["accuracy"] > clean - 0.1


def test_poisoned_activations_are_left_out_of_the_server_step_by_default_and_the_senders_named(tmp_path, clean, caplog):
    attack = Attack("activations", factor=10.0, noise=1.0)
    with caplog.at_level(logging.WARNING):
        history, engine = _run(tmp_path, "activations", attack)
    for record in history[1:4]:   # every step of theirs screened out, their updates too; nobody else
        assert record["robust"]["rows_left_out"] == {a: 10 for a in ATTACKERS}
        assert all(x > 4 for x in record["robust"]["activation_scale"].values())
        assert not record["robust"].get("clipped")
    assert history[3]["robust"]["quarantined"] == list(ATTACKERS)
    assert all("robust" not in r or not r["robust"].get("rows_left_out") for r in history[4:])
    named = [m for m in caplog.messages if "rows of sim-000 left out of the server's step" in m]
    assert len(named) == 3 and all("\n" not in m for m in named)    # once a round, not once a step
    from coordinator.web import FleetPage
    rows = {row["agent"]: row for row in FleetPage(tmp_path / "activations").state()["fleet"]}
    assert rows["sim-000"]["flagged"].startswith("round 3: rows left out (activations")
    assert history[-1]["accuracy"] > clean - 0.1


def test_with_steps_in_flight_the_screens_and_the_clip_name_the_same_devices_and_leave_out_the_same_steps(tmp_path):
    """A window (docs/methods/pipeline.md) changes when a device's activations arrive, not what
    the screens see: each step is still judged on its own rows, each update on its own change.
    Poisoned activations, flipped labels and updates x1000, with 4 steps in flight, are caught
    as in lock-step: every step of theirs left out, their senders quarantined, nobody else
    named, and the model learns (chance is 0.1; updates x1000 left in leave it there)."""
    cases = {"activations": Attack("activations", factor=10.0, noise=1.0), "label_flip": Attack("label_flip"),
             "scale": Attack("scale", factor=1000.0)}
    for name, attack in cases.items():
        history, _ = _run(tmp_path, f"{name}-window-4", attack, window=4)
        assert {a["window"] for r in history[1:] for a in r["agents"].values()} == {4}
        quarantined: dict[str, int] = {}
        for record in history[1:]:
            found = record.get("robust", {})
            named = set(found.get("rows_left_out", {})) | set(found.get("clipped", {}))
            assert named <= set(ATTACKERS), (name, record["round"], found)
            assert all(n == 10 for n in found.get("rows_left_out", {}).values())   # every step, not some
            assert not set(record["selected"]) & set(quarantined)
            quarantined.update({a: record["round"] for a in found.get("quarantined", [])})
        assert sorted(quarantined) == list(ATTACKERS), (name, quarantined)
        assert history[-1]["accuracy"] > 0.4, name


def _attack_rates(engine):
    """The global model's share of digits' test images sent to the flipped class, and of
    triggered images of other classes sent to the backdoor's target (0)."""
    import torch

    from sfl_core.data.builtin import load_dataset

    data = load_dataset("digits")
    model = engine.model.eval()
    with torch.no_grad():
        flipped = float((model(data.x_test).argmax(1) == 9 - data.y_test).float().mean())
        others = data.y_test != 0
        backdoor = float((model(trigger(data.x_test[others], 3)).argmax(1) == 0).float().mean())
    return flipped, backdoor


@pytest.mark.parametrize("kind", ["label_flip", "backdoor"])
def test_labels_that_disagree_with_the_inputs_are_screened_out_by_default_and_the_senders_named(tmp_path, clean,
                                                                                             caplog, kind):
    with caplog.at_level(logging.WARNING):
        history, engine = _run(tmp_path, kind, Attack(kind))
    quarantined: dict[str, int] = {}
    for record in history:   # judged on their first step, left out of every step from there; nobody else
        found = record.get("robust", {})
        assert set(found.get("label_mismatch", {})) <= set(ATTACKERS)
        assert all(x > 0.3 for x in found.get("label_mismatch", {}).values())
        assert all(found["rows_left_out"][a] == 10 for a in found.get("label_mismatch", {}))
        assert not found.get("activation_scale")
        assert not set(record["selected"]) & set(quarantined)
        quarantined.update({a: record["round"] for a in found.get("quarantined", [])})
    assert sorted(quarantined) == list(ATTACKERS) and max(quarantined.values()) <= 6
    assert history[2]["robust"]["rows_left_out"].keys() >= {"sim-000", "sim-002"}
    named = [m for m in caplog.messages if "rows of sim-000 left out of the server's steps" in m]
    assert len(named) >= 2 and all("labels disagree with its inputs" in m and "\n" not in m for m in named)
    from coordinator.web import FleetPage
    rows = {row["agent"]: row for row in FleetPage(tmp_path / kind).state()["fleet"]}
    assert "rows left out (labels disagree" in rows["sim-000"]["flagged"] and rows["sim-005"]["flagged"] == ""
    assert history[-1]["accuracy"] > clean - 0.1
    screened = _attack_rates(engine)
    _, unscreened = _run(tmp_path, f"{kind}-unscreened", Attack(kind), label_margin=0)
    plain = _attack_rates(unscreened)
    i = 0 if kind == "label_flip" else 1   # the attack's own success rate
    assert plain[i] > screened[i] + 0.1, (plain, screened)


def test_where_the_devices_layers_hold_batchnorm_the_label_screen_matches_each_devices_mix_by_default(tmp_path):
    spec = {"run": "robust", "model": "vgg_mini:width=0.25", "strategy": "sfl", "server_mode": "merged",
            "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 1.0},
            "fleet": [{"profile": "s2fl-mid-mid", "count": 10}], "rounds": 2, "batch_size": 16, "lr": 0.05,
            "local_iters": 4, "output_dir": str(tmp_path / "bn")}
    history, _ = run_simulation(run_config_from_dict(spec), device="cpu",
                                attacks={a: Attack("label_flip") for a in ATTACKERS})
    # judged on 16 rows a flipper may pass its first round (chance's exact tail over so few rows);
    # by its second, pooled, it is named; no honest device ever is
    assert all(set(r["robust"]["label_mismatch"]) <= set(ATTACKERS) for r in history[1:])
    assert set(history[-1]["robust"]["label_mismatch"]) == set(ATTACKERS)
    spec.update(robust={"label_margin": 0}, output_dir=str(tmp_path / "bn-off"))   # off where set so
    history, _ = run_simulation(run_config_from_dict(spec), device="cpu",
                                attacks={a: Attack("label_flip") for a in ATTACKERS})
    assert all(not r.get("robust", {}).get("label_mismatch") for r in history)


def test_the_label_screen_runs_the_client_portion_as_the_devices_normalise(tmp_path):
    """Frozen statistics (FixBN): the held-out rows are normalised with the model's statistics as
    the devices' are, and flippers are still named; the devices' own BatchNorm layers (FedBN):
    nothing the coordinator runs is what a device runs, so nobody is judged by it."""
    spec = {"run": "robust", "model": "vgg_mini:width=0.25", "strategy": "sfl", "server_mode": "merged",
            "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 1.0},
            "fleet": [{"profile": "s2fl-mid-mid", "count": 10}], "rounds": 3, "batch_size": 16, "lr": 0.05,
            "local_iters": 4, "norm_stats": {"freeze_after": 1}, "output_dir": str(tmp_path / "frozen")}
    history, _ = run_simulation(run_config_from_dict(spec), device="cpu",
                                attacks={a: Attack("label_flip") for a in ATTACKERS})
    assert all(set(r["robust"]["label_mismatch"]) == set(ATTACKERS) for r in history[2:])
    # the demo's skewed four, on their own layers: judged against the model's, two were flagged
    import yaml

    from sfl_core.config.profiles import default_profiles_dir

    demo = yaml.safe_load((default_profiles_dir() / "runs" / "demo.yaml").read_text())
    demo.update(model="vgg_mini:width=0.5", rounds=2, norm_stats={"freeze_after": 1, "local": True},
                output_dir=str(tmp_path / "own"))
    history, _ = run_simulation(run_config_from_dict(demo), device="cpu")
    assert all(not r.get("robust", {}).get("label_mismatch") for r in history)


def test_the_score_of_a_round_makes_the_next_rounds_held_out_rows_and_changes_nothing(tmp_path, monkeypatch):
    """Scored every round, the model's client portion (no dropout, no BatchNorm) is run over the
    held-out set once a round: the screens of the next round read the rows the score made on the
    way, and the run, flippers named and all, is the same as where the screens make their own."""
    from coordinator.option_host import OptionHost

    ran: list[int] = []
    original = OptionHost._run_portion
    monkeypatch.setattr(OptionHost, "_run_portion",
                        lambda self, split, index, by_batch: ran.append(len(index)) or original(self, split, index, by_batch))
    attack = Attack("label_flip")
    shared, _ = _run(tmp_path, "shared", attack, rounds=3)
    assert len(ran) == 2   # round 1's screens (the sizes screen's first rows, then the rest); none after
    monkeypatch.setattr(OptionHost, "cut_to_keep", lambda self: None)
    own, _ = _run(tmp_path, "own", attack, rounds=3)
    assert len(ran) == 2 + 2 * 3
    assert [r["accuracy"] for r in shared] == [r["accuracy"] for r in own]
    assert [r.get("robust") for r in shared] == [r.get("robust") for r in own]
    assert set(shared[-1]["robust"]["label_mismatch"]) == set(ATTACKERS)


def test_a_claimed_sample_count_is_capped_by_default_and_named(tmp_path):
    history, engine = _run(tmp_path, "claim", Attack("claim", factor=1000.0), rounds=1)
    capped = history[-1]["robust"]["capped"]
    assert set(capped) == set(ATTACKERS)
    assert all(engine.registry.agents[a].num_samples == capped[a] for a in ATTACKERS)
    history, _ = _run(tmp_path, "claim-uncapped", Attack("claim", factor=1000.0), rounds=1, weight_cap=0)
    assert "robust" not in history[-1]


def test_claims_are_capped_against_the_fleets_median_even_in_a_round_the_liars_hold_half_of(tmp_path):
    """Four of ten a round, three of them lying: a round the liars hold half of has a liar's
    claim for its median. The cap's median is over every registered agent's claim, so every
    liar selected is capped, in every round."""
    history, _ = _run(tmp_path, "claim-rounds", Attack("claim", factor=1000.0), rounds=8, per_round=4, quarantine=0)
    held = 0
    for record in history[1:]:
        liars = set(ATTACKERS) & set(record["selected"])
        held += len(liars) >= 2
        assert liars == set(record.get("robust", {}).get("capped", {})), (record["selected"], record.get("robust"))
    assert held, "no round drew two liars: the case is not exercised"


def test_a_large_claim_short_of_implausible_is_capped_and_named_every_round_but_never_quarantined(tmp_path, caplog):
    """A device of a skewed fleet can honestly hold many times the median's data: capping bounds
    what it weighs, and only a claim over IMPLAUSIBLE times the cap counts towards quarantine."""
    from sfl_core.options.robust.option import IMPLAUSIBLE

    with caplog.at_level(logging.WARNING):
        history, engine = _run(tmp_path, "large", Attack("claim", factor=30.0), rounds=5)
    assert any("weight capped" in m for m in caplog.messages)
    assert not any("towards quarantine" in m for m in caplog.messages)
    for record in history[1:]:
        capped = record["robust"]["capped"]
        assert set(capped) == set(ATTACKERS) and "quarantined" not in record["robust"]
        median = sorted(engine.registry.agents[a].num_samples for a in record["selected"])[4:6]
        assert all(10 * sum(median) / 2 < c < IMPLAUSIBLE * 10 * sum(median) / 2 for c in capped.values())
        assert set(ATTACKERS) <= set(record["completed"])
    assert not any(engine.registry.agents[a].quarantined for a in ATTACKERS)


def test_data_attacks_poison_what_the_attacker_trains_on():
    import torch

    x, y = torch.rand(10, 1, 8, 8), torch.arange(10)
    assert poison_data(x, y, 10, Attack("label_flip"))[1].tolist() == list(range(9, -1, -1))
    px, py = poison_data(x, y, 10, Attack("backdoor", target=3, share=0.5, size=2), torch.Generator().manual_seed(0))
    marked = (px != x).flatten(1).any(dim=1)
    assert int(marked.sum()) == 5 and bool((py[marked] == 3).all()) and torch.equal(py[~marked], y[~marked])
    assert bool((px[marked][..., -2:, -2:] == x.amax()).all())
    assert torch.equal(px[marked][..., :-2, :], x[marked][..., :-2, :])   # only the corner changes
    assert torch.equal(trigger(torch.zeros(1, 1, 4, 4), 2), torch.zeros(1, 1, 4, 4))
    one = poison_data(x[:1], y[:1], 10, Attack("backdoor", share=0.4))   # 0.4 of one sample: none triggered
    assert torch.equal(one[0], x[:1]) and torch.equal(one[1], y[:1])


def test_a_device_flagged_round_after_round_is_quarantined_until_an_operator_readmits_it(tmp_path, caplog):
    from typer.testing import CliRunner

    from cli.coord import app

    with caplog.at_level(logging.WARNING):
        history, engine = _run(tmp_path, "q", Attack("claim", factor=1000.0), rounds=4)
    assert [sorted(r.get("robust", {}).get("quarantined", [])) for r in history[1:]] == [[], [], list(ATTACKERS), []]
    assert set(history[4]["selected"]).isdisjoint(ATTACKERS) and len(history[4]["selected"]) == 7
    assert all("3 of its rounds in a row" in engine.registry.agents[a].quarantined for a in ATTACKERS)
    assert any("over 10x the cap, counted towards quarantine: sim-000, sim-001, sim-002" in m for m in caplog.messages)
    line = next(m for m in caplog.messages if m.startswith("quarantined sim-000"))
    assert "sfl-coord agents readmit" in line and "\n" not in line
    run_dir = tmp_path / "q"
    listed = CliRunner().invoke(app, ["agents", "list", str(run_dir)])
    assert listed.exit_code == 0 and "sim-000  rounds 3  quarantined: flagged" in listed.output
    assert "10 agent(s), 3 quarantined" in listed.output
    from coordinator.web import FleetPage
    rows = {row["agent"]: row for row in FleetPage(run_dir).state()["fleet"]}   # the fleet page names them too
    assert all(rows[a]["quarantined"].startswith("flagged by robust") for a in ATTACKERS)
    assert rows["sim-000"]["flagged"].startswith("round 3: weight capped") and rows["sim-005"]["flagged"] == ""
    assert not rows["sim-005"]["quarantined"]
    assert CliRunner().invoke(app, ["agents", "readmit", str(run_dir), "sim-009"]).exit_code == 0   # not quarantined
    assert CliRunner().invoke(app, ["agents", "readmit", str(run_dir), "nobody"]).exit_code == 2
    res = CliRunner().invoke(app, ["agents", "readmit", str(run_dir), "sim-001"])
    assert res.exit_code == 0 and "readmission of sim-001 requested" in res.output
    assert "(readmission requested)" in CliRunner().invoke(app, ["agents", "list", str(run_dir)]).output
    # the run resumed: the readmitted agent is selected again; the others stay out
    spec = {"run": "robust", "model": "small_cnn", "strategy": "sfl", "server_mode": "merged",
            "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 1.0},
            "fleet": [{"profile": "s2fl-mid-mid", "count": 10}], "rounds": 5, "batch_size": 16, "lr": 0.05,
            "local_iters": 10, "output_dir": str(run_dir)}
    with caplog.at_level(logging.WARNING):
        resumed, engine = run_simulation(run_config_from_dict(spec), resume=True, device="cpu",
                                         attacks={a: Attack("claim", factor=1000.0) for a in ATTACKERS})
    assert "sim-001" in resumed[-1]["selected"] and {"sim-000", "sim-002"}.isdisjoint(resumed[-1]["selected"])
    assert any(m.startswith("readmitted sim-001 at an operator's request") for m in caplog.messages)
    assert not (run_dir / "readmit" / "sim-001").exists()


def test_a_rounds_flagged_agents_are_every_named_one_but_the_capped():
    """What counts towards quarantine, read back from a round's metrics (the benches count false
    positives with it): a capped claim alone accuses nobody, scores and scales are no verdicts."""
    from sfl_core.options.robust.option import flagged_in

    metrics = {"capped": {"a": 10.0}, "clipped": {"b": 2.0}, "rows_left_out": {"c": 1}, "refused": {"d": "NaN"},
               "outliers": ["e"], "replaced": {"f": 1.1}, "clipped_by_peers": {"g": 5.0},
               "scores": {"h": 1.0}, "label_mismatch": {"c": 0.3}, "quarantined": ["b"]}
    assert flagged_in(metrics) == {"b", "c", "d", "e", "f", "g"}
    assert flagged_in({}) == set() and flagged_in({"capped": {"a": 1e6}}) == set()
