"""The operator's view, in one process: the run lock, the metrics exporter and its Grafana
dashboard, the fleet page's state, and the CLI's one-line messages (no markup, no wrapping)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli.coord import app as coord_app
from cli.coord.app import run_config_path
from coordinator import state as ckpt
from simulation import run_simulation
from coordinator.run_lock import RunLock, holder
from coordinator.web import (FleetPage, MetricsExporter, WebAccess, WebError, parse_address, start_dashboard,
                            start_metrics)
from sfl_core.config.run import run_config_from_dict

DASHBOARD = Path(__file__).resolve().parent.parent / "coordinator" / "static" / "grafana-dashboard.json"


def _cfg(tmp_path: Path, **over):
    return run_config_from_dict({
        "run": "view", "model": "small_cnn", "data": {"dataset": "digits"},
        "fleet": [{"profile": "s2fl-low-low", "count": 1}, {"profile": "s2fl-high-high", "count": 2}],
        "rounds": 3, "strategy": "sfl", "split": 2, "batch_size": 8, "local_iters": 2,
        "output_dir": str(tmp_path / "out"), **over})


# ============================================================ defect 1: the run directory's lock

def test_the_run_lock_admits_one_holder_and_names_it(tmp_path):
    first = RunLock(tmp_path).acquire("r1")
    assert holder(tmp_path)["run"] == "r1"
    with pytest.raises(Exception, match=r"is in use by another coordinator \(pid \d+ on .*run 'r1'"):
        RunLock(tmp_path).acquire("r1")
    first.release()
    assert holder(tmp_path) is None
    RunLock(tmp_path).acquire("r2").release()


def test_a_simulation_of_a_held_run_directory_exits_2(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"run": "view", "model": "small_cnn", "data": {"dataset": "digits"},
                                    "fleet": [{"profile": "s2fl-low-low", "count": 2}], "rounds": 1,
                                    "strategy": "sfl", "output_dir": str(tmp_path / "out")}))
    lock = RunLock(tmp_path / "out").acquire("view")
    try:
        r = CliRunner().invoke(coord_app, ["simulate", "-c", str(path), "--quiet"])
    finally:
        lock.release()
    assert r.exit_code == 2, r.output
    assert "is in use by another coordinator" in r.output and "Traceback" not in r.output


# ============================================================ item 10: metrics and the dashboard

def _names_in(exposition: str) -> set[str]:
    """Every sample name the exposition's families can carry (a labelled family with no child
    yet has no samples, but its TYPE line names it)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",)}
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            base = name[:-len("_total")] if kind == "counter" and name.endswith("_total") else name
            names |= {base + s for s in suffixes.get(kind, ("",))}
    return names


def test_metrics_follow_a_run_and_the_grafana_dashboard_queries_only_exported_names(tmp_path):
    cfg = _cfg(tmp_path, window=2)
    exporter = start_metrics("127.0.0.1:0", cfg)
    try:
        from coordinator.api import _Events  # the engine's event fan-out, as serve() builds it
        from simulation.clock import VirtualClock
        from coordinator.engine import RoundEngine
        from simulation.inprocess import build_fleet
        from sfl_core.data.builtin import load_dataset

        data = load_dataset("digits")
        engine = RoundEngine(cfg, build_fleet(cfg, data), VirtualClock(), (data.x_test, data.y_test),
                             input_shape=data.input_shape, num_classes=data.num_classes, out_dir=tmp_path / "out",
                             on_event=_Events([exporter]))
        exporter.attach(engine)
        history = engine.run()
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5).read().decode()
    finally:
        exporter.finish(True)
    values = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["sfl_round"] == 3 and values["sfl_rounds_completed_total"] == 3
    assert values["sfl_accuracy"] == pytest.approx(history[-1]["accuracy"])
    assert values["sfl_bytes_up_total"] == sum(m["bytes_up"] for m in history)
    assert values["sfl_agents_registered"] == 3 and values["sfl_agents_selected"] == 3
    assert values["sfl_round_duration_seconds_count"] == 3 and values["sfl_step_duration_seconds_count"] == 6
    assert sum(v for k, v in values.items() if k.startswith("sfl_agent_assignment_info{")) == 3
    assert all('window="2"' in k for k in values if k.startswith("sfl_agent_assignment_info{"))   # in flight
    assert 'sfl_agent_last_round_seconds{agent="sim-000"}' in values

    exported = _names_in(text)
    queried = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            queried |= set(re.findall(r"\bsfl_[a-z_]+", target["expr"]))
    assert queried and queried <= exported, f"the dashboard queries names nobody exports: {queried - exported}"
    # every exported family has a panel (histograms through their buckets)
    families = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in exported}
    shown = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in queried}
    assert families - shown <= {"sfl_run_info"}, families - shown


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    return str(tmp_path / "c.pem"), str(tmp_path / "k.pem")


def test_metrics_and_page_need_a_token_and_tls_beyond_loopback(tmp_path):
    import ssl

    with pytest.raises(WebError, match="beyond loopback only with a token"):
        parse_address("0.0.0.0:9464", "--metrics")
    with pytest.raises(WebError, match="beyond loopback only over HTTPS"):
        parse_address("0.0.0.0:9464", "--metrics", WebAccess(token="s3cret"))
    tls = _self_signed(tmp_path)
    assert parse_address("0.0.0.0:9464", "--metrics", WebAccess(token="s3cret", tls=tls)) == ("0.0.0.0", 9464)
    assert parse_address("0.0.0.0:9464", "--metrics", WebAccess(token="s3cret", insecure=True)) == ("0.0.0.0", 9464)
    with pytest.raises(WebError, match="expected HOST:PORT"):
        parse_address("9464", "--metrics")
    page = FleetPage(tmp_path).serve("127.0.0.1", 0, WebAccess(token="s3cret", tls=tls))
    try:
        ctx = ssl.create_default_context(cafile=tls[0])
        ctx.check_hostname = False
        doc = urllib.request.urlopen(f"https://127.0.0.1:{page.port}/api/state?token=s3cret", context=ctx,
                                     timeout=5).read()
        assert json.loads(doc)["status"] == "not started"
    finally:
        page.finish(True)
    exporter = MetricsExporter("r", 3).serve("127.0.0.1", 0, WebAccess(token="s3cret"))
    try:
        url = f"http://127.0.0.1:{exporter.port}/metrics"
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(url, timeout=5)
        req = urllib.request.Request(url, headers={"Authorization": "Bearer s3cret"})
        assert b"sfl_rounds_planned 3.0" in urllib.request.urlopen(req, timeout=5).read()
        assert b"sfl_run_info" in urllib.request.urlopen(url + "?token=s3cret", timeout=5).read()
    finally:
        exporter.finish(True)


# ============================================================ item 11: the page's state

def test_the_fleet_page_state_of_a_finished_run_from_its_files(tmp_path):
    cfg = _cfg(tmp_path, window="auto")
    history, _ = run_simulation(cfg)
    page = start_dashboard("127.0.0.1:0", tmp_path / "out")
    try:
        html = urllib.request.urlopen(f"http://127.0.0.1:{page.port}/", timeout=5).read().decode()
        st = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{page.port}/api/state", timeout=5).read())
    finally:
        page.finish(True)
    assert "<title>sfl-edge: fleet</title>" in html and "api/state" in html
    assert st["run"] == "view" and st["status"] == "finished after round 3"
    assert [r["round"] for r in st["rounds"]] == [0, 1, 2, 3]
    assert [r["accuracy"] for r in st["rounds"]] == [m["accuracy"] for m in history]
    assert [a["agent"] for a in st["fleet"]] == ["sim-000", "sim-001", "sim-002"]
    row = st["fleet"][0]
    assert row["profile"] == "s2fl-low-low" and row["split"] == 2 and row["codec"] == "fp32"
    assert row["batch"] == 8 and row["rounds"] == 3 and row["last_round"] == 3 and row["bytes_up"] > 0
    assert all(a["online"] is None for a in st["fleet"])   # nobody holds the run: its files can't say
    # each agent's window as the round set it (auto's, per agent), beside its cut; <th>window</th> heads it
    assert [a["window"] for a in st["fleet"]] == [history[-1]["agents"][a["agent"]]["window"] for a in st["fleet"]]
    assert all(w in (1, 2, 4) for w in (a["window"] for a in st["fleet"])) and "<th>window</th>" in html


def test_the_page_of_a_directory_without_a_run(tmp_path):
    st = FleetPage(tmp_path).state()
    assert st["status"] == "not started" and st["rounds"] == [] and st["fleet"] == []
    (tmp_path / ckpt.METRICS_FILE).write_text('{"round": 0}\n{broken\n{"round": 1}\n')
    st = FleetPage(tmp_path).state()
    assert "line 2 is not a round record" in st["problem"]


# ============================================================ defect 8: one line, no markup, no wrapping

def test_config_errors_print_paths_verbatim_on_one_line(tmp_path):
    bad = tmp_path / "bad[bold]x.yaml"
    bad.write_text(yaml.safe_dump({"run": "r", "local_iter": 3, "fleet": [{"profile": "s2fl-low-low"}]}))
    r = CliRunner().invoke(coord_app, ["simulate", "-c", str(bad)], terminal_width=80)
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1, r.output
    assert str(bad) in lines[0] and "did you mean 'local_iters'" in lines[0], lines[0]


def test_help_prints_extras_as_written():
    r = CliRunner().invoke(coord_app, ["simulate", "--help"], terminal_width=200)
    assert "pip install 'sfl-edge[ray]'" in r.output, r.output


def test_shipped_run_configs_resolve_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_config_path(Path("demo")).name == "demo.yaml"
    assert run_config_path(Path("s2fl-demo.yaml")).name == "s2fl-demo.yaml"
    assert run_config_path(Path("nope")) == Path("nope")
    assert run_config_path(Path("sub/demo")) == Path("sub/demo")   # a path is never replaced


def test_resume_takes_auto_or_nothing():
    r = CliRunner().invoke(coord_app, ["simulate", "-c", "demo", "--resume=sometimes"])
    assert r.exit_code == 2 and "--resume sometimes: expected no value (resume) or auto" in r.output
    r = CliRunner().invoke(coord_app, ["simulate", "-c", "demo", "--resume", "sometimes"])
    assert r.exit_code == 2 and "unexpected extra argument" in r.output


def test_s2fl_warmup_says_it_trains_everyone():
    from sfl_core.model.accounting import model_costs
    from sfl_core.methods import build_method
    from sfl_core.model.zoo import build_model

    cfg = run_config_from_dict({"run": "w", "model": "small_cnn", "data": {"dataset": "digits"},
                                "fleet": [{"profile": "s2fl-low-low", "count": 40}], "per_round": 8,
                                "strategy": "s2fl", "s2fl": {"sliding": True}})
    method = build_method(cfg, build_model("small_cnn", (1, 8, 8), 10), model_costs("small_cnn", (1, 8, 8), 10))
    (note,) = method.notes(40)
    assert "warm-up rounds 1-" in note and "every registered agent (40), not per_round (8)" in note


def test_the_summary_of_a_large_fleet_sums_its_agents_per_profile():
    """Up to SUMMARY_ROWS agents are listed one by one; a fleet of thousands gets one row per
    profile, its agents' totals summed (laying out 10,000 rows took the coordinator seconds)."""
    import io

    from rich.console import Console

    from coordinator.console import SUMMARY_ROWS, summary_table
    from coordinator.registry import Registry
    from sfl_core.wire.protocol import Message

    def fleet(n: int) -> Registry:
        reg = Registry(num_classes=2)
        for i in range(n):
            profile = {"name": "pi" if i % 3 else "jetson", "compute_flops": 1e9, "link_bytes_per_s": 1e6,
                       "downlink_bytes_per_s": 1e6, "latency_s": 0.0}
            reg.register(Message("register", "r", f"a{i:04d}", {"index": i, "profile": profile, "measured": {},
                                                                "label_counts": [2, 1], "num_samples": 3}, seq=1))
            reg.agents[f"a{i:04d}"].rounds, reg.agents[f"a{i:04d}"].bytes_up = 2, 1000
        return reg

    def text(reg: Registry) -> str:
        out = io.StringIO()
        Console(file=out, width=200).print(summary_table([], reg))
        return out.getvalue()

    small = text(fleet(SUMMARY_ROWS))
    assert f"a{SUMMARY_ROWS - 1:04d}" in small and "summed per profile" not in small
    big = text(fleet(3000))
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in big.splitlines() if line.startswith("│")}
    assert rows["jetson"][:2] == ["1,000", "2000"] and rows["pi"][:2] == ["2,000", "4000"], big
    assert rows["pi"][-2] == "2.00 MB" and "3,000 agents, summed per profile" in big and "a0001" not in big


def test_the_summary_table_piped_is_as_wide_as_its_content(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"run": "piped", "model": "small_cnn", "data": {"dataset": "digits"},
                                    "fleet": [{"profile": "s2fl-high-high", "count": 2}], "rounds": 1,
                                    "strategy": "sfl", "local_iters": 2, "output_dir": str(tmp_path / "out")}))
    r = CliRunner().invoke(coord_app, ["simulate", "-c", str(path), "--quiet"], terminal_width=80)
    assert r.exit_code == 0, r.output
    assert "s2fl-high-high" in r.output and "sim-001" in r.output and "…" not in r.output, r.output
    assert f"metrics: {tmp_path / 'out' / 'metrics.jsonl'}" in r.output        # a path on one line
