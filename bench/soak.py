"""Soak run: many rounds under random agent kills, broker restarts and hostile traffic.

Two parts, each against an undisturbed run of the same config and seed:

* ``sim`` — the round engine with in-process agents (virtual clock) behind a chaos
  transport: at random messages an agent dies mid-step (its will says offline, its
  messages stop), comes back 1–3 rounds later as a fresh process (new registration,
  nothing remembered), and replays of real agents' earlier messages plus messages from
  invented senders are interleaved with the real traffic.
* ``mqtt`` — real processes over a real Mosquitto: ``sfl-coord serve`` and one
  ``sfl-agent start`` per device; a chaos loop SIGKILLs random agents (restarted a few
  seconds later with the same id) and restarts the broker, while a hostile client replays
  captured messages, publishes garbage and forges senders on the agents' topics.

Reported per part: rounds completed, agents dropped (selected but not completed) and
re-admitted (completed a round after being killed), messages rejected by reason, and the
final accuracy against the undisturbed run.

    python bench/soak.py                       # both parts (~10 min on 2 cores)
    python bench/soak.py --parts sim --rounds 60
"""

from __future__ import annotations

import json
import logging
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401  (puts the repository on sys.path)
import yaml
from brokers import MosquittoBroker, find_mosquitto
from common import base_parser, print_table, write_result

from simulation.clock import VirtualClock
from coordinator.engine import RoundEngine
from coordinator.transport import LocalTransport
from simulation.inprocess import InProcessTransport, build_fleet
from edge_agent.agent import AgentCore, LocalData
from sfl_core.wire import protocol
from sfl_core.config.run import load_run_config
from sfl_core.data.builtin import load_dataset
from sfl_core.data.partition import partition_indices
from sfl_core.wire.protocol import Message

PROFILES = ["s2fl-low-low", "s2fl-mid-mid", "s2fl-high-high", "jetson-nano"]
RUN = "soak"


def run_config(out: Path, *, rounds: int, agents: int, per_round: int, local_iters: int, seed: int,
               step_timeout_s: float) -> Path:
    cfg = {"run": RUN, "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid", "seed": seed},
           "fleet": [{"profile": PROFILES[i % len(PROFILES)], "count": 1} for i in range(agents)],
           "rounds": rounds, "per_round": per_round, "min_agents": per_round, "batch_size": 16, "lr": 0.05,
           "momentum": 0.5, "local_iters": local_iters, "seed": seed, "step_timeout_s": step_timeout_s,
           "register_timeout_s": 120, "output_dir": str(out / "out")}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{RUN}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def summarize(history: list[dict[str, Any]], killed_at: dict[str, list[int]]) -> dict[str, Any]:
    """Rounds, drops, re-admissions and rejections from a run's metrics rows."""
    rounds = [h for h in history if h["round"] > 0]
    dropped = sum(len(set(h["selected"]) - set(h["completed"])) for h in rounds)
    readmitted = 0
    for agent, kills in killed_at.items():
        for r_kill in kills:
            if any(h["round"] > r_kill and agent in h["completed"] for h in rounds):
                readmitted += 1
    rejected: dict[str, int] = {}
    for h in rounds:
        for k, v in h.get("rejected", {}).items():
            rejected[k] = rejected.get(k, 0) + v
    return {"rounds_completed": len(rounds), "dropped": dropped, "kills": sum(len(k) for k in killed_at.values()),
            "readmitted": readmitted, "rejected": rejected, "final_accuracy": rounds[-1]["accuracy"] if rounds else None,
            "accuracy": [h["accuracy"] for h in history]}


# ----------------------------------------------------------------------------- simulation

class ChaosTransport(LocalTransport):
    """In-process transport whose agents die and come back, with hostile traffic mixed in."""

    def __init__(self, inner: InProcessTransport, fresh_agent, registrations: dict[str, Message], seed: int,
                 kill_p: float, hostile_p: float):
        self.inner = inner
        self.fresh_agent = fresh_agent
        self.registrations = registrations
        self.rng = random.Random(seed)
        self.kill_p, self.hostile_p = kill_p, hostile_p
        self.round = 0
        self.dead: dict[str, int] = {}           # agent -> round at which it comes back
        self.killed_at: dict[str, list[int]] = {}
        self.seen: list[Message] = []
        self.held: list[Message] = []
        self.injected = {"replay": 0, "stranger": 0}

    def send(self, agent_id: str, msg: Message) -> int:
        if msg.type == "assign" and msg.round > self.round:
            self.round = msg.round
            self._revive_due()
        if agent_id not in self.dead and msg.type in ("assign", "gradients") and self.rng.random() < self.kill_p:
            self._kill(agent_id)
        if agent_id in self.dead:
            return len(msg.encode())             # into the void: the process is gone
        return self.inner.send(agent_id, msg)

    def poll(self, timeout: float):
        if self.held:
            return self.held.pop(0)
        msg = self.inner.poll(timeout)
        if msg is None:
            if self.dead and len(self.dead) == len(self.inner.agents):
                # the whole fleet is down and the coordinator waits for one agent: time passes
                # (revivals are counted in rounds, and a round nobody trained is planned again)
                self.round += 1
                self._revive_due()
            return None
        if msg.sender in self.dead and msg.type != "status":
            return None                          # sent just before it died: never left the device
        if self.seen and self.rng.random() < self.hostile_p:  # hostile traffic rides on real traffic
            self.held.append(msg)
            msg = self._hostile()
        else:
            self.seen.append(msg)
        return msg

    def _kill(self, agent_id: str) -> None:
        self.dead[agent_id] = self.round + self.rng.randint(1, 3)
        self.killed_at.setdefault(agent_id, []).append(self.round)
        # the broker publishes the dead client's will
        self.inner._inbox.append(Message("status", RUN, agent_id, {"online": False, "instance": "sim"}, seq=0))

    def _revive_due(self) -> None:
        for agent_id, back in list(self.dead.items()):
            if back <= self.round:
                del self.dead[agent_id]
                self.inner.agents[agent_id] = self.fresh_agent(agent_id)
                reg = self.registrations[agent_id]
                self.inner.deliver_from_agent(Message("status", RUN, agent_id, {"online": True, "instance": "sim"},
                                                      seq=protocol.next_seq()))
                self.inner.deliver_from_agent(Message("register", RUN, agent_id, reg.body, seq=protocol.next_seq()))

    def _hostile(self) -> Message:
        # status and heartbeats neither raise the coordinator's bar nor are their replays counted
        # (docs/protocol.md §3): a replay is a message older than the newest other one
        counted = [m for m in self.seen if m.type not in ("status", "heartbeat")]
        latest: dict[str, int] = {}
        for m in counted:
            latest[m.sender] = max(latest.get(m.sender, -1), m.seq)
        older = [m for m in counted if m.seq < latest[m.sender]]
        if older and self.rng.random() < 0.5:
            self.injected["replay"] += 1
            m = self.rng.choice(older)
        else:
            self.injected["stranger"] += 1
            m = self.rng.choice(self.seen)
            m = Message(m.type, m.run, f"stranger-{self.rng.randrange(9)}", m.body, m.round, m.step,
                        protocol.next_seq())
            if m.type == "register":
                m.body = {**m.body, "label_counts": [1]}
        return protocol.decode(m.encode(), run=RUN, allowed=protocol.AGENT_TYPES)


def run_sim(tmp: Path, args, chaos: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cfg = load_run_config(run_config(tmp / ("sim-chaos" if chaos else "sim-clean"), rounds=args.rounds,
                                     agents=args.agents, per_round=args.per_round, local_iters=args.local_iters,
                                     seed=args.seed, step_timeout_s=3))
    data = load_dataset("digits")
    inner = build_fleet(cfg, data)
    transport: Any = inner
    extra: dict[str, Any] = {}
    if chaos:
        shards = partition_indices(data.y_train.numpy(), cfg.num_agents, cfg.data.partition, alpha=cfg.data.alpha,
                                   seed=cfg.data.seed, num_classes=data.num_classes)
        ids = sorted(inner.agents)
        registrations = {m.sender: m for m in inner._inbox if m.type == "register"}

        def fresh_agent(agent_id: str) -> AgentCore:
            i = ids.index(agent_id)
            local = LocalData(data.x_train[shards[i]], data.y_train[shards[i]], data.num_classes)
            return AgentCore(agent_id, RUN, local, data.input_shape, seed=cfg.seed * 1000 + i + 7)

        transport = ChaosTransport(inner, fresh_agent, registrations, seed=args.seed + 1, kill_p=args.kill_p,
                                   hostile_p=0.3)
    engine = RoundEngine(cfg, transport, VirtualClock(), (data.x_test, data.y_test), input_shape=data.input_shape,
                         num_classes=data.num_classes, out_dir=Path(cfg.output_dir))
    history = engine.run()
    if chaos:
        extra = {"killed_at": transport.killed_at, "injected": transport.injected,
                 "rejected_total": engine.rejected_totals()}
    return history, extra


# ----------------------------------------------------------------------------- real processes

class Fleet:
    """Coordinator and agent processes over one Mosquitto, with logs in ``out``."""

    def __init__(self, out: Path, config: Path, broker: MosquittoBroker, agents: int):
        self.out, self.config, self.broker, self.n = out, config, broker, agents
        self.agents: dict[int, subprocess.Popen] = {}
        self.coord: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.out / "coord.log", "a")
        self.coord = subprocess.Popen([sys.executable, "-m", "cli.coord", "serve", "--config", str(self.config),
                                       "--broker", self.broker.url, "--quiet", "--verbose"],
                                      stdout=log, stderr=subprocess.STDOUT, cwd=common.REPO_ROOT)
        for i in range(self.n):
            self.start_agent(i)

    def start_agent(self, i: int) -> None:
        log = open(self.out / f"agent-{i}.log", "a")
        self.agents[i] = subprocess.Popen(
            [sys.executable, "-m", "cli.agent", "start", "--profile", PROFILES[i % len(PROFILES)], "--broker",
             self.broker.url, "--run", RUN, "--index", str(i), "--agent-id", f"a{i}", "--verbose",
             "--coordinator-key", common.coordinator_key(self.out / "out")],
            stdout=log, stderr=subprocess.STDOUT, cwd=common.REPO_ROOT)

    def alive(self) -> bool:
        return self.coord is not None and self.coord.poll() is None

    def close(self) -> None:
        for p in [*self.agents.values(), self.coord]:
            if p is not None and p.poll() is None:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()


def current_round(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    return json.loads(lines[-1])["round"] if lines else 0


def hostile_client(url: str, stop: threading.Event, agents: int, seed: int, counts: dict[str, int]) -> None:
    """Replays captured agent messages, publishes garbage and forged senders on agents' topics."""
    from sfl_core.transport.mqtt_link import MqttLink

    rng = random.Random(seed)
    captured: list[tuple[str, bytes]] = []
    lk = MqttLink(url, "soak-hostile", lambda t, p: captured.append((t, p)) if len(captured) < 500 else None,
                  subscriptions=[f"sfl/{RUN}/up/+"])
    lk.connect(10)
    try:
        while not stop.wait(1.0):
            if not lk.connected:
                continue
            victim = f"a{rng.randrange(agents)}"
            kind = rng.choice(["replay", "garbage", "forged"])
            if kind == "replay" and len(captured) > 20:
                topic, payload = captured[rng.randrange(len(captured) - 10)]
            elif kind == "forged":
                topic = f"sfl/{RUN}/up/{victim}"
                payload = Message("heartbeat", RUN, "a-forger", {"state": "idle"}, seq=protocol.next_seq()).encode()
            else:
                kind, topic, payload = "garbage", f"sfl/{RUN}/up/{victim}", rng.randbytes(rng.randrange(1, 300))
            if lk.publish(topic, payload, timeout=2):
                counts[kind] = counts.get(kind, 0) + 1
    finally:
        lk.close()


def run_mqtt(tmp: Path, args, chaos: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    out = tmp / ("mqtt-chaos" if chaos else "mqtt-clean")
    config = run_config(out, rounds=args.mqtt_rounds, agents=args.agents, per_round=args.per_round,
                        local_iters=args.local_iters, seed=args.seed, step_timeout_s=8)
    rng = random.Random(args.seed + 2)
    killed_at: dict[str, list[int]] = {}
    events: list[dict[str, Any]] = []
    injected: dict[str, int] = {}
    with MosquittoBroker(find_mosquitto()) as broker:
        fleet = Fleet(out, config, broker, args.agents)
        fleet.start()
        stop = threading.Event()
        hostile = None
        if chaos:
            hostile = threading.Thread(target=hostile_client, args=(broker.url, stop, args.agents, args.seed, injected),
                                       daemon=True)
            hostile.start()
        restart_at: dict[int, float] = {}
        t0 = time.monotonic()
        next_event = time.monotonic() + rng.uniform(6, 12)
        metrics = out / "out" / "metrics.jsonl"
        deadline = time.monotonic() + args.mqtt_timeout
        while fleet.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
            now = time.monotonic()
            for i, t in list(restart_at.items()):
                if now >= t:
                    del restart_at[i]
                    fleet.start_agent(i)
                    events.append({"t": round(now - t0, 1), "event": "agent restarted", "agent": f"a{i}"})
            if not chaos or now < next_event or current_round(metrics) < 1:
                continue
            next_event = now + rng.uniform(6, 12)
            r = current_round(metrics)
            if rng.random() < 0.7:
                live = [i for i, p in fleet.agents.items() if p.poll() is None and i not in restart_at]
                if live:
                    i = rng.choice(live)
                    fleet.agents[i].send_signal(signal.SIGKILL)
                    fleet.agents[i].wait()
                    restart_at[i] = now + rng.uniform(3, 8)
                    killed_at.setdefault(f"a{i}", []).append(r)
                    events.append({"t": round(now - t0, 1), "event": "SIGKILL agent", "agent": f"a{i}", "round": r + 1})
            else:
                broker.stop()
                time.sleep(2)
                broker.start()
                events.append({"t": round(now - t0, 1), "event": "broker restarted", "round": r + 1})
        stop.set()
        if hostile is not None:
            hostile.join(timeout=10)
        fleet.close()
        code = fleet.coord.returncode if fleet.coord else None
    history = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return history, {"killed_at": killed_at, "events": events, "injected": injected, "coordinator_exit": code}


# ----------------------------------------------------------------------------- main

def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--parts", default="sim,mqtt", help="comma-separated: sim, mqtt")
    p.add_argument("--rounds", type=int, default=40, help="rounds of the simulated soak")
    p.add_argument("--mqtt-rounds", type=int, default=25, help="rounds of the soak over Mosquitto")
    p.add_argument("--mqtt-timeout", type=float, default=900, help="give the broker soak up to this many seconds")
    p.add_argument("--agents", type=int, default=6)
    p.add_argument("--per-round", type=int, default=4)
    p.add_argument("--local-iters", type=int, default=6)
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the runs' outputs and process logs here (default: a temporary directory)")
    p.add_argument("--kill-p", type=float, default=0.03, help="sim: chance that a message to an agent kills it")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.mqtt_rounds, args.agents, args.per_round, args.local_iters = 6, 4, 4, 3, 3
        args.kill_p = 0.1
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    # the engine logs every rejection and drop: thousands of lines here, so they go to a file
    log_file = (args.out / "soak.log") if not args.quick else Path(tempfile.gettempdir()) / "sfl-soak-quick.log"
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=log_file, level=logging.WARNING, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"engine log: {log_file}")
    results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="sfl-soak-") as tmp_name:
        tmp = args.workdir or Path(tmp_name)
        for part in parts:
            runner = {"sim": run_sim, "mqtt": run_mqtt}[part]
            if part == "mqtt" and find_mosquitto() is None:
                raise SystemExit("mosquitto not installed: apt-get install mosquitto")
            t0 = time.monotonic()
            clean_hist, _ = runner(tmp, args, chaos=False)
            t1 = time.monotonic()
            chaos_hist, extra = runner(tmp, args, chaos=True)
            t2 = time.monotonic()
            clean = summarize(clean_hist, {})
            soak = summarize(chaos_hist, extra.get("killed_at", {}))
            results[part] = {"undisturbed": clean, "soak": soak, **extra,
                             "wall_s": {"undisturbed": round(t1 - t0, 1), "soak": round(t2 - t1, 1)}}
            rejected = ", ".join(f"{k} {v}" for k, v in sorted(soak["rejected"].items())) or "-"
            rows.append([part, f"{soak['rounds_completed']}/{clean['rounds_completed']}", soak["kills"],
                         soak["dropped"], soak["readmitted"], rejected, clean["final_accuracy"],
                         soak["final_accuracy"]])
    print_table("Soak: random agent kills, broker restarts, hostile traffic",
                ["part", "rounds", "kills", "dropped", "readmitted", "rejected", "acc undisturbed", "acc soak"], rows)
    path = write_result(args.out, "soak" if not args.quick else "soak-quick", results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
