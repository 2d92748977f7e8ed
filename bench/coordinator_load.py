"""Coordinator load: how many selected agents per round one ``sfl-coord serve`` process carries.

Command (full run, a few minutes on 2 CPU cores)::

    python bench/coordinator_load.py                          # 10 50 100 200 500 agents per round
    python bench/coordinator_load.py --agents 10 100 --rounds 4
    python bench/coordinator_load.py --registered 2000 --agents 10 --rounds 20   # a large idle fleet, few selected
    python bench/coordinator_load.py --registered 10000 --agents 10 --rounds 20 --agents-per-connection 50
    python bench/coordinator_load.py --agents 100 --rounds 6 --zstd-levels 0 1 3   # what a cheaper codec setting buys
    python bench/coordinator_load.py --agents 100 --rounds 6 --stages   # where the coordinator's CPU goes
    python bench/coordinator_load.py --agents 100 --rounds 4 --window 2   # agents keep 2 steps in flight
    python bench/coordinator_load.py --agents 100 500 --rounds 4 --procs 8 --server-workers 1 2 4   # past one process
    python bench/coordinator_load.py --model vgg11 --split 4 --agents 20 --stages --set robust.label_margin=0
                                                              # what an option costs (here: the label screen)
    python bench/coordinator_load.py --quick                  # smoke-test size, numbers not meaningful

Writes ``bench/results/coordinator_load.json``.

What runs, per load level: a real Mosquitto on 127.0.0.1, the real ``sfl-coord serve`` (one
Python process, server portion on the CPU), and ``--procs`` load-generator processes that host
the agents. Each agent is a real MQTT client (its own connection, retained online status, last
will, heartbeats every 2 s) that speaks the protocol (docs/protocol.md) but does no training: its
activations are one real batch of the data set through the real client portion, computed and
encoded once, and its weights are the client portion it was assigned, sent back unchanged. So the
coordinator sees exactly the traffic of a real fleet of that size, while the generators stay
light enough to share the machine with it. Every agent is selected every round (``per_round`` =
agents) unless ``--registered`` adds idle agents.

Measured over rounds 2..R (round 1 pays model builds and first connections):

- ``steps/s``: local steps the whole fleet completes per second (``local_iters`` x rounds / time
  from the first assignment of round 2 to the last weights of round R, by the agents' clocks);
  ``agent-steps/s`` = steps/s x agents.
- ``act MB/s``: encoded activation bytes into the coordinator per second.
- ``step p50/p90/p99 ms``: per agent and step, activations sent -> gradients received. In merged
  training the server waits for every agent's activations, so this is the lock-step latency a
  device sees, not the server's time for its rows.
- ``coord CPU %`` (100 = one core; all server workers; in the JSON ``leader_cpu_pct``: rank 0
  alone, and ``ranks_cpu_pct``: each rank alone, rank 0 first), ``CPU ms/agent-step``, ``page
  faults/agent-step`` (minor: memory the process gave back to the kernel and touched again),
  ``coord RSS MB`` (peak), ``broker CPU %``, ``gen CPU %`` (all generator processes), from
  /proc, sampled every 0.2 s.
- ``server step %``: the share of the coordinator's round time spent in the server portion's
  forward/backward (``server_s`` in the run's metrics); the rest is receiving, decoding,
  validating, encoding and publishing.
- ``between rounds ms`` / ``%``: from a round's last weights in to the next round's last
  assignment out, its median and its share of the time (``boundary_ms_p50``, ``boundary_pct``):
  what rank 0 works through while the other workers wait, so more server workers do not
  shorten most of it. The score of the round's model, a part of that time, is shared among the
  workers (``coordinator/shard_scoring.py``; ``scored_pct``, from the run's ``eval_s``): the
  rest is the serial share (``serial_pct``), and ``4 workers at most x`` is the bound it puts on
  four (Amdahl's law, ``amdahl_4``; one-worker runs only).
- ``x one worker`` (with ``--server-workers 1 N ...``, each count a pass over the load levels):
  the agent-steps/s of N server workers over one worker's at the same load level, in the same
  invocation (``scaling`` in the JSON), beside ``N at most x``, Amdahl's bound for N from the
  one-worker run's serial share. The goal a user sets past one process is at least
  0.8·N: the processes need N cores beside the broker's and the load generators'.

References in the same invocation, per codec level:

- the floor: the same messages decoded, trained on and answered in one thread with no broker
  (``FloorWork``, each part timed alone), plus the transport's floor (a bare paho client, no
  product code, receiving and publishing messages of the same sizes through the same broker).
  Their sum is the least a coordinator built on paho could spend per agent-step, the server step
  taken on the merged batch of the load level's agents (``its floor ms``); ``x its floor`` is the
  coordinator's CPU per agent-step over it (``floor_ms``, ``floor_ratio`` in the JSON). Under
  the floor's server step lies the physical bound: its floating-point operations (counted by
  ``sfl_core.model.flops``, i.e. PyTorch's ``FlopCounterMode``) at the rate one thread of this CPU
  sustains on a large fp32 matrix product.
- the bare coordinator: the floor's work done as a coordinator with nothing else would do it, in
  one process on paho, driven in lock-step by as many bare paho agents as the load level
  (``bare coordinator ms``; ``x bare`` is the coordinator over it: what the product's own work
  costs, its validation, screens, evaluation, checkpoints and book-keeping). Beside it, the
  transport alone under the same lock-step traffic (``paho lock-step ms``).

With ``--stages`` the coordinator runs under thread CPU timers (``bench/stage_timers.py``): CPU
ms per agent-step of each stage on the round engine's thread (collect, decode, server step,
encode, publish, aggregate, evaluate, checkpoint, the screens, Python's garbage collector, the
rest) and on paho's network thread
(parse/validate, paho's own reading and writing), summed over whole rounds 2..R beside the /proc
figure.

Everything shares this machine's cores: the coordinator's share of them is reported beside its
throughput, so the curve says which resource ran out first (a coordinator process near 100 %
CPU is bound by its one Python thread; a broker near 100 % by Mosquitto; a machine at 100 % by
the cores, generators included).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import common  # noqa: F401  (puts the repository on sys.path)
import stage_timers
import msgpack
import torch
import yaml
from brokers import MosquittoBroker, find_mosquitto, MOSQUITTO_MISSING

from edge_agent.runner import FEATURES
from sfl_core import liveness
from sfl_core.wire import protocol, shared_weights
from sfl_core.wire import codec as wire
from sfl_core.config.run import load_profile
from sfl_core.data.builtin import load_dataset
from sfl_core.model.flops import counter as flop_counter
from sfl_core.model.zoo import build_model
from sfl_core.wire.protocol import Message
from sfl_core.transport.broker_url import parse_broker_url
from sfl_core.transport.mqtt_link import MqttLink, _no_delay

RUN = "load"
PROFILE = "jetson-nano"
TICK_S = 0.2
CONNECTIONS_PER_PROC = 300
"""MQTT connections per generator process at most: paho waits on its sockets with select(), which
takes no descriptor above 1023, and each connection holds three (its socket and paho's wake-up pair)."""


# =========================================================================== the load agents


class LoadAgent:
    """One protocol-speaking agent without a trainer.

    Runs on its connection's network thread (:class:`AgentGroup`): every reply is published from
    the callback (the link does not wait for PUBACKs there), so a generator process needs no
    thread per agent beyond paho's own.
    """

    def __init__(self, agent_id: str, index: int, payload: "Payload", times: list, legacy: bool = False,
                 inline: bool = False):
        self.id = agent_id
        self.index = index
        self.payload = payload
        self.times = times          # (agent, round, step, "act" | "grad" | "assign" | "weights", monotonic s,
        #                              bytes; for "assign", the window it was given)
        self.reassembler = wire.Reassembler()
        self.assign: Optional[Message] = None
        self.step = -1                 # the step whose gradients it waits for
        self.sent = 0                  # steps whose activations it sent this round (up to the window ahead)
        self.done = threading.Event()
        self.registered = threading.Event()
        self.instance = uuid.uuid4().hex[:12]
        self.legacy = legacy                      # beat every 2 s whatever the run says (older agents)
        self.inline = inline                      # takes no copies by reference (shared_weights): older agents
        self.idle_s = liveness.BUSY_HEARTBEAT_S    # until the run description says otherwise
        self.last_sent = time.monotonic()       # its last message of any kind (liveness.due)
        self.last_work = float("-inf")
        self.beats: list[float] = []
        self.link: Optional[MqttLink] = None    # its group's connection (AgentGroup)
        self.group: Optional["AgentGroup"] = None

    def announce(self) -> None:
        self.link.publish(protocol.status_topic(RUN, self.id),
                          self._msg("status", {"online": True, "instance": self.instance}).encode(), retain=True)

    def heartbeat(self) -> None:
        self.beats.append(time.monotonic())
        self.link.publish(protocol.up_topic(RUN, self.id), self._msg("heartbeat", {"state": "idle"}).encode(),
                          timeout=None, qos=0)

    def _msg(self, mtype: str, body: dict, rnd: int = 0, step: int = 0) -> Message:
        return Message(mtype, RUN, self.id, body, round=rnd, step=step, seq=protocol.next_seq())

    def _send(self, msg: Message) -> int:
        worker = self.assign.body.get("server_worker", 0) if self.assign is not None else 0
        topic = protocol.up_topic_for(RUN, self.id, msg.type, worker)
        payload = msg.encode()
        for piece in wire.split_chunks(payload, uuid.uuid4().hex[:12]):
            self.link.publish(topic, piece)
        if not self.legacy:        # older agents beat every 2 s whatever else they send
            self.last_sent = time.monotonic()
        return len(payload)

    def _note(self, rnd: int, step: int, kind: str, t: float, nbytes: int = 0) -> None:
        self.times.append((self.id, rnd, step, kind, t, nbytes))

    def _on_message(self, topic: str, data: bytes) -> None:
        if not data:
            return
        whole = self.reassembler.feed(topic, data)
        if whole is None:
            return
        msg = protocol.decode(whole, run=RUN, allowed=protocol.COORD_TYPES)
        now = time.monotonic()
        if msg.type == "run_info" and not self.legacy:
            self.idle_s = liveness.agreed_idle_s(msg.body.get("heartbeat_idle_s"), liveness.BUSY_HEARTBEAT_S)
        elif msg.type in liveness.WORK_TYPES:
            self.last_work = now
        if msg.type == "run_info" and not self.registered.is_set():
            # a link probe first, as every agent does (the coordinator registers no id that never probed)
            self._send(self._msg("probe", {"nonce": self.index, "pad": b"", "reply_bytes": 0}))
            self._send(self._msg("register", {**self.payload.register_body(self.index),
                                              **({} if self.inline else {"features": list(FEATURES)})}))
        elif msg.type == "accepted":
            self.registered.set()
        elif msg.type == "reject":
            print(f"{self.id}: rejected: {msg.body['reason']}", file=sys.stderr)
            self.done.set()
        elif msg.type == "shutdown":
            self.done.set()
        elif msg.type == "assign":
            ready = self.group.resolve(self, msg)
            if ready is not None:   # else its copy comes on the group's subscription
                self.start(ready, now)
        elif msg.type == "gradients" and self.assign is not None and msg.step == self.step:
            self._note(msg.round, msg.step, "grad", now)
            self.step += 1
            if self.sent < self.assign.body["tau"]:
                self._activations(msg.round)
            elif self.step == self.assign.body["tau"]:
                self._send(self._msg("weights", {"weights": self.assign.body["weights"], "num_samples":
                                                 self.payload.num_samples, "compute_s": 0.0,
                                                 "loss": float("nan")}, msg.round, self.step - 1))
                self._note(msg.round, self.step - 1, "weights", time.monotonic())

    def start(self, msg: Message, now: float) -> None:
        """An assignment with its weights (inline, or from its round's copy): its first steps go out."""
        self.assign, self.step, self.sent = msg, 0, 0
        window = msg.body.get("window", 1)
        self._note(msg.round, 0, "assign", now, window)
        for _ in range(min(window, msg.body["tau"])):   # the steps it may keep in flight
            self._activations(msg.round)

    def _activations(self, rnd: int) -> None:
        """The next step's activations (``sent``: the steps sent so far this round)."""
        body = {"x": self.payload.x(self.assign.body["codec"]), "y": self.payload.y, "compute_s": 0.0}
        t = time.monotonic()
        self._note(rnd, self.sent, "act", t, self._send(self._msg("activations", body, rnd, self.sent)))
        self.sent += 1


class AgentGroup:
    """Agents sharing one MQTT connection (``--agents-per-connection``; one each by default, as
    devices connect). Sharing lets one machine host a fleet of 10,000: the coordinator sees the
    same messages on the same topics, only the broker holds fewer connections (and only the
    group's first agent has a last will)."""

    def __init__(self, url: str, agents: list[LoadAgent]):
        self.agents = agents
        self.by_topic = {protocol.down_topic(RUN, a.id): a for a in agents}
        self.reassembler = wire.Reassembler()
        self.copies = shared_weights.Copies(RUN)          # the round's copies, for all the group's agents
        self.waiting: dict[LoadAgent, Message] = {}       # assignments whose copy has not come yet
        first = agents[0]
        will = Message("status", RUN, first.id, {"online": False, "instance": first.instance}).encode()
        self.link = MqttLink(url, f"load-{first.id}-{first.instance[:6]}", self._on_message,
                             subscriptions=[*self.by_topic, protocol.info_topic(RUN), protocol.model_wildcard(RUN)],
                             will=(protocol.status_topic(RUN, first.id), will, True))
        for a in agents:
            a.link, a.group = self.link, self

    def start(self) -> None:
        self.link.connect(timeout=60)
        for a in self.agents:
            a.announce()

    def _on_message(self, topic: str, data: bytes) -> None:
        if topic == protocol.info_topic(RUN):
            for a in self.agents:
                a._on_message(topic, data)
        elif topic.startswith(f"sfl/{RUN}/model/"):
            whole = self.reassembler.feed(topic, data) if data else None
            if whole is None:
                return
            self.copies.received(whole)     # decoded once for the group's agents
            waiting, self.waiting = self.waiting, {}
            for a, msg in waiting.items():
                ready = self.resolve(a, msg)
                if ready is not None:
                    a.start(ready, time.monotonic())
        elif topic in self.by_topic:
            self.by_topic[topic]._on_message(topic, data)

    def resolve(self, agent: LoadAgent, assign: Message) -> Optional[Message]:
        """``assign`` with its weights, or None while the copy it names has not come (it waits)."""
        ready = self.copies.resolve(assign)
        if ready is None:
            self.waiting[agent] = assign
        return ready


class Payload:
    """What every agent sends: one real batch through the real client portion, encoded once.

    Built in the bench's own process (:meth:`build`) and handed to the generators as a file, so
    a generator needs neither the data set nor the model: with hundreds of agents per process
    and dozens of processes for a large idle fleet, the machine's memory goes to the agents."""

    def __init__(self, doc: dict):
        self.doc = doc
        self.y = doc["y"]
        self.num_classes = doc["num_classes"]
        self.num_samples = doc["num_samples"]
        self.profile = doc["profile"]
        self.split = doc["split"]

    @classmethod
    def build(cls, spec: dict) -> "Payload":
        data = load_dataset(spec["dataset"], spec["root"])
        torch.manual_seed(0)
        model = build_model(spec["model"], data.input_shape, data.num_classes)
        xb, yb = data.x_train[:spec["batch_size"]], data.y_train[:spec["batch_size"]]
        with torch.no_grad():
            out = model.client(spec["split"])(xb)
        return cls({"x": {c: wire.encode_tensor(out, c, spec["zstd_level"]) for c in spec["codecs"]},
                    "y": wire.encode_tensor(yb.to(torch.int64), "fp32", spec["zstd_level"]),
                    "num_classes": data.num_classes, "num_samples": 600,
                    "profile": protocol.profile_body(load_profile(PROFILE)), "split": spec["split"]})

    def save(self, path: Path) -> None:
        path.write_bytes(msgpack.packb(self.doc, use_bin_type=True))

    @classmethod
    def load(cls, path: str) -> "Payload":
        return cls(msgpack.unpackb(Path(path).read_bytes(), raw=False))

    def x(self, codec: str) -> dict:
        return self.doc["x"][codec]

    def register_body(self, index: int) -> dict:
        counts = [self.num_samples // self.num_classes] * self.num_classes
        counts[0] += self.num_samples - sum(counts)
        return {"index": index, "profile": self.profile, "label_counts": counts, "num_samples": self.num_samples,
                "measured": {"compute_s_per_sample": {str(self.split): 1e-4}, "up_bytes_per_s": 1e8,
                             "down_bytes_per_s": 1e8, "rtt_s": 1e-3},
                "emulate": False, "resume": {"rounds_done": 0}}


def worker(spec_file: str) -> int:
    """A generator process: connect its agents, serve until the run's shutdown, write the timings.
    Its agents heartbeat as real ones do (:func:`sfl_core.liveness.due`): every 2 s in a round,
    at the run's idle interval otherwise, and not while their other messages say they are alive."""
    spec = json.loads(Path(spec_file).read_text())
    payload = Payload.load(spec["payload"])
    times: list = []
    agents = [LoadAgent(a, i, payload, times, spec["legacy"], spec["inline"]) for a, i in spec["agents"]]
    per = spec["per_connection"]
    groups = [AgentGroup(spec["url"], agents[i:i + per]) for i in range(0, len(agents), per)]
    for g in groups:
        g.start()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(liveness.BUSY_HEARTBEAT_S):
            now = time.monotonic()
            for a in agents:
                if liveness.due(now, a.last_sent, a.last_work, False, liveness.BUSY_HEARTBEAT_S, a.idle_s):
                    a.last_sent = now
                    a.heartbeat()

    threading.Thread(target=beat, daemon=True).start()
    deadline = time.monotonic() + spec["timeout_s"]
    for a in agents:
        a.done.wait(max(0.1, deadline - time.monotonic()))
    stop.set()
    for g in groups:
        g.link.close()
    Path(spec["out"]).write_text(json.dumps({"times": times, "done": sum(a.done.is_set() for a in agents),
                                             "beats": [t for a in agents for t in a.beats]}))
    return 0


# =========================================================================== measuring a level


def _stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/PID/stat after the command name (the state first), or None once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> Optional[float]:
    """utime + stime of a process (and its reaped children), from /proc."""
    fields = _stat(pid)
    return None if fields is None else sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def minor_faults(pid: int) -> Optional[int]:
    """Minor page faults of a process so far (pages mapped in from memory, not from disk), from
    /proc: memory the process handed back to the kernel and faulted in again shows here."""
    fields = _stat(pid)
    return None if fields is None else int(fields[7])


def rss_mb(pid: int) -> Optional[float]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def with_children(pid: int) -> list[int]:
    """``pid`` and its child processes (``serve --server-workers`` starts its other ranks)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    return [pid, *(int(k) for k in kids)]


def rank_of(pid: int) -> Optional[int]:
    """The server worker rank of a process ``serve --server-workers`` started (its ``RANK``, set
    in its environment at start as ``torchrun`` sets it); None for any other process."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    rank = next((v[5:] for v in environ if v.startswith(b"RANK=")), b"")
    return int(rank) if rank.isdigit() else None


class Sampler(threading.Thread):
    """CPU seconds of each watched process (by role) and peak RSS, every TICK_S. The
    coordinator's role counts its child processes too (its other server workers)."""

    def __init__(self, roles: dict[str, list[int]]):
        super().__init__(daemon=True)
        self.roles = roles
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.peak_rss: dict[str, float] = {}
        self.last: dict[int, float] = {}
        self.faults: list[tuple[float, int]] = []      # the coordinator's minor page faults so far
        self._ranks: dict[int, Optional[int]] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(TICK_S):
            row: dict[str, float] = {}
            for role, pids in self.roles.items():
                if role == "coord":
                    pids = self.roles[role] = sorted(set(pids) | set(with_children(pids[0])))
                total, rss = 0.0, 0.0
                for pid in pids:
                    c = cpu_seconds(pid)
                    if c is not None:
                        self.last[pid] = c
                    total += self.last.get(pid, 0.0)
                    rss += rss_mb(pid) or 0.0
                if role == "coord":
                    row["leader"] = self.last.get(pids[0], 0.0)   # rank 0 alone: with several ranks, their limit
                    for pid in pids[1:]:                           # each further rank alone: which one the others wait for
                        if pid not in self._ranks:              # read once: a process keeps its rank
                            self._ranks[pid] = rank_of(pid)
                        rank = self._ranks[pid]
                        if rank:
                            row[f"rank{rank}"] = self.last.get(pid, 0.0)
                    self.peak_rss[role] = max(self.peak_rss.get(role, 0.0), rss)
                    self.faults.append((time.monotonic(), sum(minor_faults(p) or 0 for p in pids)))
                row[role] = total
            self.samples.append((time.monotonic(), row))

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def faults_between(self, t0: float, t1: float) -> float:
        """The coordinator's minor page faults from about ``t0`` to about ``t1`` (as :meth:`cpu_between`)."""
        before = [f for t, f in self.faults if t <= t0]
        after = [f for t, f in self.faults if t >= t1]
        return float(after[0] - before[-1]) if before and after else float("nan")

    def cpu_between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU % (100 = one core) of each role from the last sample at or before ``t0`` to the
        first at or after ``t1`` (the window's edges to within one tick)."""
        before = [s for s in self.samples if s[0] <= t0]
        after = [s for s in self.samples if s[0] >= t1]
        if not before or not after:
            return {}
        (a, ra), (b, rb) = before[-1], after[0]
        return {role: 100 * (rb[role] - ra.get(role, 0.0)) / (b - a) for role in rb}


def profile_file(args: Any, agents: int) -> str:
    """Where py-spy writes the profile of one load level (and zstd level and server workers, where
    several run)."""
    return (f"{args.py_spy}-{agents}" + (f"-zstd{args.zstd_level}" if len(args.zstd_levels) > 1 else "")
            + (f"-workers{args.workers}" if len(args.server_workers) > 1 else "") + ".txt")


def settings(pairs: Sequence[str]) -> dict[str, Any]:
    """``--set`` pairs as the run config's mapping: ``KEY=VALUE``, a dotted key naming a section's
    setting (``robust.label_margin=0`` -> ``{"robust": {"label_margin": 0}}``), the value read as
    YAML. Raises ``ValueError`` for a pair without a key and a value."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value or "" in key.split("."):
            raise ValueError(f"--set {pair}: expected KEY=VALUE, e.g. robust.label_margin=0")
        *sections, last = key.split(".")
        node = out
        for part in sections:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {pair}: {part} is set to a value already")
        node[last] = yaml.safe_load(value)
    return out


def write_config(tmp: Path, args: Any, agents: int, registered: int) -> Path:
    cfg = {
        "run": RUN, "model": args.model,
        "data": {"dataset": args.dataset_name, "root": args.dataset_root, "partition": "iid", "seed": 0},
        "fleet": [{"profile": PROFILE, "count": registered}], "per_round": agents, "rounds": args.rounds,
        "strategy": "sfl", "split": args.split, "server_mode": "merged", "batch_size": args.batch,
        "local_iters": args.tau, "codec": args.codec, "zstd_level": args.zstd_level, "lr": 0.01,
        "eval_samples": 256, "step_timeout_s": 300, "register_timeout_s": 900, "register_rate_per_s": 1000,
        "output_dir": str(tmp / "out"), "window": args.window,
    }
    path = tmp / "load.yaml"
    path.write_text(yaml.safe_dump(common.deep_merge(cfg, settings(args.set))))
    return path


def run_level(url: str, broker_pid: int, args: Any, payload: Payload, agents: int, registered: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sfl-bench-load-") as tmp_s:
        tmp = Path(tmp_s)
        config = write_config(tmp, args, agents, registered)
        coord_log = open(tmp / "coord.log", "w")
        spy = ["py-spy", "record", "--format", "raw", "--threads", "--subprocesses", "-o",
               profile_file(args, agents), "--"] if args.py_spy else []
        timers = tmp / "stages.json"
        launch = [str(Path(__file__).with_name("stage_timers.py")), str(timers)] if args.stages else ["-m", "cli.coord"]
        coord = subprocess.Popen([*spy, sys.executable, *launch, "serve", "--config", str(config),
                                  "--broker", url, "--quiet", "--device", "cpu",
                                  "--server-workers", str(args.workers)],
                                 stdout=coord_log, stderr=subprocess.STDOUT, cwd=common.REPO_ROOT,
                                 env={**os.environ, "OMP_NUM_THREADS": str(args.coord_threads)})
        ids = [(f"a{i}", i) for i in range(registered)]
        procs, outs = [], []
        connections = math.ceil(registered / args.agents_per_connection)
        n_procs = min(max(args.procs, math.ceil(connections / CONNECTIONS_PER_PROC)), registered)
        payload_file = tmp / "payload.msgpack"
        payload.save(payload_file)
        for p in range(n_procs):
            out = tmp / f"gen{p}.json"
            spec = {"url": url, "agents": ids[p::n_procs], "out": str(out), "timeout_s": args.timeout,
                    "payload": str(payload_file), "legacy": args.legacy_heartbeats, "inline": args.inline_weights,
                    "per_connection": args.agents_per_connection}
            spec_file = tmp / f"gen{p}.spec.json"
            spec_file.write_text(json.dumps(spec))
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(spec_file)],
                                          stdout=open(tmp / f"gen{p}.log", "w"), stderr=subprocess.STDOUT,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}))
            outs.append(out)
        sampler = Sampler({"coord": [coord.pid], "broker": [broker_pid], "gen": [p.pid for p in procs]})
        sampler.start()
        try:
            code = coord.wait(timeout=args.timeout)
            for p in procs:
                p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            sampler.stop()
            for p in [coord, *procs]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            coord_log.close()
        if code != 0:
            raise RuntimeError(f"{agents} agents: sfl-coord serve exited {code}:\n"
                               f"{(tmp / 'coord.log').read_text(errors='replace')[-3000:]}")
        metrics = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
        gens = [json.loads(out.read_text()) for out in outs]
        stage_totals = json.loads(timers.read_text()) if args.stages else None
        times = [t for g in gens for t in g["times"]]
        beats = [t for g in gens for t in g["beats"]]
    result = summarise(args, agents, registered, metrics, times, sampler)
    result["generators"] = n_procs
    t0, t1 = result.pop("window")
    result["heartbeats_per_s"] = sum(1 for t in beats if t0 <= t <= t1) / (t1 - t0)
    if stage_totals is not None:
        result["stage_cpu_ms"] = stage_ms(stage_totals, args.tau * result["rounds_measured"] * agents)
    return result


def summarise(args: Any, agents: int, registered: int, metrics: list[dict], times: list,
              sampler: Sampler) -> dict[str, Any]:
    rounds = [m for m in metrics if m["round"] >= 2]
    if not rounds or any(len(m["completed"]) != agents for m in rounds):
        raise RuntimeError(f"{agents} agents: expected every round complete, got "
                           f"{[(m['round'], len(m['completed'])) for m in metrics if m['round'] >= 1]}")
    measured = [t for t in times if t[1] >= 2]
    t0 = min(t for _, r, _, kind, t, _ in measured if kind == "assign" and r == 2)
    t1 = max(t for _, r, _, kind, t, _ in measured if kind == "weights" and r == args.rounds)
    window = t1 - t0
    steps = args.tau * len(rounds)
    act_bytes = sum(n for _, _, _, kind, _, n in measured if kind == "act")
    latencies = step_latencies(measured)
    q = statistics.quantiles(latencies, n=100)
    cpu = sampler.cpu_between(t0, t1)
    coord_cpu = cpu.get("coord", float("nan"))
    wall = sum(m["wall_s"] for m in rounds)
    server_s = sum(max(a["server_s"] for a in m["agents"].values()) for m in rounds)
    return {
        "agents": agents, "registered": registered, "rounds_measured": len(rounds), "window_s": round(window, 3),
        "window": (t0, t1),
        "windows": sorted({n for _, _, _, kind, _, n in measured if kind == "assign"}),
        "steps_per_s": steps / window, "agent_steps_per_s": steps * agents / window,
        "act_mb_per_s": act_bytes / 1e6 / window, "act_kb_per_message": act_bytes / 1e3 / (steps * agents),
        "step_ms_p50": 1e3 * q[49], "step_ms_p90": 1e3 * q[89], "step_ms_p99": 1e3 * q[98],
        "coord_cpu_pct": coord_cpu, "leader_cpu_pct": cpu.get("leader"),
        "ranks_cpu_pct": [cpu.get("leader"), *(cpu.get(f"rank{r}") for r in range(1, args.workers))]
        if args.workers > 1 else None,
        "coord_cpu_ms_per_agent_step": 10 * coord_cpu * window / (steps * agents),
        "coord_faults_per_agent_step": sampler.faults_between(t0, t1) / (steps * agents),
        "coord_rss_mb": sampler.peak_rss.get("coord"), "broker_cpu_pct": cpu.get("broker"),
        "gen_cpu_pct": cpu.get("gen"), "server_step_pct": 100 * server_s / wall,
        # the scores of rounds 2..R-1 fall inside the window (round 1's before it, round R's after it)
        **round_boundaries(times, t0, t1, one_worker=args.workers == 1,
                           scored_s=sum(m.get("eval_s", 0.0) for m in rounds if m["round"] < args.rounds)),
    }


def worker_scaling(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run of N > 1 server workers that has a one-worker run at the same load level and codec
    setting: its agent-steps/s over that run's (``x_one_worker``), beside Amdahl's bound for N
    from the one-worker run's serial share (``amdahl_bound``)."""
    one = {(r["zstd_level"], r["agents"]): r for r in results if r["server_workers"] == 1}
    out = []
    for r in results:
        base = one.get((r["zstd_level"], r["agents"]))
        if r["server_workers"] == 1 or base is None:
            continue
        b, n = base["serial_pct"] / 100, r["server_workers"]
        out.append({"zstd_level": r["zstd_level"], "agents": r["agents"], "server_workers": n,
                    "agent_steps_per_s": r["agent_steps_per_s"], "ranks_cpu_pct": r.get("ranks_cpu_pct"),
                    "x_one_worker": r["agent_steps_per_s"] / base["agent_steps_per_s"],
                    "amdahl_bound": amdahl(b, n) if b > 0 else None})
    return out


def round_boundaries(times: list, t0: float, t1: float, one_worker: bool = True,
                     scored_s: float = 0.0) -> dict[str, Any]:
    """Between rounds, the coordinator's rank 0 works while no agent trains and no other server
    worker steps: from a round's last weights in to the next round's last assignment out
    (aggregation, evaluation, checkpoint, planning, assignments). ``boundary_pct``: its share of
    the measured window ``t0..t1``; ``boundary_ms_p50``: its median between measured rounds
    (None with one). More server workers shorten the steps, and of this only the score:
    ``scored_s``, the seconds the run scored its model inside the window, which the workers share
    (``scored_pct``). With a serial share ``s`` = the time between rounds less the score
    (``serial_pct``), N workers serve at most ``1 / (s + (1 - s) / N)`` times the agent-steps of
    one (Amdahl's bound), ``amdahl_4`` for N = 4 (None unless ``one_worker``: the shares are one
    worker's). Counted as serial, the score would put the bound below what N workers can reach."""
    last_in: dict[int, float] = {}
    last_out: dict[int, float] = {}
    for _, r, _, kind, t, _ in times:
        if kind in ("weights", "assign"):
            last = last_in if kind == "weights" else last_out
            last[r] = max(t, last.get(r, t))
    between = {r: (last_in[r], last_out[r + 1]) for r in last_in if r + 1 in last_out}
    b = sum(max(0.0, min(end, t1) - max(start, t0)) for start, end in between.values()) / (t1 - t0)
    scored = min(b, scored_s / (t1 - t0))
    measured = [end - start for start, end in between.values() if start >= t0]
    return {"boundary_ms_p50": 1e3 * statistics.median(measured) if measured else None, "boundary_pct": 100 * b,
            "scored_pct": 100 * scored, "serial_pct": 100 * (b - scored),
            "amdahl_4": amdahl(b - scored, 4) if one_worker else None}


def amdahl(serial: float, n: int) -> float:
    """Amdahl's bound: the most ``n`` workers can speed up a run whose share ``serial`` only one can do."""
    return 1 / (serial + (1 - serial) / n)


def step_latencies(times: list) -> list[float]:
    """Activations sent -> gradients received, per agent and step."""
    sent = {(a, r, k): t for a, r, k, kind, t, _ in times if kind == "act"}
    return [t - sent[(a, r, k)] for a, r, k, kind, t, _ in times if kind == "grad" and (a, r, k) in sent]


# =========================================================================== where the CPU goes

def stage_ms(doc: dict[str, Any], agent_steps: int) -> dict[str, float]:
    """Thread CPU ms per agent-step of each stage (:mod:`stage_timers`' file ``doc``) over rounds
    2..R: the running totals at the end of round R less those at the end of round 1."""
    first, last = doc["rounds"][0]["cpu_s"], doc["rounds"][-1]["cpu_s"]
    # to 0.1 µs: the process's clock and the threads' read a hair apart ("other threads" ~ 0)
    return {s: round(1e3 * (last[s] - first[s]) / agent_steps, 4) + 0.0 for s in doc["stages"]}


class FloorWork:
    """The floor's work, as functions of the bytes on the wire: decode and validate one real
    activations message (envelope, schema, tensor, labels), the server portion's
    forward/backward/update on a merged batch, encode one gradients message. :func:`floor` times
    each alone; :func:`lockstep` runs them as a coordinator with nothing else would."""

    def __init__(self, args: Any, payload: Payload):
        from coordinator.uploads import decode_activations

        self.args, self.payload = args, payload
        self.act = Message("activations", RUN, "a0", {"x": payload.x(args.codec), "y": payload.y, "compute_s": 0.0},
                           round=1, step=0, seq=1).encode()
        self.shape = tuple(payload.x(args.codec)["shape"][1:])
        self._decode_activations = decode_activations

        class _Assigned:      # what decode_activations reads of an assignment
            batch_size, activation_shape = args.batch, self.shape

        self._assigned = _Assigned
        data = load_dataset(args.dataset_name, args.dataset_root)
        model = build_model(args.model, data.input_shape, data.num_classes)
        self.server = model.server(args.split)
        self.opt = torch.optim.SGD(self.server.parameters(), lr=0.01)

    def decode(self, data: bytes, out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows and labels of one activations message; the rows decoded into ``out`` if given."""
        msg = protocol.decode(data, run=RUN, allowed=protocol.AGENT_TYPES)
        x, y = self._decode_activations(msg.body, self._assigned, self.payload.num_classes, out=out)
        assert y is not None
        return x, y

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The server step on merged rows of ``args.batch`` per agent: each agent's input gradient
        scaled back to its own mean loss's, as the server trainer answers it."""
        self.opt.zero_grad()
        x.grad = None
        loss = torch.nn.functional.cross_entropy(self.server(x), y)
        loss.backward()
        self.opt.step()
        assert x.grad is not None
        return x.grad.mul_(len(x) / self.args.batch)

    def encode(self, grad: torch.Tensor) -> bytes:
        body = {"g": wire.encode_tensor(grad, self.args.codec, self.args.zstd_level)}
        return Message("gradients", RUN, protocol.COORDINATOR_ID, body, round=1, step=0, seq=1).encode()

    def answer(self, messages: list[bytes]) -> list[bytes]:
        """One lock-step server step: every message decoded where its rows lie in the merged batch
        (as the server trainer places them), the batch trained on, one gradients message back per
        message, in order."""
        b = self.args.batch
        x = torch.empty((len(messages) * b, *self.shape))
        y = torch.cat([self.decode(m, out=x[i * b:(i + 1) * b])[1] for i, m in enumerate(messages)])
        grad = self.step(x.requires_grad_(), y)
        return [self.encode(g) for g in grad.split(b)]


def floor(args: Any, payload: Payload, agents: int = 100, levels: Sequence[int] = ()) -> dict[str, Any]:
    """The coordinator's unavoidable work per agent-step (:class:`FloorWork`), in this process
    with no broker, each part alone: decoding one activations message, the server step on the
    merged batch of ``agents`` such messages (per agent), encoding one gradients message.
    Milliseconds of one thread each. The server step is also measured on the merged batch of
    each load level of ``levels`` (agents per round), ``server_step_ms_at``: a step's cost per row
    depends on how many rows it merges, and a coordinator at that load pays the cost of that size.

    Measured with the allocator setting ``sfl-coord serve`` makes at start
    (:func:`coordinator.allocator.keep_freed_memory`, ``kept_freed_memory`` in the result) and
    after three warm-up steps: with glibc's defaults each step would fault in its freed pages
    again, work the coordinator does not do, and the floor would read high."""
    from coordinator.allocator import keep_freed_memory
    from coordinator.garbage_collection import spare_startup_objects

    kept = keep_freed_memory()
    torch.set_num_threads(1)
    work = FloorWork(args, payload)
    spare_startup_objects()    # as sfl-coord serve does before its first round
    one, labels = work.decode(work.act)

    def merged(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` agents' rows and labels (every load agent sends the same batch)."""
        return one.repeat(n, *([1] * len(work.shape))).requires_grad_(), labels.repeat(n)

    x, y = merged(agents)
    grad = work.step(x, y)[:args.batch]

    def per_call_ms(fn, n: int, warm: int = 1) -> float:
        for _ in range(warm):
            fn()
        t0 = time.process_time()
        for _ in range(n):
            fn()
        return 1e3 * (time.process_time() - t0) / n

    out = {"decode_ms": per_call_ms(lambda: work.decode(work.act), 400),
           "server_step_ms": per_call_ms(lambda: work.step(x, y), 10, warm=3) / agents,
           "encode_ms": per_call_ms(lambda: work.encode(grad), 400)}
    out["total_ms"] = sum(out.values())
    out["act_bytes"], out["grad_bytes"] = len(work.act), len(work.encode(grad))
    at: dict[str, float] = {}
    for n in sorted(set(levels)):
        at[str(n)] = per_call_ms(functools.partial(work.step, *merged(n)), max(2, 1000 // n), warm=3) / n
    out["server_step_ms_at"] = at
    out["kept_freed_memory"] = kept
    with flop_counter() as flops:
        work.step(x, y)
    out["server_step_mflop"] = flops.get_total_flops() / agents / 1e6
    out["matmul_gflops"] = matmul_gflops(1024 if args.quick else 2048)
    out["server_step_bound_ms"] = out["server_step_mflop"] / out["matmul_gflops"]
    return out


def matmul_gflops(n: int, calls: int = 3) -> float:
    """The arithmetic this core sustains: one thread's best of ``calls`` n×n fp32 matrix products,
    in GFLOP/s. The server step's floating-point operations at this rate are the least time any
    trainer on this CPU spends on them (the physical bound under the floor's server step)."""
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = math.inf
    for _ in range(calls):
        t0 = time.process_time()
        a @ b
        best = min(best, time.process_time() - t0)
    return 2 * n ** 3 / best / 1e9


def _bare_paho(url: str, client_id: str) -> Any:
    """A paho client with no product code around it, set up as the product's link sets its own
    (MQTT 3.1.1, 100 messages in flight, TCP_NODELAY), connected and its loop started."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    address = parse_broker_url(url)
    client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id,
                         protocol=mqtt.MQTTv311)
    client.max_inflight_messages_set(100)
    client.on_socket_open = _no_delay
    client.connect(address.host, address.port)
    client.loop_start()
    return client


def _bare_receive(url: str, size: int, messages: int, qos: int) -> float:
    """Milliseconds of this process's CPU (every thread) per message for a bare paho client
    subscribed at ``qos`` to receive ``messages`` payloads of ``size`` bytes that another process
    publishes through the broker (QoS 1, as agents publish), measured from the first on."""
    got, last = [0], threading.Event()
    clock: list[float] = []

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        got[0] += 1
        if got[0] == 1:
            clock.append(time.process_time())
        elif got[0] == messages:
            clock.append(time.process_time())
            last.set()

    client = _bare_paho(url, f"sfl-bench-bare-paho-q{qos}")
    client.on_message = on_message
    client.subscribe("bare/up/#", qos=qos)
    try:
        time.sleep(0.5)                               # the subscription is in place
        sender = subprocess.Popen([sys.executable, __file__, "--flood", url, str(size), str(messages)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            if not last.wait(120):
                raise RuntimeError(f"transport floor: only {got[0]} of {messages} messages arrived")
        finally:
            sender.wait(timeout=60)
    finally:
        client.loop_stop()
        client.disconnect()
    return 1e3 * (clock[1] - clock[0]) / (messages - 1)


def transport_floor(url: str, act_bytes: int, grad_bytes: int, messages: int = 3000) -> dict[str, float]:
    """What any coordinator built on paho pays the transport per agent-step, with no product code:
    a bare paho client (:func:`_bare_paho`) in this process receives ``messages`` payloads of the
    activations' size that another process publishes through the same broker (QoS 1), then
    publishes as many of the gradients' size, 100 at a time, each burst's acknowledgements
    awaited (as a step's gradients go). Milliseconds of this process's CPU (every thread) per
    message, each way; and, beside it, the product's own link (``MqttLink.publish_many``, the
    coordinator's path) publishing the same bursts.

    ``receive_qos0_ms``: the same reception subscribed at QoS 0, which the coordinator does not
    do (docs/scaling.md): the broker then sends no message that needs an acknowledgement back,
    but drops messages for a subscriber that reads slower than they arrive."""
    receive_ms = _bare_receive(url, act_bytes, messages, qos=1)
    receive_qos0_ms = _bare_receive(url, act_bytes, messages, qos=0)
    payload = bytes(grad_bytes)
    client = _bare_paho(url, "sfl-bench-bare-paho")
    try:
        t0 = time.process_time()
        for start in range(0, messages, 100):
            infos = [client.publish(f"bare/down/a{i}", payload, qos=1) for i in range(start, start + 100)]
            for info in reversed(infos):     # acknowledged in order: the last one's wait covers the burst
                info.wait_for_publish(timeout=60)
        publish_ms = 1e3 * (time.process_time() - t0) / messages
    finally:
        client.loop_stop()
        client.disconnect()
    link = MqttLink(url, "sfl-bench-product-link", lambda topic, data: None)
    link.connect()
    try:
        t0 = time.process_time()
        for start in range(0, messages, 100):
            link.publish_many([(f"bare/down/a{i}", payload) for i in range(start, start + 100)], timeout=60)
        link_publish_ms = 1e3 * (time.process_time() - t0) / messages
    finally:
        link.close()
    return {"receive_ms": receive_ms, "publish_ms": publish_ms, "total_ms": receive_ms + publish_ms,
            "link_publish_ms": link_publish_ms, "receive_qos0_ms": receive_qos0_ms}


def bare_fleet(url: str, first: int, count: int, steps: int, message_file: str) -> int:
    """``--bare-fleet``: agents ``a<first>`` .. as bare paho clients (:func:`_bare_paho`, one
    connection each), every one sending the bytes of ``message_file``, waiting for its answer and
    sending them again, ``steps`` times (QoS 1, as agents publish): a lock-step fleet's traffic
    with no product code on the agents' side."""
    payload = Path(message_file).read_bytes()
    finished = threading.Semaphore(0)
    clients = []
    for i in range(first, first + count):
        subscribed, left = threading.Event(), [steps]

        def on_message(client: Any, userdata: Any, msg: Any, i: int = i, left: list = left) -> None:
            left[0] -= 1
            if left[0] > 0:
                client.publish(f"bare/up/a{i}", payload, qos=1)
            else:
                finished.release()

        client = _bare_paho(url, f"sfl-bench-bare-agent-{i}")
        client.on_message = on_message
        client.on_subscribe = lambda *_, subscribed=subscribed: subscribed.set()
        client.subscribe(f"bare/down/a{i}", qos=1)
        clients.append((i, client, subscribed))
    for i, client, subscribed in clients:
        if not subscribed.wait(60):
            raise RuntimeError(f"bare agent a{i}: subscription not acknowledged")
        client.publish(f"bare/up/a{i}", payload, qos=1)
    for _ in clients:
        finished.acquire(timeout=300)
    for _, client, _ in clients:     # all told first: each loop then ends at once, not after its select's timeout
        client.disconnect()
    for _, client, _ in clients:
        client.loop_stop()
    return 0


def lockstep(url: str, agents: int, procs: int, steps: int, message: bytes,
             answer: Callable[[list[bytes]], list[bytes]], warm: int = 2) -> float:
    """A coordinator with nothing but paho and ``answer`` under a lock-step fleet's traffic:
    milliseconds of this process's CPU (every thread) per agent-step. It waits for ``message``
    from each of ``agents`` :func:`bare_fleet` agents in ``procs`` other processes, then sends
    them ``answer(the messages)``, 100 at a time, each burst's acknowledgements awaited (as the
    coordinator sends a step's gradients), ``steps`` times. Measured from the first step's last
    arrival to the last step's, after ``warm`` steps (the first ones grow the heap to a step's
    size): ``steps`` - 1 - ``warm`` answers and arrivals per agent.

    With ``answer`` returning gradients-sized bytes and nothing else, the transport's floor as
    a round's traffic has it (messages arriving from many connections while answers go out,
    beside :func:`transport_floor`'s one-way streams); with :meth:`FloorWork.answer`, the floor's
    work done in one process, as against its parts timed alone."""
    from coordinator.garbage_collection import spare_startup_objects

    spare_startup_objects()    # as sfl-coord serve does before its first round
    got: list[tuple[str, bytes]] = []
    full = threading.Event()

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        got.append((msg.topic, msg.payload))   # paho's thread appends; the main thread takes a full step
        if len(got) == agents:
            full.set()

    client = _bare_paho(url, "sfl-bench-bare-coordinator")
    client.on_message = on_message
    client.subscribe("bare/up/#", qos=1)
    t0 = t1 = 0.0
    with tempfile.NamedTemporaryFile(prefix="sfl-bench-bare-", suffix=".bin") as f:
        f.write(message)
        f.flush()
        share = [agents // procs + (1 if p < agents % procs else 0) for p in range(procs)]
        fleet = [subprocess.Popen([sys.executable, __file__, "--bare-fleet", url, str(sum(share[:p])), str(n),
                                   str(steps), f.name], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                 for p, n in enumerate(share) if n]
        try:
            time.sleep(0.5)                                # the subscription is in place
            for k in range(steps):
                if not full.wait(300):
                    raise RuntimeError(f"lock-step run: step {k}: {len(got)} of {agents} messages arrived")
                if k == warm:
                    t0 = time.process_time()
                elif k == steps - 1:
                    t1 = time.process_time()
                step = got[:]
                got.clear()
                full.clear()
                replies = answer([m for _, m in step])
                for start in range(0, agents, 100):
                    infos = [client.publish(topic.replace("/up/", "/down/", 1), reply, qos=1)
                             for (topic, _), reply in zip(step[start:start + 100], replies[start:start + 100])]
                    infos[-1].wait_for_publish(timeout=60)   # acknowledged in order: the last covers the burst
            for p in fleet:
                p.wait(timeout=120)
        finally:
            for p in fleet:
                if p.poll() is None:
                    p.kill()
            client.loop_stop()
            client.disconnect()
    return 1e3 * (t1 - t0) / (agents * (steps - 1 - warm))


def flood(url: str, size: int, count: int) -> int:
    """``--flood``: publish ``count`` payloads of ``size`` bytes with a bare paho client, QoS 1,
    from 100 topics (one per agent), as fast as the broker takes them."""
    client = _bare_paho(url, "sfl-bench-flood")
    payload = bytes(size)
    infos = [client.publish(f"bare/up/a{i % 100}", payload, qos=1) for i in range(count)]
    for info in infos:
        info.wait_for_publish(timeout=120)
    client.loop_stop()
    client.disconnect()
    return 0


def heartbeat_cost(url: str, beats: int = 4000) -> float:
    """Coordinator CPU microseconds per heartbeat, measured end to end in this process: a real
    ``MqttTransport`` receives ``beats`` heartbeats that another process publishes over the broker
    (QoS 1, as agents send them), and a real fleet session takes each as the engine does (replay
    check, liveness). This process's CPU time covers every thread: paho's reading and
    acknowledging, parsing and validating, and the session's book-keeping."""
    from coordinator.mqtt_transport import MqttTransport
    from coordinator.registry import Registry
    from coordinator.session import FleetSession
    from sfl_core.config.run import run_config_from_dict

    run = "beats"
    cfg = run_config_from_dict({"run": run, "model": "small_cnn", "data": {"dataset": "digits"},
                                "fleet": [{"profile": PROFILE, "count": 10_000}]})
    transport = MqttTransport(url, run).start()
    session = FleetSession(cfg, transport, Registry(10), virtual=False, now=time.monotonic,
                           on_event=lambda *a: None, on_drop=lambda a: None)
    sender = subprocess.Popen([sys.executable, __file__, "--beats", url, run, str(beats)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        got, t0 = 0, None
        deadline = time.monotonic() + 120
        while got < beats - 1 and time.monotonic() < deadline:   # the first beat only starts the clock
            msg = session._receive(0.5)      # noqa: SLF001  (the engine's own intake)
            if msg is None:
                continue
            if t0 is None:
                t0 = time.process_time()
                continue                      # measured from the first beat on
            session.dispatch(msg, None)
            got += 1
        cpu = time.process_time() - (t0 or time.process_time())
    finally:
        sender.wait(timeout=60)
        transport.close()
    if got < beats - 1:
        raise RuntimeError(f"heartbeat cost: only {got} of {beats} heartbeats arrived")
    return 1e6 * cpu / max(got, 1)


def send_beats(url: str, run: str, count: int) -> int:
    """``--beats``: publish ``count`` heartbeats from 50 agent ids, as fast as the broker takes them."""
    link = MqttLink(url, f"beats-{uuid.uuid4().hex[:6]}", lambda t, p: None)
    link.connect(timeout=30)
    for i in range(count):
        agent = f"b{i % 50}"
        msg = Message("heartbeat", run, agent, {"state": "idle"}, seq=protocol.next_seq())
        link.publish(protocol.up_topic(run, agent), msg.encode(), timeout=30)
    link.close()
    return 0


# =========================================================================== main


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--agents", type=int, nargs="+", default=None,
                   help="selected agents per round, one load level each (default 10 50 100 200 500)")
    p.add_argument("--registered", type=int, default=None,
                   help="agents registered in all (default: as many as selected); the rest heartbeat idle")
    p.add_argument("--procs", type=int, default=4, help="load-generator processes (default 4)")
    p.add_argument("--model", default="small_cnn", help="zoo model (default small_cnn)")
    p.add_argument("--split", type=int, default=2, help="split point (default 2)")
    p.add_argument("--batch", type=int, default=8, help="batch per agent and step (default 8)")
    p.add_argument("--tau", type=int, default=5, help="local steps per round (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per level; round 1 is not measured (default 3)")
    p.add_argument("--codec", default="fp16", help="activation codec (default fp16)")
    p.add_argument("--zstd-levels", type=int, nargs="+", default=[3],
                   help="the run's zstd_level (both directions), one pass over the load levels each (default 3, "
                        "the product's default; 0 sends raw bytes); with others than 3 alone, results go to "
                        "coordinator_load_zstd<L1>-<L2>....json")
    p.add_argument("--coord-threads", type=int, default=1, help="OMP_NUM_THREADS of the coordinator (default 1)")
    p.add_argument("--server-workers", type=int, nargs="+", default=[1],
                   help="sfl-coord serve --server-workers N, one pass over the load levels each (default 1); "
                        "with 1 and more, each N is read against one worker at the same load (x one worker); "
                        "results go to coordinator_load_workers<N1>-<N2>....json")
    p.add_argument("--window", type=int, default=1,
                   help="the run's window: steps each load agent keeps in flight (default 1, lock-step); "
                        "results go to coordinator_load_windowW.json")
    p.add_argument("--stages", action="store_true",
                   help="time the coordinator's stages with thread CPU timers (bench/stage_timers.py): CPU ms "
                        "per agent-step of each, on the round engine's thread and paho's network thread")
    p.add_argument("--py-spy", metavar="PREFIX", default=None,
                   help="profile the coordinator with py-spy (pip install py-spy): writes PREFIX-<agents>.txt, "
                        "collapsed stacks per thread for a flame graph (its CPU figures then include py-spy's "
                        "own; for the CPU per stage use --stages: a sampler counts a thread waiting for the GIL "
                        "as busy)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="the coordinator's run-config settings, a dotted key for a section's (e.g. "
                        "robust.label_margin=0 norm_stats.freeze_after=1: what an option costs, against a run "
                        "without --set); results go to coordinator_load_set-<KEY>-<VALUE>....json")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per level (default 900)")
    p.add_argument("--agents-per-connection", type=int, default=1,
                   help="agents sharing one MQTT connection (default 1, as devices connect; e.g. 50 to host "
                        "--registered 10000 on one machine)")
    p.add_argument("--inline-weights", action="store_true",
                   help="agents take no copies by reference: every assignment carries its client portion, as "
                        "before sfl_core.wire.shared_weights (the reference for the time between rounds); "
                        "results go to coordinator_load_inline.json")
    p.add_argument("--legacy-heartbeats", action="store_true",
                   help="agents heartbeat every 2 s whatever the run announces or they send, as agents "
                        "before the idle interval did (the reference for --registered)")
    args = p.parse_args(argv)
    if args.stages and args.server_workers != [1]:
        p.error("--stages times the leader's process only; run it with one server worker")
    if min(args.server_workers) < 1 or len(set(args.server_workers)) != len(args.server_workers):
        p.error("--server-workers: distinct counts of 1 or more")
    try:
        settings(args.set)
    except ValueError as e:
        p.error(str(e))
    if args.quick:
        args.agents, args.rounds, args.tau, args.procs = args.agents or [4], 2, 2, 2
    levels = args.agents or [10, 50, 100, 200, 500]
    if find_mosquitto() is None:
        raise SystemExit(MOSQUITTO_MISSING)
    ds = common.load_data(args.data)
    args.dataset_name = ds.name
    given = Path(args.data).expanduser()
    args.dataset_root = str(given.resolve()) if given.exists() else None

    results, payloads = [], {}
    with MosquittoBroker() as broker:
        for level in args.zstd_levels:
            args.zstd_level = level
            payloads[level] = Payload.build({"dataset": args.dataset_name, "root": args.dataset_root,
                                             "model": args.model, "split": args.split, "batch_size": args.batch,
                                             "zstd_level": level, "codecs": [args.codec]})
            for workers, n in itertools.product(args.server_workers, levels):
                args.workers = workers   # this pass's, as args.zstd_level is
                registered = max(n, args.registered or n)
                print(f"{n} agents per round ({registered} registered), zstd level {level}, "
                      f"{args.workers} server worker(s) ...", flush=True)
                res = run_level(broker.url, broker.pid, args, payloads[level], n, registered)
                res["zstd_level"], res["server_workers"] = level, args.workers
                results.append(res)
                print(f"  {res['steps_per_s']:.2f} steps/s, coordinator CPU {res['coord_cpu_pct']:.0f} % "
                      f"(rank 0: {res['leader_cpu_pct']:.0f} %)", flush=True)
        version = broker.version()
        print("the coordinator's cost of one heartbeat ...", flush=True)
        beat_us = heartbeat_cost(broker.url, 400 if args.quick else 4000)
        print("the floor: the same work in one thread with no broker; the transport's, with bare paho ...",
              flush=True)
        bounds = {}
        for level in args.zstd_levels:
            args.zstd_level = level
            bounds[level] = floor(args, payloads[level], levels=[r["agents"] for r in results])
            bounds[level]["transport"] = transport_floor(broker.url, bounds[level]["act_bytes"],
                                                         bounds[level]["grad_bytes"], 300 if args.quick else 3000)
            work, b = FloorWork(args, payloads[level]), bounds[level]
            zeros = bytes(b["grad_bytes"])

            def answer_sized(messages: list[bytes], zeros: bytes = zeros) -> list[bytes]:
                return [zeros] * len(messages)

            b["transport"]["lockstep_ms"], b["bare_coordinator_ms_at"] = {}, {}
            for n in sorted({r["agents"] for r in results if r["zstd_level"] == level}):
                warm = 1 if args.quick else 2
                steps = warm + 1 + (2 if args.quick else max(3, 3000 // n))
                b["transport"]["lockstep_ms"][str(n)] = lockstep(broker.url, n, args.procs, steps,
                                                                 bytes(len(work.act)), answer_sized, warm)
                b["bare_coordinator_ms_at"][str(n)] = lockstep(broker.url, n, args.procs, steps, work.act, work.answer,
                                                               warm)
    for r in results:   # the coordinator against the least any coordinator on paho spends, at its load, in this run
        b = bounds[r["zstd_level"]]
        r["floor_ms"] = (b["total_ms"] - b["server_step_ms"] + b["server_step_ms_at"][str(r["agents"])]
                         + b["transport"]["total_ms"])
        r["floor_ratio"] = r["coord_cpu_ms_per_agent_step"] / r["floor_ms"]
        r["bare_coordinator_ms"] = b["bare_coordinator_ms_at"][str(r["agents"])]
        r["bare_coordinator_ratio"] = r["coord_cpu_ms_per_agent_step"] / r["bare_coordinator_ms"]
    scaling = worker_scaling(results)
    cores = os.cpu_count()
    rows = [[r["zstd_level"], r["server_workers"], r["agents"], r["registered"], r["steps_per_s"],
             r["agent_steps_per_s"], r["act_mb_per_s"], r["step_ms_p50"], r["step_ms_p90"], r["step_ms_p99"],
             r["coord_cpu_pct"],
             r["coord_cpu_ms_per_agent_step"], r["floor_ms"], r["floor_ratio"], r["bare_coordinator_ms"],
             r["bare_coordinator_ratio"], r["coord_faults_per_agent_step"], r["coord_rss_mb"],
             r["broker_cpu_pct"], r["gen_cpu_pct"], r["server_step_pct"],
             *("-" if r[k] is None else r[k] for k in ("boundary_ms_p50", "boundary_pct", "scored_pct", "amdahl_4")),
             r["heartbeats_per_s"]] for r in results]
    common.print_table(
        f"sfl-coord serve under load: {args.model} split {args.split} on {ds.name}, batch {args.batch}, "
        f"tau {args.tau}, {args.codec}, server on CPU, {cores} cores shared by all processes",
        ["zstd level", "server workers", "agents", "registered", "steps/s", "agent-steps/s", "act MB/s", "step p50 ms", "p90 ms", "p99 ms",
         "coord CPU %", "CPU ms/agent-step", "its floor ms", "x its floor", "bare coordinator ms", "x bare",
         "page faults/agent-step", "coord RSS MB", "broker CPU %", "gen CPU %",
         "server step %", "between rounds ms", "between rounds %", "of which the score %", "4 workers at most x",
         "heartbeats/s"],
        rows, caption="CPU % = 100 per core; measured over rounds 2..R; gen = the load generators; between rounds: "
                      "a round's last weights in to the next round's last assignment out, which more server "
                      "workers do not shorten but for the score they share (4 workers at most: Amdahl's bound "
                      "from the rest)")
    common.print_table(
        "the floor, per agent-step (one thread, no broker, 100 agents' rows per server step), and the "
        "transport's (bare paho through the same broker: one activations-sized message in, one gradients-sized out; "
        "and in lock-step with as many bare agents as each load level)",
        ["zstd level", "decode + validate ms", "server step ms", "encode ms", "total ms", "agent-steps/s per core",
         "paho receive ms", "paho receive at QoS 0 ms", "paho publish ms", "product link publish ms",
         "total with paho ms", "paho lock-step ms at each load (agents: ms)", "server step MFLOP",
         "core's matmul GFLOP/s", "server step at that rate ms", "server step ms at each load (agents: ms)"],
        [[level, b["decode_ms"], b["server_step_ms"], b["encode_ms"], b["total_ms"], 1e3 / b["total_ms"],
          b["transport"]["receive_ms"], b["transport"]["receive_qos0_ms"], b["transport"]["publish_ms"],
          b["transport"]["link_publish_ms"],
          b["total_ms"] + b["transport"]["total_ms"],
          ", ".join(f"{n}: {ms:.3f}" for n, ms in b["transport"]["lockstep_ms"].items()),
          b["server_step_mflop"], b["matmul_gflops"], b["server_step_bound_ms"],
          ", ".join(f"{n}: {ms:.3f}" for n, ms in b["server_step_ms_at"].items())]
         for level, b in bounds.items()])
    if scaling:
        common.print_table(
            "past one process: N server workers against one, at the same load",
            ["zstd level", "agents", "server workers", "agent-steps/s", "x one worker", "N at most x", "goal 0.8·N",
             "each rank's CPU %"],
            [[s["zstd_level"], s["agents"], s["server_workers"], s["agent_steps_per_s"], s["x_one_worker"],
              "-" if s["amdahl_bound"] is None else s["amdahl_bound"], 0.8 * s["server_workers"],
              " / ".join("-" if c is None else f"{c:.0f}" for c in s["ranks_cpu_pct"] or ())] for s in scaling],
            caption="N at most: Amdahl's bound for N from the one-worker run's serial share; each rank's "
                    "CPU: rank 0 first (a step's all-reduce waits for the busiest); the N processes share this "
                    f"machine's {cores} cores with the broker and the load generators")
    bound = bounds[args.zstd_levels[0]]
    fleets = (10, 2_000, 10_000)
    liveness_rows = [[n, liveness.idle_heartbeat_s(n), n / liveness.idle_heartbeat_s(n),
                      n / liveness.idle_heartbeat_s(n) * beat_us / 1e4, n / liveness.BUSY_HEARTBEAT_S * beat_us / 1e4]
                     for n in fleets]
    common.print_table(
        f"liveness: an idle fleet's heartbeats and their coordinator CPU ({beat_us:.0f} µs per heartbeat, measured)",
        ["registered", "idle interval s", "heartbeats/s", "coordinator CPU % of a core",
         "before (every 2 s), CPU %"], liveness_rows)
    timed = [r for r in results if "stage_cpu_ms" in r]
    if timed:
        common.print_table(
            "where the coordinator's CPU goes: thread CPU ms per agent-step of each stage (rounds 2..R)",
            ["zstd level", "agents", *stage_timers.STAGES, "sum", "/proc"],
            [[r["zstd_level"], r["agents"], *(r["stage_cpu_ms"][k] for k in stage_timers.STAGES),
              sum(r["stage_cpu_ms"].values()), r["coord_cpu_ms_per_agent_step"]] for r in timed],
            caption="engine thread: collect .. engine other; paho's network thread: parse/validate, paho")
    doc = {"quick": args.quick, "broker": version, "config": common.config_record(args), "levels": results,
           "floor": bound, "heartbeat_us": beat_us, **({"scaling": scaling} if scaling else {}),
           **({"floor_by_zstd_level": {str(k): v for k, v in bounds.items()}} if len(bounds) > 1 else {}),
           "liveness": [dict(zip(("registered", "idle_interval_s", "heartbeats_per_s", "coord_cpu_pct",
                                  "coord_cpu_pct_every_2s"), row)) for row in liveness_rows]}
    name = ("coordinator_load" + ("_workers" + "-".join(map(str, args.server_workers))
                                  if args.server_workers != [1] else "")
            + (f"_window{args.window}" if args.window > 1 else "")
            + (f"_registered{args.registered}" if args.registered else "")
            + ("_legacy" if args.legacy_heartbeats else "")
            + ("_inline" if args.inline_weights else "")
            + ("_zstd" + "-".join(map(str, args.zstd_levels)) if args.zstd_levels != [3] else "")
            + "".join("_set-" + re.sub(r"[^A-Za-z0-9._-]+", "-", pair.replace("=", "-")) for pair in args.set))
    path = common.write_result(args.out, name, doc)
    print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2]))
    if len(sys.argv) == 5 and sys.argv[1] == "--beats":
        sys.exit(send_beats(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    if len(sys.argv) == 7 and sys.argv[1] == "--bare-fleet":
        sys.exit(bare_fleet(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]))
    if len(sys.argv) == 5 and sys.argv[1] == "--flood":
        sys.exit(flood(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    main()
