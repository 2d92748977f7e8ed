"""The agent process: MQTT in, :class:`AgentCore` in the middle, MQTT out.

Lifecycle: connect -> read the retained run description -> load only this device's shard
-> measure compute and link -> register -> serve assignments until ``shutdown``.

Resilience: paho reconnects by itself and :class:`MqttLink` re-subscribes; what can be lost
is a message in flight. Recovery is driven by the coordinator: when the agent's heartbeat
says "idle" while the coordinator waits for it, the coordinator re-sends its last message,
and the agent answers a duplicate by re-sending its last reply. Gradients are applied at
most once per (round, step) by :class:`AgentCore`.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from sfl_core import protocol, wire
from sfl_core.accounting import model_costs
from sfl_core.broker_url import BrokerAddress
from sfl_core.config import DeviceProfile
from sfl_core.data import load_dataset
from sfl_core.models import build_model
from sfl_core.partition import load_shard_file, shard_for_agent
from sfl_core.protocol import Message

from edge_agent.agent import AgentCore, LocalData
from edge_agent.emulation import Emulator
from edge_agent.mqtt_link import MqttLink
from edge_agent.profiler import measure_compute, measure_link

log = logging.getLogger("sfl.agent")


@dataclass
class AgentOptions:
    broker: str | BrokerAddress
    run_id: str
    agent_id: str
    profile: DeviceProfile
    index: int = 0
    data_root: Optional[str] = None
    shard_file: Optional[str] = None
    emulate: bool = False
    slowdown: float = 1.0
    """With ``emulate``: run this many times slower than the profile (fault injection for tests)."""
    seed: int = 0
    withhold_labels: bool = False
    """Keep labels on the device: the coordinator sends logits back and this agent scores them."""
    heartbeat_s: float = 2.0
    retry_s: float = 5.0
    """Registration is re-sent after this long without an answer."""
    wait_s: float = 600.0
    """How long to wait for the coordinator's run description / acceptance."""


class AgentError(RuntimeError):
    """A fatal, explained problem (rejected registration, unusable data)."""


class AgentRunner:
    def __init__(self, opts: AgentOptions):
        self.o = opts
        protocol.check_id("run id", opts.run_id)
        protocol.check_id("agent id", opts.agent_id)
        self.emulator = Emulator(opts.profile, opts.slowdown) if opts.emulate else None
        self._inbox: "queue.Queue[Message]" = queue.Queue()
        self._probe_acks: "queue.Queue[Message]" = queue.Queue()
        self._run_info: Optional[Message] = None
        self._joined: Optional[Message] = None   # the run description we registered against
        self._measured: dict = {}
        self._run_info_ready = threading.Event()
        self._reassembler = wire.Reassembler()
        self._stop = threading.Event()
        self.core: Optional[AgentCore] = None
        self._busy = False
        self.bytes_up = 0
        self.bytes_down = 0
        self.rejections = protocol.Rejections(log)
        self._seqs = protocol.ReplayGuard()  # the coordinator's messages on our down topic
        status = protocol.status_topic(opts.run_id, opts.agent_id)
        offline = Message("status", opts.run_id, opts.agent_id, {"online": False}).encode()
        self.link = MqttLink(opts.broker, f"sfl-{opts.run_id}-{opts.agent_id}", self._on_message,
                             subscriptions=[protocol.down_topic(opts.run_id, opts.agent_id),
                                            protocol.info_topic(opts.run_id)],
                             will=(status, offline, True))
        self.link.add_reconnect_callback(self._announce_online)

    # ================================================================ lifecycle
    def run(self) -> int:
        self.link.connect(timeout=30)
        try:
            self._announce_online()
            info = self._wait_run_info()
            self.core = self._build_core(info)
            self._measured = self._measure(info)
            self._register(info, self._measured)
            heartbeat = threading.Thread(target=self._heartbeat, daemon=True)
            heartbeat.start()
            self._serve()
            return 0
        finally:
            self._stop.set()
            # best effort and short: after a shutdown the broker may already be gone (an embedded
            # one stops with its coordinator), and a waiting agent would outlive its run
            self._publish_raw(protocol.status_topic(self.o.run_id, self.o.agent_id),
                              self._msg("status", {"online": False}).encode(), retain=True, timeout=3)
            self.link.close()
            if self.rejections.total:
                log.warning("rejected %d message(s) in this run: %s", self.rejections.total, self.rejections.counts())

    def stop(self) -> None:
        self._stop.set()

    # ================================================================ steps
    def _wait_run_info(self) -> Message:
        log.info("waiting for the coordinator's description of run %s", self.o.run_id)
        if not self._run_info_ready.wait(self.o.wait_s):
            raise AgentError(f"no coordinator announced run {self.o.run_id!r} within {self.o.wait_s:.0f} s "
                             f"(is sfl-coord serve running against {self.link.address.url()}?)")
        assert self._run_info is not None
        return self._run_info

    def _build_core(self, info: Message) -> AgentCore:
        b = info.body
        data = load_dataset(b["dataset"], self.o.data_root)
        labels = data.y_train.numpy()
        if self.o.shard_file:
            idx = load_shard_file(self.o.shard_file)
            if len(idx) and int(idx.max()) >= len(labels):
                raise AgentError(f"shard file {self.o.shard_file} indexes beyond the {len(labels)} training samples")
        else:
            p = b["partition"]
            if not 0 <= self.o.index < b["num_agents"]:
                raise AgentError(f"--index {self.o.index} outside 0..{b['num_agents'] - 1} for this run")
            idx = shard_for_agent(labels, self.o.index, b["num_agents"], p["scheme"], alpha=p["alpha"],
                                  seed=p["seed"], num_classes=data.num_classes)
        t = torch.as_tensor(idx, dtype=torch.long)
        local = LocalData(data.x_train[t], data.y_train[t], data.num_classes)
        if tuple(b["input_shape"]) != tuple(data.input_shape) or b["num_classes"] != data.num_classes:
            raise AgentError(f"local data {data.input_shape}/{data.num_classes} classes does not match the run's "
                             f"{tuple(b['input_shape'])}/{b['num_classes']}")
        log.info("loaded shard of %d samples (%s)", len(local), b["dataset"])
        hook = self.emulator.compute if self.emulator else None
        return AgentCore(self.o.agent_id, self.o.run_id, local, data.input_shape,
                         seed=self.o.seed * 1000 + self.o.index, compute_hook=hook,
                         withhold_labels=self.o.withhold_labels)

    def _measure(self, info: Message) -> dict:
        b = info.body
        torch.manual_seed(0)
        model = build_model(b["model"], tuple(b["input_shape"]), b["num_classes"])
        costs = model_costs(b["model"], tuple(b["input_shape"]), b["num_classes"])
        splits = [s for s in b["splits"] if s in costs]
        compute = measure_compute(model, splits, {s: costs[s].client_flops for s in splits},
                                  compute_hook=self.emulator.compute if self.emulator else None)
        link = measure_link(self._probe)
        log.info("measured: link up %.2f MB/s down %.2f MB/s rtt %.1f ms", link["up_bytes_per_s"] / 1e6,
                 link["down_bytes_per_s"] / 1e6, link["rtt_s"] * 1e3)
        return {"compute_s_per_sample": {str(s): v for s, v in compute.items()}, **link}

    def _probe(self, up_bytes: int, down_bytes: int) -> float:
        nonce = random.getrandbits(48)
        msg = self._msg("probe", {"nonce": nonce, "pad": bytes(up_bytes), "reply_bytes": down_bytes})
        t0 = time.perf_counter()
        self._publish(msg)
        deadline = t0 + 30
        while time.perf_counter() < deadline:
            try:
                ack = self._probe_acks.get(timeout=deadline - time.perf_counter())
            except queue.Empty:
                break
            if ack.body["nonce"] == nonce:
                if self.emulator:
                    self.emulator.downlink(ack.wire_bytes)
                return time.perf_counter() - t0
        raise AgentError("the coordinator did not answer a link probe within 30 s")

    def _register(self, info: Message, measured: dict, again: bool = False) -> None:
        assert self.core is not None
        self._joined = info  # the coordinator's announcement this registration answers
        body = {"index": self.o.index, "profile": protocol.profile_body(self.o.profile), "measured": measured,
                "label_counts": self.core.data.label_counts(), "num_samples": len(self.core.data),
                "emulate": self.o.emulate, "resume": {"rounds_done": self.core.rounds_done}}
        deadline = time.monotonic() + self.o.wait_s
        register = self._msg("register", body)  # re-sent as is: the same seq marks it as a duplicate
        while time.monotonic() < deadline:
            self._publish(register)
            try:
                reply = self._inbox.get(timeout=self.o.retry_s)
            except queue.Empty:
                continue
            if reply.type == "accepted":
                log.info("registered: %s", reply.body["message"])
                return
            if reply.type == "assign":  # our 'accepted' was lost but we are in: keep the assignment
                self._inbox.put(reply)
                return
            if reply.type == "reject":
                raise AgentError(f"registration rejected: {reply.body['reason']}")
            if reply.type == "shutdown":
                if again:  # a run that ends while we re-register: stop as usual
                    self._inbox.put(reply)
                    return
                raise AgentError(f"coordinator is shutting down: {reply.body['reason']}")
        raise AgentError("the coordinator did not accept the registration in time")

    def _rejoin(self, info: Message) -> None:
        """A new run description while serving: the coordinator restarted (``serve --resume`` after
        a crash) and knows us only from its checkpoint, so register again; the round that was in
        flight restarts with its new assignment. Shard and measurements stay unless the run changed."""
        log.info("the coordinator announced run %s again (restarted): registering again", self.o.run_id)
        if info.body != self._joined.body:
            self.core = self._build_core(info)
            self._measured = self._measure(info)
        self._register(info, self._measured, again=True)

    def _serve(self) -> None:
        assert self.core is not None
        while not self._stop.is_set():
            info = self._run_info
            if info is not None and self._joined is not None and info.seq != self._joined.seq:
                self._rejoin(info)
            try:
                msg = self._inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            if msg.type == "shutdown":
                log.info("coordinator says stop: %s", msg.body["reason"])
                return
            if msg.type in ("accepted", "reject"):
                if msg.type == "reject":
                    log.warning("coordinator rejected us: %s", msg.body["reason"])
                continue
            self._busy = True
            try:
                if self.emulator:
                    if msg.type == "assign":
                        self.emulator.at_round(msg.round)
                    self.emulator.downlink(msg.wire_bytes)
                replies = self.core.handle(msg)
                for reply in replies:
                    self._publish(reply)
            except (wire.WireError, ValueError) as exc:
                self.rejections.reject("invalid", f"{msg.type} (round {msg.round} step {msg.step}): {exc}")
            finally:
                self._busy = False

    # ================================================================ network
    def _on_message(self, topic: str, payload: bytes) -> None:
        if not payload:
            return
        try:
            whole = self._reassembler.feed(topic, payload)
            if whole is None:
                return
            msg = protocol.decode(whole, run=self.o.run_id, allowed=protocol.COORD_TYPES)
        except wire.WireError as exc:
            self.rejections.reject(exc.reason, f"message on {topic}: {exc}")
            return
        if msg.sender != protocol.COORDINATOR_ID:
            self.rejections.reject("spoofed", f"{msg.type} on {topic}: sender {msg.sender!r} is not the coordinator")
            return
        if (msg.type == "run_info") != (topic == protocol.info_topic(self.o.run_id)):
            self.rejections.reject("malformed", f"{msg.type} not allowed on {topic}")
            return
        if msg.type not in ("run_info", "probe_ack"):  # probe acks come from another coordinator thread
            if self._seqs.is_replay(msg):
                self.rejections.reject("replayed", f"{msg.type} on {topic}: seq {msg.seq} is older than "
                                                   f"{self._seqs.last(msg.sender)}")
                return
            self._seqs.advance(msg)
        self.bytes_down += msg.wire_bytes
        if msg.type == "run_info":
            self._run_info = msg
            self._run_info_ready.set()
        elif msg.type == "probe_ack":
            self._probe_acks.put(msg)
        else:
            self._inbox.put(msg)

    def _publish(self, msg: Message) -> None:
        payload = msg.encode()
        self.bytes_up += len(payload)
        if self.emulator:
            self.emulator.uplink(len(payload))
        topic = protocol.up_topic(self.o.run_id, self.o.agent_id)
        for piece in wire.split_chunks(payload, uuid.uuid4().hex[:12]):
            self._publish_raw(topic, piece)

    def _publish_raw(self, topic: str, payload: bytes, retain: bool = False, timeout: float = 60) -> None:
        if not self.link.publish(topic, payload, retain=retain, timeout=timeout):
            log.warning("publish to %s not acknowledged within %.0f s", topic, timeout)

    def _announce_online(self) -> None:
        self.link.publish(protocol.status_topic(self.o.run_id, self.o.agent_id),
                          self._msg("status", {"online": True}).encode(), retain=True, timeout=10)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.o.heartbeat_s):
            state = "busy" if self._busy else "idle"
            self.link.publish(protocol.up_topic(self.o.run_id, self.o.agent_id),
                              self._msg("heartbeat", {"state": state}).encode(), timeout=5)

    def _msg(self, mtype: str, body: dict) -> Message:
        rnd = self.core.round if self.core and self.core.round >= 0 else 0
        return Message(mtype, self.o.run_id, self.o.agent_id, body, round=rnd, seq=protocol.next_seq())
