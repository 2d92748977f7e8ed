"""What a user sees on a first run with an untuned fleet: each rough edge pinned by a test."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli.coord import app
from sfl_core.config.run import default_profiles_dir

RUNNER = CliRunner()


def _run_config(tmp_path: Path, **changes) -> Path:
    """The demo's run config at one fixed cut (strategy sfl), which these tests are about."""
    doc = yaml.safe_load((default_profiles_dir() / "runs" / "demo.yaml").read_text())
    doc.update({"strategy": "sfl", **changes})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_wrong_data_root_names_the_config_file_and_field(tmp_path):
    cfg = _run_config(tmp_path, data={"dataset": "mnist", "root": str(tmp_path / "mnsit")},
                      output_dir=str(tmp_path / "out"))
    res = RUNNER.invoke(app, ["simulate", "-c", str(cfg)], env={"COLUMNS": "300"})
    assert res.exit_code == 2
    line, = [l for l in res.output.splitlines() if "mnsit" in l]
    assert line.startswith(f"{cfg}: field 'data.root': ") and "no such file or directory" in line
    assert "Traceback" not in res.output
    # the --data flag overrides data.root: then the flag is what is named
    res = RUNNER.invoke(app, ["simulate", "-c", str(cfg), "--data", str(tmp_path / "nowhere")], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "--data: " in res.output and "nowhere" in res.output
    assert not (tmp_path / "out").exists()      # nothing was started or written


def test_simulate_summary_shows_the_clocks_seconds_not_the_hosts(tmp_path):
    """In a simulation the per-agent compute/transfer/waiting seconds are the time model's
    (profile FLOP/s, real bytes), identical however busy the host is."""
    import io

    from rich.console import Console

    from simulation import run_simulation
    from coordinator.console import summary_table
    from sfl_core.model.accounting import model_costs
    from sfl_core.config.run import load_run_config

    cfg = load_run_config(_run_config(tmp_path, rounds=2, output_dir=str(tmp_path / "out")))
    history, engine = run_simulation(cfg, device="cpu")
    costs = model_costs(cfg.model, (1, 8, 8), 10)
    for a, info in engine.registry.agents.items():
        rows = [rec["agents"][a] for rec in history if a in rec["agents"]]
        expected = sum(costs[r["split"]].client_flops * r["batch_size"] * cfg.local_iters for r in rows) \
            / info.profile.compute_flops
        assert info.client_s == pytest.approx(expected, rel=1e-3)
        assert info.transfer_s == pytest.approx(sum(r["transfer_s"] for r in rows), abs=1e-3) and info.transfer_s > 0
        assert info.wait_s >= 0
    slowest = max(engine.registry.agents.values(), key=lambda i: i.client_s + i.transfer_s)
    assert slowest.wait_s == pytest.approx(0, abs=1e-3)      # the slowest agent never waits
    out = io.StringIO()
    Console(file=out, width=200).print(summary_table(history, engine.registry))
    text = out.getvalue()
    assert "transfer s" in text and "waiting s" in text and "not this host's time" in text


def test_status_fits_80_columns_and_speaks_json(tmp_path):
    import json

    from simulation import run_simulation
    from sfl_core.config.run import load_run_config

    cfg = load_run_config(_run_config(tmp_path, rounds=2, window=2, output_dir=str(tmp_path / "out")))
    history, _ = run_simulation(cfg, device="cpu")
    res = RUNNER.invoke(app, ["status", str(tmp_path / "out")], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    table = res.output.split("checkpoint after")[0]
    assert "…" not in table and max(map(len, table.splitlines())) <= 80
    for header in ("accuracy", "loss", "elapsed s", "up", "down"):
        assert header in table
    assert "kB" in table or "MB" in table                       # human units, not raw byte counts
    assert str(history[-1]["bytes_up"]) not in table
    # the last round's assignments, one line per kind with the agents given it, in words
    given = res.output.split("each assignment and the agents given it:\n")[1].splitlines()
    split, batch = history[-1]["agents"]["sim-000"]["split"], cfg.batch_size
    assert given == [f"  split {split} b{batch}, window 2: " + ", ".join(sorted(history[-1]["agents"]))], given
    res = RUNNER.invoke(app, ["status", str(tmp_path / "out"), "--format", "json"])
    doc = json.loads(res.output)
    assert [r["accuracy"] for r in doc["rounds"]] == [h["accuracy"] for h in history]
    assert doc["checkpoint"]["round"] == 2
    assert RUNNER.invoke(app, ["status", str(tmp_path / "out"), "--format", "yaml"]).exit_code == 2


def test_profiles_read_in_a_datasheets_units_within_80_columns():
    """The profile names uncut (what ``--profile`` takes), and what decides a window's worth: each
    link's duplex (docs/methods/pipeline.md)."""
    res = RUNNER.invoke(app, ["profiles"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "…" not in res.output and max(map(len, lines)) <= 80
    header, = [l.split() for l in lines if l.split()[:1] == ["name"]]
    assert header == ["name", "GFLOP/s", "up", "Mb/s", "down", "Mb/s", "latency", "duplex", "memory"]
    rows = {l.split()[0]: l.split()[1:] for l in lines if l.split()[:1] in (["jetson-nano"], ["s2fl-server"])}
    assert rows["jetson-nano"] == ["47", "10", "10", "5", "ms", "half", "4", "GiB"]   # 4.7e10, 1.25e6 B/s
    assert rows["s2fl-server"] == ["50", "80", "80", "0", "ms", "full", "-"]


def test_mergesfl_selection_says_per_round_is_unused_and_bounds_the_count(tmp_path):
    import json

    cfg = _run_config(tmp_path, rounds=3, per_round=3, output_dir=str(tmp_path / "out"),
                      mergesfl={"regulate": True, "select": True, "min_agents": 2, "max_agents": 3})
    res = RUNNER.invoke(app, ["simulate", "-c", str(cfg)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    notice, = [l for l in res.output.splitlines() if l.startswith("MergeSFL selection")]
    assert "per_round is not used" in notice and "samples" in notice and "agents per round 2..3" in notice
    rounds = [json.loads(l) for l in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()][1:]
    for rec in rounds:
        assert 2 <= len(rec["selected"]) <= 3 and rec["mergesfl"]["agents"] == len(rec["selected"])
        assert all(a["batch_size"] >= 2 for a in rec["agents"].values())     # the default min_batch
        assert f"{len(rec['completed'])}/{len(rec['selected'])} agents" in res.output


def test_a_costly_default_split_is_named_at_start_and_by_models(tmp_path):
    """vgg_mini's default cut sends 49 KB per sample where the next sends 2.2 KB for similar
    client compute: the run says so in one line, `models --config` marks the fastest cut."""
    from sfl_core.model.accounting import model_costs, split_note
    from sfl_core.model.zoo import build_model

    shape = (1, 28, 28)
    costs = model_costs("vgg_mini", shape, 10)
    note = split_note(costs, build_model("vgg_mini", shape, 10).default_split, shape)
    assert note.startswith("split 3 sends 49.0 KB") and "split 4 sends 2.2 KB" in note
    assert split_note(costs, 4, shape) is None
    assert split_note(model_costs("resnet8", shape, 10), 2, shape) is None    # its default is fine

    cfg = _run_config(tmp_path, rounds=1, output_dir=str(tmp_path / "out"))     # small_cnn at split 2
    res = RUNNER.invoke(app, ["simulate", "-c", str(cfg)], env={"COLUMNS": "300"})
    assert res.exit_code == 0
    assert sum(l.startswith("split 2 sends 2.0 KB") for l in res.output.splitlines()) == 1
    res = RUNNER.invoke(app, ["models", "-c", str(cfg)], env={"COLUMNS": "300"})
    assert res.exit_code == 0
    rows = {l.split()[0]: l for l in res.output.splitlines() if l.strip()[:1].isdigit()}
    assert rows["3"].endswith("<- fastest") and rows["2"].endswith("<- configured")


def test_plan_points_at_auto_widths_where_heterosfl_is_ahead_and_shows_them_once_set(tmp_path):
    """On links far apart (the HeteroSFL demo's fleet) the plan names the faster method and the
    key that gives auto its bottleneck; with that key set, auto's assignment shows the widths."""
    doc = yaml.safe_load((default_profiles_dir() / "runs" / "heterosfl-demo.yaml").read_text())
    path = tmp_path / "het.yaml"
    path.write_text(yaml.safe_dump(doc))
    res = RUNNER.invoke(app, ["plan", "-c", str(path)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    # the default widths: auto keeps it off here (no width under 64 values per sample pays 2.5x)
    assert "HeteroSFL's round is predicted" in res.output and "list widths in auto.widths" in res.output
    assert "bottleneck: off" in res.output
    doc.setdefault("auto", {})["widths"] = None
    path.write_text(yaml.safe_dump(doc))
    res = RUNNER.invoke(app, ["plan", "-c", str(path)], env={"COLUMNS": "300"})
    assert "set auto.widths (auto, or a list" in res.output and "bottleneck: " not in res.output
    split = doc.get("split", 2)
    doc.update(strategy="auto", hetero={}, split=split, auto={"widths": [4, 8, 16, 32], "max_compression": 8})
    path.write_text(yaml.safe_dump(doc))
    res = RUNNER.invoke(app, ["plan", "-c", str(path)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert ", width " in res.output and "Its bottleneck" not in res.output and "bottleneck: widths [4, 8, 16, 32]" in res.output
    doc["auto"] = {"widths": "auto"}     # decided from the fleet, and the plan says why
    path.write_text(yaml.safe_dump(doc))
    res = RUNNER.invoke(app, ["plan", "-c", str(path)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "bottleneck: " in res.output and "predicted round at equal batches" in res.output


@pytest.mark.parametrize("auto, says", [
    ({"widths": [4, 8], "candidates": [1, 2, 3]}, "auto.candidates: cuts [3] lie beyond the bottleneck at split 2"),
    ({"widths": [64]}, "bottleneck width 64 outside 1..32"),
    ({"candidates": [9]}, "invalid split point 9"),
])
def test_settings_only_the_model_can_judge_are_one_line_naming_the_file(tmp_path, auto, says):
    cfg = _run_config(tmp_path, strategy="auto", split=2, auto=auto, output_dir=str(tmp_path / "out"))
    for command in (["plan", "-c", str(cfg)], ["simulate", "-c", str(cfg)]):
        res = RUNNER.invoke(app, command, env={"COLUMNS": "300"})
        assert res.exit_code == 2, res.output
        line, = [l for l in res.output.splitlines() if says in l]
        assert line.startswith(f"{cfg}: ") and "Traceback" not in res.output
    assert not (tmp_path / "out").exists()


def test_demo_through_a_bad_broker_url_is_one_line_and_starts_nothing(tmp_path):
    res = RUNNER.invoke(app, ["demo", "--broker", "foo://broker", "--rounds", "1", "--output", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "--broker: unsupported MQTT broker URL scheme 'foo'" in " ".join(res.output.split())
    assert "Traceback" not in res.output and not (tmp_path / "out" / "agent-logs").exists()


def test_status_names_a_large_fleets_assignments_on_one_screen():
    """A hundred agents given twenty batches: the twelve assignments given to most agents, each
    with its first and last agent and the count, then one line counting the rest."""
    from coordinator.console import assignment_lines

    agents = {f"a{i:03d}": {"split": 2, "batch_size": 8 + i % 20, "window": 1 + (i % 20 == 0)} for i in range(100)}
    agents.update({f"b{i:03d}": {"split": 3, "batch_size": 8, "codec": "fp16"} for i in range(30)})
    lines = assignment_lines(agents)
    assert lines[0] == "split 3 b8, fp16: b000 … b029 (30 agents)"      # the most agents first
    assert lines[1] == "split 2 b8, window 2: a000 … a080 (5 agents)"
    assert len(lines) == 13 and lines[-1] == "… 9 more assignments, 45 agents (--format json lists every one)"
    assert assignment_lines({"a0": {"whole_model": True, "batch_size": 4}}) == ["whole model b4: a0"]
