"""The round engine and its checkpoints under faults, in one process (fast; the same faults
with real processes and Mosquitto are in test_faults.py and test_daemon_faults.py).

- an agent that re-registers between its activations and the server step must not crash
  the coordinator (it is dropped from the round, its activations with it);
- only a run that finished tells the agents to stop;
- a checkpoint is one atomic file: a torn write, a kill, a corrupted, truncated, empty or
  foreign file gives one CheckpointError naming the file; resume never touches the metrics
  before the checkpoint is read;
- a full disk while checkpointing leaves the previous checkpoint intact and no temporary file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import pytest
import torch

from coordinator import state as ckpt
from simulation.clock import VirtualClock
from coordinator.engine import RoundEngine
from simulation.inprocess import InProcessTransport, build_fleet
from sfl_core.wire import protocol
from sfl_core.config.run import load_profile, run_config_from_dict
from sfl_core.data.builtin import load_dataset
from sfl_core.wire.protocol import Message


def _cfg(tmp_path: Path, **over):
    return run_config_from_dict({
        "run": "ef", "model": "small_cnn", "data": {"dataset": "digits"},
        "fleet": [{"profile": "s2fl-low-low", "count": 1}, {"profile": "s2fl-mid-mid", "count": 1},
                  {"profile": "s2fl-high-high", "count": 1}],
        "rounds": 3, "strategy": "sfl", "split": 2, "batch_size": 8, "lr": 0.05, "local_iters": 3,
        "output_dir": str(tmp_path / "out"), **over})


def _run_yaml(tmp_path: Path, rounds: int) -> tuple[Path, Path]:
    """A small run config for the CLI: two agents, two steps a round; (config path, output dir)."""
    import yaml
    out, path = tmp_path / "out", tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "run": "ef", "model": "small_cnn", "data": {"dataset": "digits"},
        "fleet": [{"profile": "s2fl-low-low", "count": 2}], "rounds": rounds, "strategy": "sfl", "split": 2,
        "batch_size": 8, "local_iters": 2, "output_dir": str(out)}))
    return path, out


def _engine(cfg, transport, checkpoint=None) -> RoundEngine:
    data = load_dataset("digits")
    return RoundEngine(cfg, transport, VirtualClock(), (data.x_test, data.y_test), input_shape=data.input_shape,
                       num_classes=data.num_classes, out_dir=Path(cfg.output_dir), checkpoint=checkpoint)


class Recording(InProcessTransport):
    """The in-process fleet, recording what the coordinator sends; optionally it injects a
    message after a chosen one reaches the engine."""

    def __init__(self, inner: InProcessTransport):
        super().__init__(inner.run_id, inner.agents)
        self._inbox = inner._inbox
        self.sent: list[tuple[str, Message]] = []
        self.after: Optional[tuple] = None       # (predicate, factory of the message to inject after it)
        self.injected = 0

    def send(self, agent_id: str, msg: Message) -> int:
        self.sent.append((agent_id, msg))
        return super().send(agent_id, msg)

    def poll(self, timeout: float) -> Optional[Message]:
        msg = super().poll(timeout)
        if msg is not None and self.after is not None and self.after[0](msg):
            self._inbox.appendleft(self.after[1]())   # built now: its seq is newer than what came before
            self.after = None
            self.injected += 1
        return msg


def _fleet(cfg) -> Recording:
    return Recording(build_fleet(cfg, load_dataset("digits")))


# ============================================================ item 1: re-registration mid-step

@pytest.mark.parametrize("kind,step", [("activations", 1), ("weights", 2)])
def test_reregistration_between_collect_and_step_does_not_crash(tmp_path, kind, step):
    """sim-001's activations (or weights) of round 2 reach the engine, then its registration
    arrives again (a restarted agent, or a register crossing a resumed coordinator's
    announcement) before the others' messages: it is dropped from the round, the round and the
    run complete with the others, and it is back in round 3."""
    cfg = _cfg(tmp_path)
    t = _fleet(cfg)
    agent = "sim-001"
    first = t.agents[agent]
    register = lambda: Message("register", cfg.run_id, agent, round=0, seq=protocol.next_seq(), body={  # noqa: E731
        "index": 1, "profile": protocol.profile_body(load_profile("s2fl-mid-mid")),
        "measured": {}, "label_counts": first.data.label_counts(), "num_samples": len(first.data), "emulate": True,
        "resume": {}})
    t.after = (lambda m: m.sender == agent and m.type == kind and m.round == 2 and m.step == step, register)
    history = _engine(cfg, t).run()
    assert t.injected == 1
    assert [r["round"] for r in history] == [0, 1, 2, 3]
    assert history[2]["selected"] == ["sim-000", "sim-001", "sim-002"]
    assert history[2]["completed"] == ["sim-000", "sim-002"]
    assert history[3]["completed"] == ["sim-000", "sim-001", "sim-002"]


# ============================================================ item 2: stop only when finished

def test_only_a_finished_run_tells_agents_to_stop(tmp_path):
    cfg = _cfg(tmp_path, rounds=2)
    t = _fleet(cfg)
    _engine(cfg, t).run()
    stops = [(a, m.body["reason"]) for a, m in t.sent if m.type == "shutdown"]
    assert sorted(stops) == [(f"sim-00{i}", "run finished") for i in range(3)]

    # a crash in round 2 (here: the server step fails): the exception propagates, nobody is told to stop
    cfg = _cfg(tmp_path, rounds=3, output_dir=str(tmp_path / "crash"))
    t = _fleet(cfg)
    engine = _engine(cfg, t)
    real_step = engine.server.step

    def failing_step(batches, *a, **k):
        if engine.history and engine.history[-1]["round"] == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_step(batches, *a, **k)
    engine.server.step = failing_step
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.run()
    assert not [m for _, m in t.sent if m.type == "shutdown"]
    assert ckpt.load(tmp_path / "crash")[1]["round"] == 1          # round 1 is kept

    # a signal (Ctrl-C) the same
    cfg = _cfg(tmp_path, rounds=3, output_dir=str(tmp_path / "sig"))
    t = _fleet(cfg)
    engine = _engine(cfg, t)

    def interrupted(batches, *a, **k):
        raise KeyboardInterrupt
    engine.server.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.run()
    assert not [m for _, m in t.sent if m.type == "shutdown"]


# ============================================================ item 4: one atomic checkpoint

def _model_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _small_cnn_without(key: str) -> dict[str, torch.Tensor]:
    from sfl_core.model.zoo import build_model

    state = build_model("small_cnn", (1, 8, 8), 10).state_dict()
    assert key in state
    return {k: v for k, v in state.items() if k != key}


def test_checkpoint_is_one_unit_state_json_is_only_a_copy(tmp_path):
    """The torn pair of the old layout (model of round N, state of round N-1) cannot happen: the
    state travels inside checkpoint.pt. Even with state.json of an older round beside it (a kill
    between the two writes), resume reads round N's model with round N's state."""
    out = tmp_path / "run"
    ckpt.save(out, _model_state(1), {"round": 1, "model": "m"})
    old_state_json = (out / ckpt.STATE_FILE).read_bytes()
    ckpt.save(out, _model_state(2), {"round": 2, "model": "m"})
    (out / ckpt.STATE_FILE).write_bytes(old_state_json)           # torn: state.json still of round 1
    model, state = ckpt.load(out)
    assert state["round"] == 2 and torch.equal(model["w"], _model_state(2)["w"])


def test_kill_while_checkpointing_keeps_the_previous_one(tmp_path):
    """A process killed in the middle of writing round 2's checkpoint (here: SIGKILL from inside
    the write, after half the bytes) leaves round 1's checkpoint, complete."""
    import subprocess
    import sys

    out = tmp_path / "run"
    ckpt.save(out, _model_state(1), {"round": 1, "model": "m"})
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
import torch
from pathlib import Path
from coordinator import state as ckpt
real_open = open
class Dying:
    def __init__(self, f): self.f = f
    def __enter__(self): return self
    def __exit__(self, *a): return False
    def write(self, data):
        self.f.write(data[: len(data) // 2]); self.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    def __getattr__(self, name): return getattr(self.f, name)
ckpt.open = lambda p, mode="r", *a, **k: Dying(real_open(p, mode, *a, **k)) if str(p).endswith("checkpoint.pt.tmp") else real_open(p, mode, *a, **k)
g = torch.Generator().manual_seed(2)
ckpt.save(Path({str(out)!r}), {{"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}}, {{"round": 2, "model": "m"}})
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    assert (out / "checkpoint.pt.tmp").exists()                    # the half-written file, never renamed
    model, state = ckpt.load(out)
    assert state["round"] == 1 and torch.equal(model["w"], _model_state(1)["w"])


# ============================================================ item 5: bad checkpoints on resume

def _bad_files(out: Path) -> dict[str, tuple]:
    """name -> (how to spoil the run directory, what the one-line message must say)."""
    good = (out / ckpt.MODEL_FILE).read_bytes()

    def write(data: bytes):
        return lambda: (out / ckpt.MODEL_FILE).write_bytes(data)

    def foreign(obj):
        def f():
            torch.save(obj, out / ckpt.MODEL_FILE)
        return f

    corrupt = bytearray(good)
    for i in range(200, min(len(corrupt) - 200, 4000)):
        corrupt[i] ^= 0x5A
    return {
        "missing": (lambda: (out / ckpt.MODEL_FILE).unlink(), "no checkpoint to resume"),
        "empty": (write(b""), "empty file"),
        "truncated": (write(good[: len(good) // 2]), "truncated or corrupted"),
        "garbage": (write(os.urandom(5000)), "truncated or corrupted"),
        "bit-flipped": (write(bytes(corrupt)), "corrupted"),
        "plain state dict (older version)": (foreign(_model_state(3)), "not a checkpoint of this program's format"),
        "state not JSON": (foreign({"format": ckpt.FORMAT, "state": "{round: 1", "model": {}}), "not valid JSON"),
        "state lacks round": (foreign({"format": ckpt.FORMAT, "state": json.dumps({"model": "small_cnn"}),
                                       "model": {}}), "lacks 'round'"),
        "another model": (foreign({"format": ckpt.FORMAT, "state": json.dumps({"round": 1, "model": "vgg_mini"}),
                                   "model": {}}), "checkpoint of model 'vgg_mini'"),
        "tensors that do not fit": (foreign({"format": ckpt.FORMAT,
                                             "state": json.dumps({"round": 1, "model": "small_cnn"}),
                                             "model": _model_state(4)}), "does not fit this run's model"),
        "a tensor missing": (foreign({"format": ckpt.FORMAT, "state": json.dumps({"round": 1, "model": "small_cnn"}),
                                      "model": _small_cnn_without("blocks.0.0.weight")}),
                             "lacks the tensor(s) blocks.0.0.weight"),
    }


def test_every_bad_checkpoint_is_one_line_exit_2_and_metrics_untouched(tmp_path):
    """`sfl-coord simulate --resume` over each spoiled run directory: exit status 2, one line that
    names the file, no traceback, no relayed torch advice, metrics.jsonl byte for byte the same,
    nothing started over."""
    from typer.testing import CliRunner

    from cli.coord import app

    cfg_path, out = _run_yaml(tmp_path, rounds=2)
    runner = CliRunner()
    r = runner.invoke(app, ["simulate", "-c", str(cfg_path), "--rounds", "1", "--quiet"])
    assert r.exit_code == 0, r.output
    pristine = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for name, (spoil, expected) in _bad_files(out).items():
        for f, data in pristine.items():
            (out / f).write_bytes(data)
        spoil()
        metrics_before = (out / ckpt.METRICS_FILE).read_bytes()
        r = runner.invoke(app, ["simulate", "-c", str(cfg_path), "--resume", "--quiet"])
        text = r.output.strip()
        assert r.exit_code == 2, (name, r.exit_code, text, r.exception)
        assert expected in text and str(out / ckpt.MODEL_FILE) in text.replace("\n", ""), (name, text)
        assert "Traceback" not in text and "weights_only" not in text, (name, text)
        assert (out / ckpt.METRICS_FILE).read_bytes() == metrics_before, name
        assert not [p for p in out.iterdir() if ".20" in p.name], name     # nothing moved aside: no fresh start
    # a corrupted line in the middle of metrics.jsonl, with a good checkpoint
    for f, data in pristine.items():
        (out / f).write_bytes(data)
    lines = (out / ckpt.METRICS_FILE).read_text().splitlines()
    (out / ckpt.METRICS_FILE).write_text(lines[0][:20] + "\n" + "\n".join(lines[1:]) + "\n")
    before = (out / ckpt.METRICS_FILE).read_bytes()
    r = runner.invoke(app, ["simulate", "-c", str(cfg_path), "--resume", "--quiet"])
    assert r.exit_code == 2 and "metrics.jsonl: line 1 is not a round record" in r.output.replace("\n", ""), r.output
    assert (out / ckpt.METRICS_FILE).read_bytes() == before
    # the good directory resumes (a last line cut short by a crash is ignored)
    for f, data in pristine.items():
        (out / f).write_bytes(data)
    with open(out / ckpt.METRICS_FILE, "a") as f:
        f.write('{"round": 2, "accur')
    r = runner.invoke(app, ["simulate", "-c", str(cfg_path), "--resume", "--quiet"])
    assert r.exit_code == 0, r.output
    assert [m["round"] for m in ckpt.read_metrics(out)] == [0, 1, 2]


# ============================================================ item 6: disk full

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


@needs_dev_full
def test_disk_full_keeps_previous_checkpoint_and_removes_temp_files(tmp_path):
    """ENOSPC from the kernel (the temporary file is a link to /dev/full): one clear error that
    names the file, the previous checkpoint intact and loadable, no temporary file left."""
    out = tmp_path / "run"
    ckpt.save(out, _model_state(1), {"round": 1, "model": "m"})
    (out / "checkpoint.pt.tmp").symlink_to("/dev/full")
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        ckpt.save(out, _model_state(2), {"round": 2, "model": "m"})
    assert str(e.value.strerror).startswith("no space left on ") and str(out / "checkpoint.pt") in e.value.strerror
    assert not (out / "checkpoint.pt.tmp").exists() and not (out / "checkpoint.pt.tmp").is_symlink()
    model, state = ckpt.load(out)
    assert state["round"] == 1 and torch.equal(model["w"], _model_state(1)["w"])


@needs_dev_full
def test_disk_full_mid_run_exit_1_agents_not_stopped(tmp_path):
    """`sfl-coord simulate`: the disk fills while round 2 is checkpointed: exit status 1 with the
    one-line reason, round 1's checkpoint intact, no temporary file, and the run resumes from
    round 1 once there is room."""
    from typer.testing import CliRunner

    from cli.coord import app
    from coordinator import engine as engine_mod

    cfg_path, out = _run_yaml(tmp_path, rounds=3)
    real_save = ckpt.save
    sent_stop = []

    def save_then_fill(out_dir, model_state, state, encoded=None):
        real_save(out_dir, model_state, state, encoded)
        if state["round"] == 1:   # the disk is full from now on
            (out_dir / "checkpoint.pt.tmp").symlink_to("/dev/full")
    real_shutdown = engine_mod.RoundEngine.shutdown_agents
    engine_mod.ckpt.save = save_then_fill
    engine_mod.RoundEngine.shutdown_agents = lambda self, reason: sent_stop.append(reason)
    try:
        r = CliRunner().invoke(app, ["simulate", "-c", str(cfg_path), "--quiet"])
    finally:
        engine_mod.ckpt.save = real_save
        engine_mod.RoundEngine.shutdown_agents = real_shutdown
    assert r.exit_code == 1, (r.output, r.exception)
    text = r.output.replace("\n", "")
    assert "no space left on " in text and str(out / "checkpoint.pt") in text and "Traceback" not in text, text
    assert sent_stop == []
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp") or p.is_symlink()]
    assert ckpt.load(out)[1]["round"] == 1
    r = CliRunner().invoke(app, ["simulate", "-c", str(cfg_path), "--resume", "--quiet"])
    assert r.exit_code == 0, r.output
    assert [m["round"] for m in ckpt.read_metrics(out)] == [0, 1, 2, 3]


def test_a_simulated_agent_that_rejects_its_assignment_is_dropped_without_waiting(tmp_path):
    """In a simulation nothing arrives while nothing is sent, so silence is measured on the
    transport's virtual liveness clock: an agent that rejects every assignment is dropped after
    step_timeout_s of that clock (here 60 s), and the run does not wait 60 s of real time."""
    import time

    from sfl_core.wire import codec as wire
    cfg = _cfg(tmp_path, rounds=2, step_timeout_s=60)
    transport = build_fleet(cfg, load_dataset("digits"))
    deaf = transport.agents["sim-001"]
    real_handle = deaf.handle

    def handle(msg):
        if msg.type == "assign":
            raise wire.WireError("assign: refused by this test")
        return real_handle(msg)
    deaf.handle = handle
    t0 = time.monotonic()
    history = _engine(cfg, transport).run()
    assert time.monotonic() - t0 < 30
    for rec in history[1:]:
        assert "sim-001" in rec["selected"] and "sim-001" not in rec["completed"]
        assert sorted(rec["completed"]) == ["sim-000", "sim-002"]


def test_a_simulated_fleet_that_cannot_register_fails_without_waiting_real_time(tmp_path):
    """The registration deadline of a simulation is on its virtual clock: a fleet short of
    min_agents times out at once, not after register_timeout_s of wall time."""
    import time

    cfg = _cfg(tmp_path, register_timeout_s=3600)
    transport = _fleet(cfg)
    transport._inbox.pop()                 # one agent's registration never arrives
    engine = _engine(cfg, transport)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="only 2 of 3 agents registered within 3600 s"):
        engine.session.wait_for_agents()
    assert time.monotonic() - t0 < 30


def test_a_checkpoint_of_another_run_model_or_horizon_is_refused_by_name(tmp_path):
    path = tmp_path / "checkpoint.pt"
    st = {"model": "small_cnn", "run": "ef", "round": 5}
    ckpt.check_fits(path, st, model="small_cnn", run_id="ef", rounds=5)          # fits: nothing raised
    for kwargs, what in [({"model": "resnet8"}, "a checkpoint of model 'small_cnn'"),
                         ({"run_id": "other"}, "a checkpoint of run 'ef'"),
                         ({"rounds": 4}, "already after round 5, beyond the config's 4 rounds")]:
        with pytest.raises(ckpt.CheckpointError, match=f"checkpoint.pt: {what}"):
            ckpt.check_fits(path, st, **{"model": "small_cnn", "run_id": "ef", "rounds": 5, **kwargs})
