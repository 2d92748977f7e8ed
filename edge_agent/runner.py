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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from edge_agent.agent import AgentCore, LocalData
from edge_agent.emulation import Emulator
from edge_agent.outbox import Outbox
from edge_agent.own_data import prepare_device, task_of
from edge_agent.profiler import measure_compute, measure_link
from edge_agent.run_model import device_model
from edge_agent.status import RoundSummary, StatusFile, default_status_file
from sfl_core import liveness
from sfl_core.config.run import ConfigError, DeviceProfile
from sfl_core.data.builtin import load_dataset
from sfl_core.data.partition import load_shard_file, shard_for_agent
from sfl_core.model.accounting import model_costs
from sfl_core.model.fingerprint import digest
from sfl_core.model.zoo import build_model
from sfl_core.privacy import AgentPrivacy
from sfl_core.transport.broker_url import BrokerAddress
from sfl_core.transport.claim import Claim
from sfl_core.transport.mqtt_link import MqttLink
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol, shared_weights, signing
from sfl_core.wire.protocol import Message

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
    privacy: AgentPrivacy = AgentPrivacy()
    """What this agent keeps back (labels) and the defenses on what it sends: the device owner's
    choice; the coordinator records what the agent declares and needs to know nothing else."""
    heartbeat_s: float = 2.0
    retry_s: float = 5.0
    """Registration is re-sent after this long without an answer."""
    wait_s: float = 600.0
    """Without the coordinator's acceptance for this long, say so (and keep trying: an agent
    waits for its coordinator for as long as it runs)."""
    probe_timeout_s: float = 30.0
    """How long one link probe waits for its answer before it is sent again (after a backoff
    of :data:`RETRY_BACKOFF_S`)."""
    discover_after_s: float = 10.0
    """Without our run's description for this long, log which runs the broker does announce
    (a wrong ``--run`` otherwise waits in silence); again every minute."""
    claim_s: float = 3.0
    """Another process's online status for our agent id, seen before our own: how long to wait
    for it to show that it is alive before taking the id over (it may be a dead predecessor)."""
    coordinator_key: Optional[bytes] = None
    """The only coordinator key to follow (``--coordinator-key``); None: the trust file's, or first use."""
    trust_file: Optional[str] = None
    """Where the run's key is pinned across restarts (``--trust-file``); None: in memory."""
    trust_first_use: bool = False
    """Without a key given or pinned: believe the first signed run description (``--trust-first-use``)."""
    progress: Optional[Callable[[int, int, int], None]] = None
    """Called with (round, steps done, steps) as training goes (a terminal's live line)."""
    status_file: Optional[str] = None
    """Where this agent keeps its status for ``sfl-agent status`` (None: :func:`default_status_file`)."""
    model_files: tuple[str, ...] = ()
    """Python files of users' models installed on this device (``--model-file``): the only model
    code this agent imports, and only the file a run names."""


class DuplicateAgentError(RuntimeError):
    """Another running process uses this agent id on this broker (exit status 2: a service
    manager must not restart into the same conflict)."""


class AgentError(RuntimeError):
    """A fatal, explained problem (rejected registration, unusable data)."""


class ContractError(AgentError):
    """This device cannot take part in the run as configured (its model or the run's task
    contract): exit status 2, since a restart would meet the same problem."""


RETRY_BACKOFF_S = (5.0, 10.0, 20.0, 40.0, 60.0)
"""Seconds before the next try at a broker that cannot be reached, or after an unanswered link
probe; then every 60 s for as long as the agent runs: a device that boots before its broker,
or a coordinator that restarts (and dies again, and restarts), finds its agents still there."""

_CONFIGURATION_REFUSALS = ("not authori", "bad user name", "certificate", "ssl", "tls")


def refused_by_configuration(reason: str) -> bool:
    """Whether a broker connection failed on something only a person can fix (credentials, a
    certificate), not on the broker being unreachable for now."""
    reason = reason.lower()
    return any(word in reason for word in _CONFIGURATION_REFUSALS)


FEATURES = (shared_weights.FEATURE, signing.ADDRESSED)
"""What this agent understands beyond the core, in its registration (``register.features``): the
round's client portion by reference (:mod:`sfl_core.wire.shared_weights`) and signed messages
that name it (:func:`sfl_core.wire.signing.misaddressed`)."""
REGISTER_AGAIN_PREFIX = "not registered"
"""A ``reject`` whose reason starts so asks a registered agent to register again."""


class RunWithdrawn(Exception):
    """The coordinator cleared the run's retained description while this agent was still joining
    it: a finished run does so when it closes (:meth:`coordinator.mqtt_transport.MqttTransport.close`),
    after it told its registered agents to stop, so an agent that joins at that moment was told
    nothing else. The agent goes back to waiting for the description, as one started after the
    run ended does."""


class AgentStopped(BaseException):
    """SIGTERM or Ctrl-C: raised in the main thread wherever it waits, so every wait wakes (a
    BaseException, like KeyboardInterrupt, so no ``except Exception`` on the way swallows it)."""


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
        self._extra: dict = {}      # a task run's additions to the registration (fingerprint, statistics)
        self._run_info_ready = threading.Event()
        self._withdrawn = threading.Event()   # the description was cleared since we last read it (RunWithdrawn)
        self._joining = False                 # in _join: a withdrawn description starts it again
        self._reassembler = wire.Reassembler()
        self._copies = shared_weights.Copies(opts.run_id)   # the round's client portions, sent once for all agents
        self._model_topic: Optional[str] = None   # where our cut's copy comes (subscribed once an assignment named it)
        self._stop = threading.Event()
        self.core: Optional[AgentCore] = None
        self._busy = False
        self._last_work = float("-inf")   # when a coordinator message for us last arrived (liveness.due)
        self._last_sent = time.monotonic()  # when we last sent the coordinator anything (liveness.due)
        self.bytes_up = 0
        self.bytes_down = 0
        self.rejections = protocol.Rejections(log)
        self._seqs = protocol.ReplayGuard()  # the coordinator's messages on our down topic
        self.trust = signing.Trust(opts.coordinator_key, Path(opts.trust_file) if opts.trust_file else None,
                                   first_use=opts.trust_first_use)
        self._refused_seq: Optional[int] = None     # the last untrusted description we warned about
        self._stopping = False
        # This process's identity besides the agent id: two processes started with one id must
        # not silently share it (see _claim_id). The MQTT client id includes it, so they do not
        # knock each other off the broker while that is sorted out.
        self.instance = uuid.uuid4().hex[:12]
        self.status = StatusFile(Path(opts.status_file) if opts.status_file else default_status_file(opts.agent_id),
                                 opts.agent_id, opts.run_id)
        self._status_warned = False
        self._round_start: tuple[float, int, int] = (time.monotonic(), 0, 0)   # when, bytes up, bytes down
        self._status_topic = protocol.status_topic(opts.run_id, opts.agent_id)
        self._claim = Claim(self.instance, self._announce_online)
        self._runs_seen: set[str] = set()
        offline = Message("status", opts.run_id, opts.agent_id, {"online": False, "instance": self.instance}).encode()
        self.link = MqttLink(opts.broker, f"sfl-{opts.run_id}-{opts.agent_id}-{self.instance[:6]}", self._on_message,
                             subscriptions=[protocol.down_topic(opts.run_id, opts.agent_id),
                                            protocol.info_topic(opts.run_id), self._status_topic],
                             will=(self._status_topic, offline, True))
        self.link.add_reconnect_callback(self._announce_online)
        self.outbox = Outbox(self._send_up, uplink=self.emulator.uplink if self.emulator else None,
                             sent=self._mark_sent)
        self._arrivals: dict[int, float] = {}   # id(message) -> when the emulated downlink has it all

    # ================================================================ lifecycle
    def run(self) -> int:
        self._connect()
        try:
            self._note("starting")
            self._announce_online()
            self._claim_id()
            if self.o.privacy.active:
                log.info("privacy defenses on what this agent sends: %s", self.o.privacy.describe())
            self._join()
            self._note("waiting for a round")
            heartbeat = threading.Thread(target=self._heartbeat, daemon=True)
            heartbeat.start()
            self._serve()
            return 0
        finally:
            self._stop.set()
            self.outbox.close(timeout=3)
            self._note("stopped")
            # best effort and short: after a shutdown the broker may already be gone (an embedded
            # one stops with its coordinator), and a waiting agent would outlive its run. An agent
            # that lost the id to a running owner says nothing: the id's status is the owner's.
            if self._claim.held:
                self._publish_raw(self._status_topic, self._status(False).encode(), retain=True, timeout=3)
            self.link.close()
            if self.rejections.total:
                log.warning("rejected %d message(s) in this run: %s", self.rejections.total, self.rejections.counts())

    def _connect(self) -> None:
        """Connect to the broker, again after a backoff for as long as we run while it cannot be
        reached (a device that boots before the broker, or the coordinator's embedded one); a
        broker that refuses our credentials or certificate is a configuration error, raised."""
        attempt = 0
        while True:
            try:
                self.link.connect(timeout=30)
                return
            except ConnectionError as exc:
                if refused_by_configuration(str(exc).split(f"{self.link.url}: ", 1)[-1]):
                    raise
                pause = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                attempt += 1
                log.warning("%s: trying again in %.0f s", exc, pause)
                if self._stop.wait(pause):
                    raise AgentStopped() from None

    def stop(self) -> None:
        """Stop the agent (SIGTERM's handler calls it in the main thread): every wait ends at
        once, because the first call raises :class:`AgentStopped` where the main thread is."""
        self._stop.set()
        if not self._stopping and threading.current_thread() is threading.main_thread():
            self._stopping = True
            raise AgentStopped()

    # ================================================================ steps
    def _claim_id(self) -> None:
        """Make sure no other running process uses our agent id on this broker
        (:class:`~sfl_core.transport.claim.Claim` on our status topic; docs/protocol.md §7.7)."""
        rival = self._claim.decide(self.o.claim_s)
        if rival is not None:
            raise DuplicateAgentError(
                f"agent id {self.o.agent_id!r} is already in use by another running agent on "
                f"{self.link.address.url()} (run {self.o.run_id!r}); give every agent its own --agent-id")
        if not self._claim.own_seen:
            log.info("our own status did not come back (the broker's ACL may not let agents read it): "
                     "duplicate agent ids cannot be detected")
        elif self._claim.rival is not None:
            log.info("agent id %s was last announced by another process that no longer answers: taking it over",
                     self.o.agent_id)

    def _join(self) -> None:
        """Read the run's description, load our data for it, measure our link against its
        coordinator and register; from the start again if the description is withdrawn on the way."""
        self._joining = True
        try:
            while True:
                info = self._wait_run_info()
                try:
                    self.core = self._build_core(info)
                    self._measured = self._measure(info)
                    self._register(info, self._measured)
                    return
                except RunWithdrawn:
                    log.info("run %s ended before this agent joined it (its coordinator withdrew the run's "
                             "description): waiting for the run to be announced again", self.o.run_id)
                    self._announce_online()   # a coordinator still running (the clearing was not its) answers with it
        finally:
            self._joining = False

    def _left_behind(self) -> bool:
        """Whether the run's description was withdrawn while we join it (:class:`RunWithdrawn`)."""
        return self._joining and self._withdrawn.is_set()

    def _check_withdrawn(self) -> None:
        """Raise :class:`RunWithdrawn` where :meth:`_left_behind` (the joining steps' waits call this)."""
        if self._left_behind():
            raise RunWithdrawn()

    def _wait_run_info(self) -> Message:
        log.info("waiting for the coordinator's description of run %s", self.o.run_id)
        self._note("waiting for the run description")
        next_look = time.monotonic() + self.o.discover_after_s
        while not self._run_info_ready.wait(max(0.0, next_look - time.monotonic())):
            runs = self._announced_runs()
            others = ", ".join(sorted(runs)) if runs else "none"
            log.warning("still waiting: no coordinator announces run %r on %s; runs announced there: %s%s",
                        self.o.run_id, self.link.address.url(), others,
                        " (check --run)" if runs else " (is sfl-coord serve running against this broker?)")
            next_look = time.monotonic() + 60
        assert self._run_info is not None
        return self._run_info

    def _announced_runs(self, listen_s: float = 1.5) -> set[str]:
        """The runs whose (retained) descriptions this broker holds: subscribe to all of them for a
        moment. Their messages are only counted by run id here, never decoded or used."""
        self._runs_seen = set()
        wildcard = protocol.info_topic("+")
        self.link.subscribe(wildcard)
        time.sleep(listen_s)
        self.link.unsubscribe(wildcard)
        return set(self._runs_seen)

    def _build_core(self, info: Message) -> AgentCore:
        b = info.body
        try:
            lines = device_model(b, self.o.model_files)
        except ValueError as exc:
            raise ContractError(str(exc)) from None
        if "task" in b:
            return self._build_own_data_core(b, lines)
        self._extra = {"architecture": digest(lines)} if "architecture" in b else {}
        shape = tuple(b["input_shape"])
        # the run may train on resized images (data.image_size): resize ours the same way
        size = shape[1] if len(shape) == 3 and shape[1] == shape[2] else None
        data = load_dataset(b["dataset"], self.o.data_root, size)
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
                         privacy=self.o.privacy)

    def _build_own_data_core(self, b: dict, lines: list[str]) -> AgentCore:
        """A run on the devices' own data: all of this device's data under the run's task contract."""
        try:
            task, bad_files = task_of(b)
        except ConfigError as exc:
            raise ContractError(f"the run's task contract: {exc}") from None
        if list(task.input_shape) != list(b["input_shape"]) or task.num_classes != b["num_classes"]:
            raise ContractError("the run description's task does not match its input_shape/num_classes")
        device = prepare_device(self.o.data_root, task, bad_files, lines)
        if self.o.shard_file or self.o.index:
            log.warning("--index/--shard-file are not used: a device training on its own data uses all of it")
        self._extra = device.extra
        local, held_out = device.local(task.num_classes)
        hook = self.emulator.compute if self.emulator else None
        return AgentCore(self.o.agent_id, self.o.run_id, local, tuple(task.input_shape),
                         seed=self.o.seed * 1000 + self.o.index, compute_hook=hook, privacy=self.o.privacy,
                         standardise=True, held_out=held_out)

    def _measure(self, info: Message) -> dict:
        b = info.body
        torch.manual_seed(0)
        model = build_model(b["model"], tuple(b["input_shape"]), b["num_classes"])
        costs = model_costs(b["model"], tuple(b["input_shape"]), b["num_classes"])
        splits = [s for s in b["splits"] if s in costs]
        compute = measure_compute(model, splits, {s: costs[s].client_flops for s in splits},
                                  prior_flops=self.o.profile.compute_flops,
                                  compute_hook=self.emulator.compute if self.emulator else None)
        link = measure_link(self._probe)
        log.info("measured: link up %.2f MB/s down %.2f MB/s rtt %.1f ms", link["up_bytes_per_s"] / 1e6,
                 link["down_bytes_per_s"] / 1e6, link["rtt_s"] * 1e3)
        return {"compute_s_per_sample": {str(s): v for s, v in compute.items()}, **link}

    def _probe(self, up_bytes: int, down_bytes: int) -> float:
        """One timed link probe; unanswered, sent again after a backoff for as long as we run."""
        attempt = 0
        while True:
            announced = self._run_info.seq if self._run_info is not None else None
            seconds = self._probe_once(up_bytes, down_bytes)
            if seconds is not None:
                return seconds
            self._check_withdrawn()
            if self._run_info is not None and self._run_info.seq != announced:
                log.info("a coordinator announced the run anew while we waited for a probe's answer: probing it")
                continue
            pause = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
            attempt += 1
            log.warning("the coordinator did not answer a link probe within %.0f s (it may be restarting): "
                        "probing again in %.0f s", self.o.probe_timeout_s, pause)
            if self._stop.wait(pause):
                raise AgentStopped()

    def _probe_once(self, up_bytes: int, down_bytes: int) -> Optional[float]:
        nonce = random.getrandbits(48)
        msg = self._msg("probe", {"nonce": nonce, "pad": bytes(up_bytes), "reply_bytes": down_bytes})
        t0 = time.perf_counter()
        self._publish(msg)
        deadline = t0 + self.o.probe_timeout_s
        announced = self._run_info.seq if self._run_info is not None else None
        while time.perf_counter() < deadline:
            try:
                ack = self._probe_acks.get(timeout=min(0.5, max(0.0, deadline - time.perf_counter())))
            except queue.Empty:
                if self._left_behind() or (self._run_info is not None and self._run_info.seq != announced):
                    return None   # the run ended, or a new coordinator process never saw this probe
                continue
            if ack.body["nonce"] == nonce:
                if self.emulator:
                    self.emulator.downlink(ack.wire_bytes)
                return time.perf_counter() - t0
        return None

    def _register(self, info: Message, measured: dict, again: bool = False) -> None:
        assert self.core is not None
        self._joined = info  # the coordinator's announcement this registration answers
        body = protocol.register_body(index=self.o.index, profile=self.o.profile, measured=measured,
                                      label_counts=self.core.data.label_counts(), num_samples=len(self.core.data),
                                      emulate=self.o.emulate, resume={"rounds_done": self.core.rounds_done},
                                      privacy=self.o.privacy.describe(), instance=self.instance,
                                      extra={**self._extra, "features": list(FEATURES)})
        warn_at = time.monotonic() + self.o.wait_s
        register = self._msg("register", body)  # re-sent as is: the same seq marks it as a duplicate
        held: list[Message] = []   # training messages that arrive meanwhile (a resent gradient): kept
        while True:
            if time.monotonic() >= warn_at:
                log.warning("the coordinator has not answered our registration for %.0f s: still trying",
                            self.o.wait_s)
                warn_at = time.monotonic() + self.o.wait_s
            self._publish(register)
            try:
                reply = self._inbox.get(timeout=self.o.retry_s)
            except queue.Empty:
                self._check_withdrawn()
                continue
            if reply.type == "accepted":
                log.info("registered: %s", reply.body["message"])
                for m in held:
                    self._inbox.put(m)
                return
            if reply.type in ("gradients", "logits"):
                held.append(reply)
                continue
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

    def _rejoin(self, info: Message) -> None:
        """A new run description while serving: the coordinator restarted (``serve --resume`` after
        a crash) and knows us only from its checkpoint, so register again; the round that was in
        flight restarts with its new assignment. Shard and measurements stay unless the run changed."""
        log.info("the coordinator announced run %s again (restarted): registering again", self.o.run_id)
        if self._joined is None or _task(info.body) != _task(self._joined.body):
            self.core = self._build_core(info)
            self._measured = self._measure(info)
        else:   # the new coordinator process answers only agents that measured the link against it
            self._measured = {**self._measured, **measure_link(self._probe)}
        self._register(info, self._measured, again=True)

    def _serve(self) -> None:
        assert self.core is not None
        while not self._stop.is_set():
            info = self._run_info
            if info is not None and self._joined is not None and info.seq != self._joined.seq:
                if _only_constants_added(self._joined.body, info.body):
                    self._joined = info   # the fleet's constants, published: they come with every assignment too
                else:
                    self._rejoin(info)
            try:
                msg = self._inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            arrived = self._arrivals.pop(id(msg), 0.0)
            if msg.type == "shutdown":
                log.info("coordinator says stop: %s", msg.body["reason"])
                return
            if msg.type in ("accepted", "reject"):
                if msg.type == "reject" and msg.body["reason"].startswith(REGISTER_AGAIN_PREFIX):
                    log.warning("the coordinator forgot us while we were silent: registering again")
                    self._measured = {**self._measured, **measure_link(self._probe)}
                    self._register(self._joined or self._run_info, self._measured, again=True)  # type: ignore[arg-type]
                elif msg.type == "reject":
                    log.warning("coordinator rejected us: %s", msg.body["reason"])
                continue
            self._busy = True
            try:
                if msg.type == "assign" and msg.round != self.core.round:
                    self._round_start = (time.monotonic(), self.bytes_up, self.bytes_down - msg.wire_bytes)
                    self._note("training", round=msg.round)
                if self.emulator:
                    if msg.type == "assign":
                        self.emulator.at_round(msg.round)
                    self.emulator.wait_until(arrived)
                replies = self.core.handle(msg)
                for reply in replies:
                    self._publish(reply)
                    if reply.type == "weights":
                        self._round_done(reply)
                self._show_progress(replies)
            except (wire.WireError, ValueError) as exc:
                self.rejections.reject("invalid", f"{msg.type} (round {msg.round} step {msg.step}): {exc}")
            finally:
                self._busy = False

    def _round_done(self, weights: Message) -> None:
        """One INFO line for the round just finished, and the status file."""
        assert self.core is not None
        a = self.core.assignment
        if a is None:
            return
        t0, up0, down0 = self._round_start
        summary = RoundSummary(round=weights.round, split=a.split, batch=a.batch_size, steps=a.tau,
                               loss=RoundSummary.loss_of(weights.body.get("loss")),
                               bytes_up=self.bytes_up - up0, bytes_down=self.bytes_down - down0,
                               seconds=round(time.monotonic() - t0, 3), window=self.core.window)
        log.info("%s", summary.line())
        self._note("waiting for a round", round=weights.round, rounds_done=self.core.rounds_done,
                   last_round=asdict(summary))

    def _show_progress(self, replies: list[Message]) -> None:
        """The terminal's live line: steps whose activations went out (all of them once the weights did)."""
        a = self.core.assignment if self.core is not None else None
        if self.o.progress is None or a is None or self.core is None or not replies:
            return
        done = a.tau if any(r.type == "weights" for r in replies) else max(0, self.core.step)
        self.o.progress(self.core.round, done, a.tau)

    def _note(self, state: str, **fields) -> None:
        problem = self.status.set(state, **fields)
        if problem and not self._status_warned:
            self._status_warned = True
            log.info("cannot keep the status file for `sfl-agent status`: %s", problem)

    # ================================================================ network
    def _on_message(self, topic: str, payload: bytes) -> None:
        if not payload:
            if topic == protocol.info_topic(self.o.run_id) and self._run_info is not None:
                self._withdraw()
            return
        parts = topic.split("/")
        if len(parts) == 3 and parts[2] == "info" and parts[1] != self.o.run_id:
            self._runs_seen.add(parts[1])  # another run's description (_announced_runs): its name only
            return
        if topic == self._model_topic:
            self._on_copy(topic, payload)
            return
        if topic not in (protocol.down_topic(self.o.run_id, self.o.agent_id), protocol.info_topic(self.o.run_id),
                         self._status_topic):
            return   # not one of ours (a broker whose wildcard matching is loose delivers others' topics)
        if topic == self._status_topic:
            self._on_status(payload)
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
        guarded = msg.type not in ("run_info", "probe_ack")   # probe acks come from another coordinator thread
        if guarded and self._seqs.is_replay(msg):
            self.rejections.reject("replayed", f"{msg.type} on {topic}: seq {msg.seq} is older than "
                                               f"{self._seqs.last(msg.sender)}")
            return
        if msg.type == "run_info" and self._run_info is not None and msg.seq == self._run_info.seq \
                and not self._withdrawn.is_set():
            return  # the coordinator repeating its description for an agent that just came online
        if not self._trusted(msg, topic):
            return
        if guarded and msg.type in signing.SIGNED_TYPES:
            # Only a message our coordinator signed raises the replay bar: one that anybody could
            # write (gradients, accepted, ...) with a huge seq would otherwise make us refuse every
            # later assignment. Unsigned ones are idempotent by round and step (AgentCore).
            self._seqs.advance(msg)
        if msg.type == "assign":
            try:
                ready = self._copies.resolve(msg)
            except wire.WireError as exc:
                self.rejections.reject("invalid", f"assign on {topic}: {exc}")
                return
            if "shared_weights" in msg.body:   # later copies of our cut's portion come there
                self._follow_copies(msg.body["shared_weights"]["topic"])
            if ready is None:   # its copy has not come yet: the assignment waits for it
                return
            msg = ready
        self._accept(msg)

    def _accept(self, msg: Message) -> None:
        """A valid coordinator message for us, ready to use."""
        self.bytes_down += msg.wire_bytes
        if msg.type == "run_info":
            self._run_info = msg
            self._withdrawn.clear()
            self._run_info_ready.set()
        elif msg.type == "probe_ack":
            self._probe_acks.put(msg)
        else:
            if msg.type in liveness.WORK_TYPES:
                self._last_work = time.monotonic()
            if self.emulator:
                self._arrivals[id(msg)] = self.emulator.arrival(msg.wire_bytes)
            self._inbox.put(msg)

    def _withdraw(self) -> None:
        """An empty retained message on the run's description topic: the coordinator cleared the
        description (a finished run, as it closes). Nothing is taken from it but that: an agent
        still joining waits for the description again (:class:`RunWithdrawn`); a registered one
        carries on, and its coordinator's shutdown ends it."""
        self._run_info_ready.clear()
        self._withdrawn.set()

    def _follow_copies(self, topic: str) -> None:
        """Receive our cut's copies on ``topic`` from now on (the retained one arrives first), and
        no longer those of a cut we trained before."""
        if topic == self._model_topic:
            return
        if self._model_topic is not None:
            self.link.unsubscribe(self._model_topic)
        self._model_topic = topic
        self.link.subscribe(topic)

    def _on_copy(self, topic: str, payload: bytes) -> None:
        """A round's client portion (:mod:`sfl_core.wire.shared_weights`); the assignment that
        waited for it goes on, checked by its digest (the assignment is signed, the copy need not be)."""
        try:
            whole = self._reassembler.feed(topic, payload)
            if whole is None:
                return
            ready = self._copies.received(whole)
        except wire.WireError as exc:
            self.rejections.reject(exc.reason, f"message on {topic}: {exc}")
            return
        if ready is not None:
            self._accept(ready)

    def _trusted(self, msg: Message, topic: str) -> bool:
        """Follow only what our coordinator signed (:mod:`sfl_core.wire.signing`): a run description
        by a trusted key (pinned on first use, or given), an assignment or a shutdown by that key."""
        if msg.type == "run_info":
            key = msg.body["coordinator"].get("key")
            if not isinstance(key, bytes) or len(key) != 32 or not signing.verify(msg, key):
                self.rejections.reject("unsigned", f"run description on {topic}: not validly signed by the key it "
                                                   f"names; ignored")
                return False
            why = self.trust.decide(self.o.run_id, key)
            changes = _changes(self._run_info.body, msg.body) if self._run_info is not None else ""
            if why is not None:
                if msg.seq != self._refused_seq:
                    self._refused_seq = msg.seq
                    self.rejections.reject("untrusted", f"a run description for run {self.o.run_id} {why}"
                                           + (f" (it would change {changes})" if changes else "") + "; refused")
                return False
            if changes:
                level = logging.INFO if self._run_info is not None and _only_constants_added(self._run_info.body, msg.body) \
                    else logging.WARNING
                log.log(level, "the run description of run %s changed, signed by our coordinator: %s",
                        self.o.run_id, changes)
            return True
        if msg.type in signing.SIGNED_TYPES:
            key = self.trust.pinned(self.o.run_id)
            if key is None or not signing.verify(msg, key):
                self.rejections.reject("unsigned", f"{msg.type} on {topic}: not signed by our coordinator; ignored")
                return False
            why = signing.misaddressed(msg, self.o.agent_id)
            if why is not None:
                self.rejections.reject("misaddressed", f"{msg.type} on {topic}: {why}; ignored")
                return False
        return True

    def _publish(self, msg: Message) -> None:
        """Hand ``msg`` to the uplink (:class:`~edge_agent.outbox.Outbox`): sent in order while we compute on."""
        payload = msg.encode()
        self.bytes_up += len(payload)
        assignment = self.core.assignment if self.core is not None else None
        self.outbox.put(protocol.up_topic_for(self.o.run_id, self.o.agent_id, msg.type,
                                              assignment.server_worker if assignment is not None else 0), payload)

    def _send_up(self, topic: str, payload: bytes) -> None:
        for piece in wire.split_chunks(payload, uuid.uuid4().hex[:12]):
            self._publish_raw(topic, piece)

    def _mark_sent(self) -> None:
        self._last_sent = time.monotonic()

    def _publish_raw(self, topic: str, payload: bytes, retain: bool = False, timeout: float = 60) -> None:
        if not self.link.publish(topic, payload, retain=retain, timeout=timeout):
            log.warning("publish to %s not acknowledged within %.0f s", topic, timeout)

    def _on_status(self, payload: bytes) -> None:
        """Our own status topic: our own announcements, and any other process's with our id."""
        try:
            msg = protocol.decode(payload, run=self.o.run_id, allowed=frozenset({"status"}))
        except wire.WireError as exc:
            self.rejections.reject(exc.reason, f"message on {self._status_topic}: {exc}")
            return
        answered = self._claim.observe(msg.body)
        if answered is not None and msg.body["online"]:
            log.warning("another process (instance %s) started with our agent id %s; telling it that this "
                        "one runs", answered, self.o.agent_id)

    def _status(self, online: bool) -> Message:
        return self._msg("status", {"online": online, "instance": self.instance})

    def _announce_online(self) -> None:
        self.link.publish(self._status_topic, self._status(True).encode(), retain=True, timeout=10)

    def _heartbeat(self) -> None:
        """Every ``heartbeat_s`` while in a round, else at the run's idle interval, unless another message
        went to the coordinator since (:mod:`sfl_core.liveness`)."""
        while not self._stop.wait(self.o.heartbeat_s):
            info = self._run_info
            idle_s = liveness.agreed_idle_s(info.body.get("heartbeat_idle_s") if info is not None else None,
                                            self.o.heartbeat_s)
            now = time.monotonic()
            busy = self._busy or self.outbox.pending > 0   # an upload still going is work too
            if not liveness.due(now, self._last_sent, self._last_work, busy, self.o.heartbeat_s, idle_s):
                continue
            self._last_sent = now
            state = "busy" if busy else "idle"
            self.link.publish(protocol.up_topic(self.o.run_id, self.o.agent_id),
                              self._msg("heartbeat", {"state": state}).encode(), timeout=5)

    def _msg(self, mtype: str, body: dict) -> Message:
        rnd = self.core.round if self.core and self.core.round >= 0 else 0
        return Message(mtype, self.o.run_id, self.o.agent_id, body, round=rnd, seq=protocol.next_seq())


_NOT_TASK = ("sig", "coordinator")


def _task(body: dict) -> dict:
    """What a run description asks an agent to do (without who signed it)."""
    return {k: v for k, v in body.items() if k not in _NOT_TASK}


def _only_constants_added(old: dict, new: dict) -> bool:
    """The same coordinator process published the same run with its standardisation constants
    now known (``normalize: federated``): nothing to reload or measure again."""
    def rest(body: dict) -> dict:
        return {k: v for k, v in _task(body).items() if k != "normalize"}
    return ("normalize" in new and "normalize" not in old and rest(old) == rest(new)
            and old.get("coordinator", {}).get("instance") == new.get("coordinator", {}).get("instance"))


def _changes(old: dict, new: dict) -> str:
    """What differs between two run descriptions, for one log line ('' if only the signature)."""
    diffs = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(_task(old)) | set(_task(new)))
             if old.get(k) != new.get(k)]
    if old.get("coordinator", {}).get("instance") != new.get("coordinator", {}).get("instance"):
        diffs.append("coordinator process restarted")
    return "; ".join(diffs)
