"""Faults survived: real coordinator and agent processes over a real Mosquitto, one fault each.

Every test runs the same configuration as an undisturbed run of the same seed (run once per
module) and checks that the disturbed run still finishes and ends within ``ACC_MARGIN`` of
the undisturbed run's final accuracy:

1. an agent killed (SIGKILL) mid-step: dropped after ``step_timeout_s``, the round completes
   with the rest, and a new process with the same agent id / index is re-admitted;
2. the coordinator killed (SIGKILL) mid-round: ``sfl-coord serve --resume`` continues from the
   last completed round (same model, time table, participation counts, metrics) and the
   still-running agents reattach without a restart;
3. the broker killed and restarted mid-round: both sides reconnect and the run finishes;
4. an agent 10x slower than its profile (``sfl-agent start --slowdown 10``): a straggler, not a
   failure - never dropped, every round completes, its times are recorded as larger.

The runs use S2FL (``strategy: s2fl``, three candidate splits, warm-up rounds 1-3, then the
median rule; one merged group of the three agents): its client time table is the state besides
the model that a crash must not lose, and it is empty under plain ``sfl``.

Faults are injected at a known point of the protocol, not at a guessed time: a passive MQTT
subscriber (:class:`Sniffer`) watches the run's topics and the test acts when, e.g., agent a2's
activations for round 2 step 3 go by.

With ``SFL_FAULT_REPORT=path`` every test appends one JSON line
``{fault, injected, outcome, final_acc, undisturbed_acc, ...}`` to ``path``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import paho.mqtt.client as mqtt
import pytest
import torch

import conftest
from coordinator import state as ckpt
from sfl_core.wire import codec as wire
from helpers import PROFILES, REPO, coordinator_key, finish, logs, metrics, start_coord, wait_log, write_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROUNDS, LOCAL_ITERS, BATCH, LR, STEP_TIMEOUT_S = 8, 10, 16, 0.1, 12
"""Shared by every run of this module (the undisturbed reference included). Many short rounds
rather than a few long ones: the same number of steps, but a restarted agent has rounds left
to rejoin. The step timeout is longer than a broker outage plus paho's reconnect back-off."""
S2FL = {"sliding": True, "balance": True, "group_size": 3, "candidates": [1, 2, 3]}
WARMUP = range(1, 4)
"""S2FL's warm-up rounds: every agent at candidate r, so runs can be compared agent by agent."""
ACC_MARGIN = 0.15
"""A disturbed run may end at most this far below the undisturbed run's final accuracy."""
RUN_TIMEOUT_S = 200


def config(tmp_path: Path, run: str) -> Path:
    return write_config(tmp_path, run, rounds=ROUNDS, local_iters=LOCAL_ITERS, batch_size=BATCH, lr=LR,
                        strategy="s2fl", s2fl=S2FL,
                        step_timeout_s=STEP_TIMEOUT_S, register_timeout_s=90)


# ============================================================ processes

WARM_START = """
import os, sys, time
import torch, cli.agent, edge_agent.runner      # the slow part of a cold start, paid ahead
from sfl_core.data.builtin import load_dataset
load_dataset("digits")
trigger = sys.argv[1]
while not os.path.exists(trigger):
    time.sleep(0.02)
sys.argv = ["sfl-agent", *sys.argv[2:]]
cli.agent.app(prog_name="sfl-agent")
"""
"""A fresh agent process that imports everything, then waits for ``trigger`` before it runs
``sfl-agent <args>``: the agent comes back within a second or two of the trigger (as on a device
whose service restarts) instead of after a cold Python + torch start on two shared cores."""


class Procs:
    """The processes a test started; whatever still runs at teardown is killed (by its Popen)."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.all: list[subprocess.Popen] = []

    def coord(self, cfg: Path, broker: str, *args: str, name: str = "coord") -> subprocess.Popen:
        p = start_coord(cfg, self.tmp_path, "--broker", broker, *args, name=name)
        self.all.append(p)
        return p

    def agent(self, broker: str, run: str, i: int, *extra: str, name: str | None = None,
              trigger: Path | None = None) -> subprocess.Popen:
        args = ["start", "--profile", PROFILES[i % len(PROFILES)], "--broker", broker, "--run", run,
                "--index", str(i), "--agent-id", f"a{i}", "--verbose", "--emulate", *extra,
                "--coordinator-key", coordinator_key(self.tmp_path / "out")]
        cmd = ([sys.executable, "-m", "cli.agent", *args] if trigger is None
               else [sys.executable, "-c", WARM_START, str(trigger), *args])
        log = open(self.tmp_path / f"{name or f'agent-{i}'}.log", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self.all.append(p)
        return p

    def agents(self, broker: str, run: str, extra: dict[int, list[str]] | None = None) -> list[subprocess.Popen]:
        return [self.agent(broker, run, i, *(extra or {}).get(i, [])) for i in range(len(PROFILES))]

    def kill_all(self) -> None:
        for p in self.all:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def procs(tmp_path) -> Iterator[Procs]:
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.kill_all()


class Sniffer:
    """A passive MQTT subscriber on all of a run's topics: records (time, direction, type, agent,
    round, step, seq) of every message and keeps the bodies of ``assign`` messages. Reconnects
    (and re-subscribes) by itself after a broker restart."""

    def __init__(self, port: int, run: str):
        self.run = run
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._reassembler = wire.Reassembler()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"sniffer-{uuid.uuid4().hex[:8]}")
        self.client.reconnect_delay_set(min_delay=0.2, max_delay=1)  # type: ignore[arg-type]
        self.client.on_connect = lambda c, *_: c.subscribe(f"sfl/{run}/#", qos=0)
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, client, userdata, m) -> None:
        parts = m.topic.split("/")
        if len(parts) != 4 or parts[2] not in ("up", "down") or not m.payload:
            return
        try:
            whole = self._reassembler.feed(m.topic, m.payload)
            if whole is None:
                return
            env = wire.unpack(whole)
        except wire.WireError:
            return
        ev = {"t": time.monotonic(), "dir": parts[2], "agent": parts[3], "type": env["type"],
              "round": env["round"], "step": env["step"], "seq": env["seq"],
              "body": env["body"] if env["type"] == "assign" else None}
        with self._cond:
            self.events.append(ev)
            self._cond.notify_all()

    def wait_for(self, pred: Callable[[dict], bool], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for ev in self.events[seen:]:
                    if pred(ev):
                        return ev
                seen = len(self.events)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching message within {timeout:.0f} s")
                self._cond.wait(min(left, 0.5))

    def find(self, pred: Callable[[dict], bool]) -> list[dict]:
        with self._cond:
            return [ev for ev in self.events if pred(ev)]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def up(typ: str, agent: str | None = None, rnd: int | None = None, step: int | None = None):
    return lambda ev: (ev["dir"] == "up" and ev["type"] == typ and (agent is None or ev["agent"] == agent)
                       and (rnd is None or ev["round"] == rnd) and (step is None or ev["step"] == step))


# ============================================================ report

@contextmanager
def fault_record(fault: str, injected: str, undisturbed_acc: float | None) -> Iterator[dict[str, Any]]:
    """Append one JSON line to $SFL_FAULT_REPORT (if set) when the test ends, passed or not."""
    rec: dict[str, Any] = {"fault": fault, "injected": injected, "outcome": None, "final_acc": None,
                           "undisturbed_acc": undisturbed_acc}
    t0 = time.monotonic()
    try:
        yield rec
        rec["passed"] = True
    except BaseException as exc:
        rec["passed"] = False
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        raise
    finally:
        rec["test_s"] = round(time.monotonic() - t0, 1)
        path = os.environ.get("SFL_FAULT_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")


def check_accuracy(rec: dict[str, Any], m: list[dict], undisturbed: dict[str, Any]) -> None:
    rec["final_acc"] = round(m[-1]["accuracy"], 4)
    assert m[-1]["round"] == ROUNDS, m[-1]
    assert m[-1]["accuracy"] >= undisturbed["final_acc"] - ACC_MARGIN, (m[-1]["accuracy"], undisturbed["final_acc"])


# ============================================================ the undisturbed reference

@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """The reference: the same config and seeds, nothing injected."""
    binary = conftest._brokers.find_mosquitto()
    if binary is None:
        if os.environ.get("SFL_REQUIRE_MOSQUITTO") == "1":
            pytest.fail(conftest.MOSQUITTO_MISSING)
        pytest.skip(conftest.MOSQUITTO_MISSING)
    tmp = tmp_path_factory.mktemp("undisturbed")
    broker = conftest._brokers.MosquittoBroker(binary)
    broker.start()
    ps = Procs(tmp)
    try:
        with fault_record("none", "nothing (reference run)", None) as rec:
            cfg = config(tmp, "ref")
            coord = ps.coord(cfg, broker.url)
            agents = ps.agents(broker.url, "ref")
            assert finish([coord, *agents], RUN_TIMEOUT_S) == [0, 0, 0, 0], logs(tmp)
            m = metrics(tmp)
            assert [r["round"] for r in m] == list(range(ROUNDS + 1))
            assert all(r["completed"] == ["a0", "a1", "a2"] for r in m[1:]), m
            state = json.loads((tmp / "out" / "state.json").read_text())
            rec["final_acc"] = round(m[-1]["accuracy"], 4)
            rec["outcome"] = f"{ROUNDS} rounds, every agent in every round"
            assert m[-1]["accuracy"] > 0.6, "the reference run must learn for the comparison to mean anything"
        yield {"metrics": m, "final_acc": m[-1]["accuracy"], "state": state, "dir": tmp}
    finally:
        ps.kill_all()
        broker.close()


# ============================================================ 1. agent killed mid-step

def test_agent_killed_mid_step_is_dropped_and_readmitted(mosquitto, procs, tmp_path, undisturbed):
    """SIGKILL agent a2 between its activations and our gradients (round 2, step 3): its
    connection closes with the process, the broker publishes its last will at once, and the
    coordinator drops a2 from the round then (it used to wait step_timeout_s) and completes it
    with a0/a1; a new a2 process (same id and index) registers again and is selected and
    completes later rounds."""
    kill_round, kill_step = 2, 3
    with fault_record("agent killed mid-step", f"SIGKILL a2 after its activations of round {kill_round} "
                      f"step {kill_step}; new a2 process started after the drop", undisturbed["final_acc"]) as rec:
        sniff = Sniffer(mosquitto.port, "ak")
        try:
            coord = procs.coord(config(tmp_path, "ak"), mosquitto.url)
            agents = procs.agents(mosquitto.url, "ak")
            sniff.wait_for(up("activations", "a2", kill_round, kill_step), 120)
            agents[2].send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            trigger = tmp_path / "restart-a2"
            replacement = procs.agent(mosquitto.url, "ak", 2, name="agent-2-restarted", trigger=trigger)
            assert wait_log(tmp_path / "coord.log", "dropping a2 from the round", STEP_TIMEOUT_S + 60), logs(tmp_path)
            dropped_after = time.monotonic() - t_kill
            trigger.touch()
            codes = finish([coord, agents[0], agents[1], replacement], RUN_TIMEOUT_S)
        finally:
            sniff.close()
        assert codes == [0, 0, 0, 0], logs(tmp_path)
        text = (tmp_path / "coord.log").read_text()
        assert "dropping a2 from the round: left (its process said it is offline)" in text, text[-3000:]
        assert text.count("dropping") == 1, text[-3000:]   # the new a2 is not dropped again when it registers
        assert dropped_after < STEP_TIMEOUT_S / 2, dropped_after   # the will, not the step timeout

        m = metrics(tmp_path)
        assert [r["round"] for r in m] == list(range(ROUNDS + 1))
        for r in m[1:kill_round]:
            assert r["completed"] == ["a0", "a1", "a2"], r
        killed = m[kill_round]
        assert killed["selected"] == ["a0", "a1", "a2"] and killed["completed"] == ["a0", "a1"], killed
        assert "a2" not in killed["agents"]
        back = [r["round"] for r in m[kill_round + 1:] if "a2" in r["completed"]]
        assert back, [(r["round"], r["selected"], r["completed"]) for r in m]
        first_back = back[0]
        for r in m[kill_round + 1:]:       # a0 and a1 are never disturbed; a2 is in from its return on
            assert r["completed"] == (["a0", "a1"] if r["round"] < first_back else ["a0", "a1", "a2"]), r
            assert r["selected"] == r["completed"], r     # whoever is selected completes: no lost round
        # participation counts: the killed a2's partial round is not counted, its rounds after the return are
        state = json.loads((tmp_path / "out" / "state.json").read_text())
        for a in ("a0", "a1", "a2"):
            assert state["registry"][a]["rounds"] == sum(a in r["completed"] for r in m), (a, state["registry"][a])
        assert state["registry"]["a2"]["rounds"] == (kill_round - 1) + (ROUNDS - first_back + 1)
        check_accuracy(rec, m, undisturbed)
        rec["outcome"] = (f"a2 dropped from round {kill_round} after {dropped_after:.1f} s "
                          f"(step_timeout_s={STEP_TIMEOUT_S}); round {kill_round} completed by {killed['completed']}; "
                          f"new a2 process selected and completed rounds {back}; all exit codes 0")


# ============================================================ 2. coordinator killed mid-round

def test_coordinator_killed_mid_round_resumes_with_live_agents(mosquitto, procs, tmp_path, undisturbed):
    """SIGKILL the coordinator in round 4, step 5; `serve --resume` continues from round 3's
    checkpoint; the same three agent processes reattach by themselves and exit 0 at the end."""
    crash_round, crash_step = 4, 5
    with fault_record("coordinator killed mid-round", f"SIGKILL sfl-coord serve after the activations of round "
                      f"{crash_round} step {crash_step}; `serve --resume` started; agents left running",
                      undisturbed["final_acc"]) as rec:
        out = tmp_path / "out"
        cfg = config(tmp_path, "ck")
        sniff = Sniffer(mosquitto.port, "ck")
        try:
            coord = procs.coord(cfg, mosquitto.url)
            agents = procs.agents(mosquitto.url, "ck")
            sniff.wait_for(up("activations", None, crash_round, crash_step), 150)
            coord.send_signal(signal.SIGKILL)
            coord.wait()
            t_kill = time.monotonic()
            # what the crash left behind: round crash_round-1 complete, nothing of crash_round
            before = metrics(tmp_path)
            snap_state = json.loads((out / "state.json").read_text())
            snap_model = ckpt.load(out)[0]
            shutil.copytree(out, tmp_path / "at-crash")
            assert [r["round"] for r in before] == list(range(crash_round)), before
            assert snap_state["round"] == crash_round - 1
            time.sleep(1.0)
            assert all(a.poll() is None for a in agents), "agents must survive the coordinator"

            resumed = procs.coord(cfg, mosquitto.url, "--resume", name="coord-resume")
            codes = finish([resumed, *agents], RUN_TIMEOUT_S)
        finally:
            sniff.close()
        assert codes == [0, 0, 0, 0], logs(tmp_path)
        text = (tmp_path / "coord-resume.log").read_text()
        assert f"resuming ck after round {crash_round - 1}" in text, text[-3000:]
        for i in range(3):  # reattached without a restart: one registration each, then another
            alog = (tmp_path / f"agent-{i}.log").read_text()
            assert alog.count(f"registered: registered as a{i}, shard {i} of the partition") == 2, alog
            assert "the coordinator announced run ck again (restarted): registering again" in alog, alog

        m = metrics(tmp_path)
        assert [r["round"] for r in m] == list(range(ROUNDS + 1))
        assert m[:crash_round] == before               # nothing already aggregated is lost or redone
        assert all(r["completed"] == ["a0", "a1", "a2"] for r in m[1:]), m
        # the wall clock continues from the checkpoint's elapsed time
        assert m[crash_round]["elapsed_s"] >= before[-1]["elapsed_s"] + m[crash_round]["round_time_s"] - 0.01

        # the same model: round crash_round restarted from round crash_round-1's checkpoint, and the
        # same plan: S2FL's median rule, fed the restored time table, gives every agent the split it
        # had in the crashed attempt of that round
        def assigns(when: Callable[[float], bool]) -> dict[str, dict]:
            evs = sniff.find(lambda ev: ev["dir"] == "down" and ev["type"] == "assign"
                             and ev["round"] == crash_round and when(ev["t"]))
            return {ev["agent"]: ev["body"] for ev in evs}
        crashed, redone = assigns(lambda t: t < t_kill), assigns(lambda t: t > t_kill)
        assert sorted(redone) == sorted(crashed) == ["a0", "a1", "a2"], (crashed.keys(), redone.keys())
        assert {a: b["split"] for a, b in redone.items()} == {a: b["split"] for a, b in crashed.items()}
        assert m[crash_round]["phase"] == "median rule"
        for body in redone.values():
            weights = body["weights"]
            got = wire.decode_state(weights, {k: snap_model[k] for k in weights})
            assert got and all(torch.equal(got[k], snap_model[k]) for k in got)

        # participation counts and per-agent totals: checkpoint + resumed rounds, the crashed round not counted
        state = json.loads((out / "state.json").read_text())
        for a in ("a0", "a1", "a2"):
            reg, snap = state["registry"][a], snap_state["registry"][a]
            assert snap["rounds"] == crash_round - 1 and reg["rounds"] == ROUNDS, (snap, reg)
            assert reg["bytes_up"] == snap["bytes_up"] + sum(r["agents"][a]["bytes_up"] for r in m[crash_round:])
            assert reg["bytes_up"] == sum(r["agents"][a]["bytes_up"] for r in m[1:])
            assert reg["rounds"] == undisturbed["state"]["registry"][a]["rounds"]

        # the time table: what the resumed engine starts from is the checkpoint's, entry for entry
        from coordinator.clock import WallClock
        from coordinator.engine import RoundEngine
        from coordinator.transport import LocalTransport
        from sfl_core.config.run import load_run_config
        from sfl_core.data.builtin import load_dataset
        from sfl_core.estimates import ClientTimeTable

        data = load_dataset("digits")
        engine = RoundEngine(load_run_config(cfg), LocalTransport(), WallClock(), (data.x_test, data.y_test),
                             input_shape=data.input_shape, num_classes=data.num_classes,
                             out_dir=tmp_path / "at-crash", checkpoint=ckpt.load(tmp_path / "at-crash"))
        table = ClientTimeTable.from_json(snap_state["time_table"])
        assert len(table) == 9 and all(not table.get(a, s).estimated for a in ("a0", "a1", "a2") for s in (1, 2, 3))
        assert engine.method.time_table == table and engine.start_round == crash_round
        assert {a: i.rounds for a, i in engine.registry.agents.items()} == {a: crash_round - 1 for a in ("a0", "a1", "a2")}
        # ... and the run kept it: every entry at the end is the checkpoint's or measured after the resume
        final = ClientTimeTable.from_json(state["time_table"])
        for a in ("a0", "a1", "a2"):
            for sp in (1, 2, 3):
                e = final.get(a, sp)
                assert e is not None and not e.estimated and (e == table.get(a, sp) or e.round >= crash_round), (a, sp, e)
        kept = sum(final.get(a, sp) == table.get(a, sp) for a in ("a0", "a1", "a2") for sp in (1, 2, 3))

        check_accuracy(rec, m, undisturbed)
        rec["outcome"] = (f"checkpoint of round {crash_round - 1} resumed (model sent in the restarted round "
                          f"{crash_round} == checkpoint, same S2FL splits as the crashed attempt; time table restored, "
                          f"{kept} of its 9 entries still unchanged at the end); rounds 0..{crash_round - 1} of "
                          f"metrics.jsonl unchanged; "
                          f"the 3 running agents re-registered by themselves and completed rounds "
                          f"{crash_round}..{ROUNDS}; participation counts {ROUNDS} each; all exit codes 0")


# ============================================================ 3. broker restarted mid-round

def test_broker_restarted_mid_round(mosquitto, procs, tmp_path, undisturbed):
    """Mosquitto killed in round 3 after step 4's gradients - while the coordinator waits for the
    agents' next activations - and
    started again on the same port after an outage longer than the step timeout: publishes do
    not wait for the broker, the outage does not count as the agents' silence, so nobody is
    dropped; the coordinator and the agents reconnect, resend what was lost, and every round
    completes with every agent; the final accuracy is compared with the undisturbed run's."""
    crash_round, crash_step, outage_s = 3, 4, STEP_TIMEOUT_S + 4.0
    with fault_record("broker restarted mid-round", f"SIGKILL mosquitto after the gradients of round "
                      f"{crash_round} step {crash_step}; restarted on the same port {outage_s:.0f} s later",
                      undisturbed["final_acc"]) as rec:
        sniff = Sniffer(mosquitto.port, "br")
        try:
            coord = procs.coord(config(tmp_path, "br"), mosquitto.url)
            agents = procs.agents(mosquitto.url, "br")
            # the coordinator has sent every agent its gradients of this step: it now waits for the
            # next activations, so the outage falls into a wait, where silence is measured
            for a in ("a0", "a1", "a2"):
                sniff.wait_for(lambda ev, a=a: ev["dir"] == "down" and ev["type"] == "gradients" and ev["agent"] == a
                               and ev["round"] == crash_round and ev["step"] == crash_step, 150)
            mosquitto.stop()
            t_down = time.monotonic()
            assert metrics(tmp_path)[-1]["round"] == crash_round - 1, "the broker must go down inside the round"
            time.sleep(outage_s)
            mosquitto.start()
            # training traffic of the same round flows again after the restart: it was mid-round
            sniff.wait_for(lambda ev: ev["t"] > t_down and ev["dir"] == "up" and ev["round"] == crash_round
                           and ev["type"] in ("activations", "weights"), 60)
            codes = finish([coord, *agents], RUN_TIMEOUT_S)
        finally:
            sniff.close()
        assert codes == [0, 0, 0, 0], logs(tmp_path)
        m = metrics(tmp_path)
        assert [r["round"] for r in m] == list(range(ROUNDS + 1))
        assert all(r["completed"] == ["a0", "a1", "a2"] for r in m[1:]), m
        assert "dropping" not in (tmp_path / "coord.log").read_text()
        for name in ("coord", "agent-0", "agent-1", "agent-2"):
            text = (tmp_path / f"{name}.log").read_text()
            assert "MQTT reconnected" in text, name
            # the coordinator re-publishes the same run_info (same seq): not taken for a coordinator restart
            assert "registering again" not in text, name
        check_accuracy(rec, m, undisturbed)
        rec["outcome"] = (f"all 4 processes reconnected; round {crash_round} took {m[crash_round]['wall_s']:.1f} s "
                          f"wall (undisturbed {undisturbed['metrics'][crash_round]['wall_s']:.1f} s); "
                          f"every agent completed every round; all exit codes 0")


# ============================================================ 4. a 10x slower agent

def test_slow_agent_is_a_straggler_not_a_failure(mosquitto, procs, tmp_path, undisturbed):
    """Agent a2 (profile s2fl-high-high) runs 10x slower than its profile, compute and link
    (`--slowdown 10` on top of --emulate): never dropped (its step responses stay far inside
    step_timeout_s, and its busy heartbeats keep it alive), every round completes with it, and its
    times are recorded larger - checked in the warm-up rounds, where both runs give every agent the
    same split."""
    slow, factor = "a2", 10
    with fault_record("slow agent", f"{slow} started with --slowdown {factor} (compute and link {factor}x slower "
                      f"than its profile s2fl-high-high, which it still registers)", undisturbed["final_acc"]) as rec:
        coord = procs.coord(config(tmp_path, "sl"), mosquitto.url)
        agents = procs.agents(mosquitto.url, "sl", extra={2: ["--slowdown", str(factor)]})
        assert finish([coord, *agents], RUN_TIMEOUT_S) == [0, 0, 0, 0], logs(tmp_path)
        assert "dropping" not in (tmp_path / "coord.log").read_text()
        m, ref = metrics(tmp_path), undisturbed["metrics"]
        assert [r["round"] for r in m] == list(range(ROUNDS + 1))
        assert all(r["selected"] == r["completed"] == ["a0", "a1", "a2"] for r in m[1:]), m

        def mean(rows, key, agent=slow):
            return sum(rows[r]["agents"][agent][key] for r in WARMUP) / len(WARMUP)

        for r in WARMUP:
            assert m[r]["agents"][slow]["split"] == ref[r]["agents"][slow]["split"] == r
        # the reported compute is at least 10x what the profile's FLOP/s take (emulation sleeps up to it;
        # this machine's real time stands where it is longer, so no exact ratio to the reference run)
        from sfl_core.model.accounting import model_costs
        from sfl_core.config.run import load_profile
        from sfl_core.data.builtin import load_dataset

        costs = model_costs("small_cnn", load_dataset("digits").input_shape, 10)
        prof = load_profile(PROFILES[2])
        for r in WARMUP:
            a = m[r]["agents"][slow]
            target = costs[r].client_flops * BATCH * LOCAL_ITERS / prof.compute_flops * factor
            assert a["compute_s"] >= 0.99 * target, (r, a, target)
            # time_s (its response times) holds every emulated transfer at a tenth of the profile's rate
            transfers = factor * (a["bytes_up"] / prof.link_bytes_per_s + a["bytes_down"] / prof.downlink_bytes_per_s)
            assert a["time_s"] >= 0.95 * (transfers + a["compute_s"]), (r, a, transfers)
        # wall-clock times of two runs on a shared machine differ by load, so they are compared through
        # each run's own slowest profile (a0, s2fl-low-low): the fastest profile, a2, is now recorded as
        # slower than a0, where it was faster in the undisturbed run
        t_slow, t_ref, c_slow, c_ref = mean(m, "time_s"), mean(ref, "time_s"), mean(m, "compute_s"), mean(ref, "compute_s")
        rel_slow, rel_ref = t_slow / mean(m, "time_s", "a0"), t_ref / mean(ref, "time_s", "a0")
        assert rel_slow > 1.0 and rel_slow > rel_ref, (rel_slow, rel_ref, [m[r]["agents"] for r in WARMUP])
        check_accuracy(rec, m, undisturbed)
        splits = [r["agents"][slow]["split"] for r in m[4:]]
        ref_splits = [r["agents"][slow]["split"] for r in ref[4:]]
        rec.update(slow_time_s=round(t_slow, 3), undisturbed_time_s=round(t_ref, 3),
                   slow_compute_s=round(c_slow, 4), undisturbed_compute_s=round(c_ref, 4),
                   time_vs_a0=round(rel_slow, 2), undisturbed_time_vs_a0=round(rel_ref, 2))
        rec["outcome"] = (f"{slow} never dropped, completed all {ROUNDS} rounds; warm-up rounds: mean time_s "
                          f"{t_slow:.2f} s vs {t_ref:.2f} s undisturbed ({rel_slow:.2f}x a0's vs {rel_ref:.2f}x), "
                          f"compute_s {c_slow:.3f} vs {c_ref:.3f}; "
                          f"median-rule splits of {slow} {splits} (undisturbed {ref_splits}); training wall time "
                          f"{sum(r['wall_s'] for r in m):.1f} s vs {sum(r['wall_s'] for r in ref):.1f} s")


# ============================================================ 5. disk full, then a signal: agents keep waiting

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_disk_full_then_signal_agents_wait_for_resume(mosquitto, procs, tmp_path):
    """The disk fills while round 2 is checkpointed (the temporary file is a link to /dev/full:
    ENOSPC from the kernel): `serve` exits 1 with one line naming the file system and the file,
    round 1's checkpoint stays intact, no temporary file is left, and the agents are *not* told
    that the run finished - they wait. `serve --resume` continues with them; a SIGTERM in round 3
    (a service manager's stop) exits 130, again without stopping them; a second `--resume`
    finishes the run and only then do the agents exit, with status 0."""
    rounds = 3
    cfg = write_config(tmp_path, "df", rounds=rounds, local_iters=3, batch_size=BATCH, lr=LR,
                       step_timeout_s=STEP_TIMEOUT_S, register_timeout_s=90)
    out = tmp_path / "out"
    sniff = Sniffer(mosquitto.port, "df")
    try:
        coord = procs.coord(cfg, mosquitto.url)
        agents = procs.agents(mosquitto.url, "df")
        sniff.wait_for(lambda ev: ev["dir"] == "down" and ev["type"] == "assign" and ev["round"] == 2, 120)
        (out / "checkpoint.pt.tmp").symlink_to("/dev/full")      # round 1 is checkpointed; the disk is now full
        assert coord.wait(timeout=120) == 1, logs(tmp_path)
        text = (tmp_path / "coord.log").read_text()
        assert f"no space left on " in text and f"writing {out / 'checkpoint.pt'}" in text, text[-2000:]
        assert "the previous checkpoint is intact" in text and "Traceback" not in text, text[-2000:]
        assert ckpt.load(out)[1]["round"] == 1
        assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
        time.sleep(2.0)
        assert all(a.poll() is None for a in agents), logs(tmp_path)   # nobody told them to stop
        assert not sniff.find(lambda ev: ev["dir"] == "down" and ev["type"] == "shutdown")

        resumed = procs.coord(cfg, mosquitto.url, "--resume", name="coord-resume")
        sniff.wait_for(lambda ev: ev["dir"] == "down" and ev["type"] == "assign" and ev["round"] == 3, 120)
        resumed.send_signal(signal.SIGTERM)
        assert resumed.wait(timeout=60) == 130, logs(tmp_path)
        assert "stopped by a signal; agents keep waiting" in (tmp_path / "coord-resume.log").read_text()
        time.sleep(2.0)
        assert all(a.poll() is None for a in agents), logs(tmp_path)
        assert not sniff.find(lambda ev: ev["dir"] == "down" and ev["type"] == "shutdown")

        final = procs.coord(cfg, mosquitto.url, "--resume", name="coord-final")
        codes = finish([final, *agents], RUN_TIMEOUT_S)
    finally:
        sniff.close()
    assert codes == [0, 0, 0, 0], logs(tmp_path)
    assert sorted(ev["agent"] for ev in sniff.find(lambda ev: ev["dir"] == "down" and ev["type"] == "shutdown")) \
        == ["a0", "a1", "a2"]
    m = metrics(tmp_path)
    assert [r["round"] for r in m] == list(range(rounds + 1))
    assert all(r["completed"] == ["a0", "a1", "a2"] for r in m[1:]), m
