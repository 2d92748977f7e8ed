"""The programmatic API of a deployment: serve a run from Python, and set a run up (data, lock, checkpoint).

    from sfl_core.config.run import load_run_config
    from coordinator.api import serve
    from simulation import run_simulation

    history, engine = run_simulation(load_run_config("profiles/runs/demo.yaml"))

Both build the same :class:`~coordinator.engine.RoundEngine`; only the transport (in-process
or MQTT) and the clock (virtual or wall) differ. The helpers below that set a run up (its
data, its lock, its checkpoint) serve :mod:`simulation` too. They raise exceptions — :class:`RunError`
for a run that cannot start (its message names the file, option or field), the engine's
own for a run that stops (``TimeoutError`` without a fleet, ``ConnectionError`` without a
broker, :class:`~coordinator.state.CheckpointWriteError` on a full disk) — and never exit the
process: the ``sfl-coord`` CLI maps them to one line and an exit status.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from rich.console import Console

from coordinator import state as ckpt
from coordinator.clock import WallClock
from coordinator.console import RunDisplay
from coordinator.engine import RoundEngine
from coordinator.run_lock import RunLock, RunLocked
from coordinator.run_parts import RunParts
from coordinator.server_trainer import pick_device
from coordinator.transport import LocalTransport
from sfl_core import liveness, option_registry
from sfl_core.config.run import RunConfig
from sfl_core.data.builtin import Dataset, DatasetError, load_dataset
from sfl_core.methods import build_method
from sfl_core.methods.base import Method
from sfl_core.model.accounting import model_costs
from sfl_core.model.fingerprint import architecture, fingerprinted
from sfl_core.model.user_models import user_model_fields
from sfl_core.model.zoo import build_model
from sfl_core.transport.broker_url import BrokerAddress

log = logging.getLogger("sfl.coord")

__all__ = ["RunError", "serve", "run_info_body", "run_dataset", "lock_run", "read_checkpoint",
           "set_aside_earlier_run", "task_eval_set"]


class RunError(ValueError):
    """A run that cannot start: a missing data set, a checkpoint that cannot be resumed, an
    address the embedded broker must not listen on. The message says what to fix."""


def run_dataset(cfg: RunConfig) -> Dataset:
    try:
        if cfg.task is not None:
            return task_eval_set(cfg)
        return load_dataset(cfg.data.dataset, cfg.data.root, cfg.data.image_size)
    except DatasetError as exc:
        raise RunError(str(exc)) from None


def task_eval_set(cfg: RunConfig) -> Dataset:
    """A run on the devices' own data: the server holds no training data, only its validation
    set (``eval.data``: its held-out split if it has one, else all of it), scaled and resized
    like the devices' inputs. Standardisation is the engine's, once the fleet agrees on it."""
    from sfl_core.data.local import load_local

    task = cfg.task
    assert task is not None
    empty = torch.empty((0, *task.input_shape))
    x, y = empty, torch.empty(0, dtype=torch.int64)
    if cfg.eval.data is not None:
        held = load_local(cfg.eval.data, task, cfg.data.bad_files)
        part = held.val if held.val is not None else held.train
        x, y = part.x, part.y
        if held.skipped:
            log.warning("eval.data %s: skipped %d unreadable file(s), e.g. %s", cfg.eval.data, len(held.skipped),
                        held.skipped[0][0])
    return Dataset("local", empty, torch.empty(0, dtype=torch.int64), x, y, task.num_classes, preprocessing={})


Resume = Union[bool, str]
"""``False`` (a fresh run), ``True`` (continue from the checkpoint, which must exist) or
``"auto"`` (continue if the run's checkpoint exists, start fresh otherwise; a damaged
checkpoint is refused): what a service manager's restart needs."""


def read_checkpoint(out: Path, resume: Resume) -> Optional[tuple[dict, dict]]:
    """The checkpoint to continue from, read before anything starts or changes (None: a fresh run)."""
    if resume == "auto":
        resume = (out / ckpt.MODEL_FILE).exists()
    elif resume not in (True, False):
        raise RunError(f"--resume {resume!r}: expected no value (resume), or auto")
    if not resume:
        return None
    try:
        return ckpt.load(out)
    except ckpt.CheckpointError as exc:
        raise RunError(f"cannot resume: {exc}") from None


def set_aside_earlier_run(out: Path, console: Console) -> None:
    """A fresh run moves an earlier (finished or abandoned) run's files aside, never mixing two
    runs' metrics; the run directory's lock guarantees no live coordinator owns them."""
    if (out / ckpt.METRICS_FILE).exists():
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name in (ckpt.METRICS_FILE, ckpt.STATE_FILE, ckpt.MODEL_FILE):
            if (out / name).exists():
                (out / name).rename(out / f"{name}.{stamp}")
        console.print(f"{out} held an earlier run; its files were renamed with suffix .{stamp}",
                      style="yellow", markup=False, highlight=False, soft_wrap=True)
    out.mkdir(parents=True, exist_ok=True)


def lock_run(out: Path, run_id: str) -> RunLock:
    try:
        return RunLock(out).acquire(run_id)
    except RunLocked as exc:
        raise RunError(str(exc)) from None


class _Events:
    """The engine's one event sink, fanned out to the display and any observers (metrics
    exporter, live page); an observer that fails is logged, never stops the run."""

    def __init__(self, sinks: list[Callable[[str, dict], None]]):
        self.sinks = sinks

    def __call__(self, event: str, data: dict) -> None:
        for sink in self.sinks:
            try:
                sink(event, data)
            except Exception as exc:  # noqa: BLE001 - an observer must never stop a round
                log.warning("event observer %s failed on %s: %s", type(sink).__name__, event, exc)


def _loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise RunError(f"--listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:1883")
    return host.strip("[]") or "127.0.0.1", int(port)


def run_info_body(cfg: RunConfig, data, normalize: Optional[dict] = None, method: Optional[Method] = None,
                  model_architecture: Optional[list[str]] = None) -> dict:
    """What agents read first. A run on the devices' own data adds its task contract, the
    standardisation constants when already known (given, or restored by ``--resume``), and
    its model's fingerprint. A running engine hands its ``method`` and ``model_architecture``
    (built once, when it started); without them they are built here."""
    if method is None:   # the engine's, where it is built already
        model = build_model(cfg.model, data.input_shape, data.num_classes)
        method = build_method(cfg, model, model_costs(cfg.model, data.input_shape, data.num_classes))
    splits = method.splits_to_time()   # the split points the agents should time: the ones they can be assigned
    body = {"model": cfg.model, "dataset": cfg.data.dataset if cfg.task is None else "local",
            "input_shape": list(data.input_shape), "num_classes": data.num_classes, "splits": splits,
            "partition": {"scheme": cfg.data.partition, "alpha": cfg.data.alpha, "seed": cfg.data.seed},
            "num_agents": cfg.num_agents}
    if liveness.idle_heartbeat_s(cfg.num_agents) > liveness.BUSY_HEARTBEAT_S:
        # a fleet past 100 agents: idle agents beat less often (agents of earlier releases, which
        # do not know the field, refuse the description; smaller fleets keep it as it was)
        body["heartbeat_idle_s"] = liveness.idle_heartbeat_s(cfg.num_agents)
    body.update(user_model_fields(cfg.model))
    for option in option_registry.wanted(cfg):   # an agent that cannot honour an option does not join
        body.update(option.run_info(cfg))
    if fingerprinted(cfg):
        body["architecture"] = model_architecture or architecture(build_model(cfg.model, data.input_shape,
                                                                              data.num_classes))
    if cfg.task is not None:
        body["task"] = {**cfg.task.to_wire(), "bad_files": cfg.data.bad_files}
        if normalize is not None:
            body["normalize"] = normalize
    return body



def serve(cfg: RunConfig, broker: "Optional[str | BrokerAddress]" = None, *, resume: Resume = False,
          device: str = "auto", quiet: bool = False, on_broker: Optional[Callable[["str | BrokerAddress", str], None]] = None,
          listen: str = "127.0.0.1:0", insecure_listen: bool = False,
          console: Optional[Console] = None, signing_key: Optional[Path] = None,
          observers: Optional[list[Any]] = None, parts: Optional[RunParts] = None) -> tuple[list[dict], RoundEngine]:
    """Start (or connect to) a broker, announce the run, drive the rounds. Used by ``serve`` and ``demo``.

    Order matters to an operator: the run directory's lock first (a second coordinator of the
    same directory stops there, having changed nothing), then every check that can refuse a
    resume (checkpoint, model fit, metrics), then the broker claim (a second coordinator of
    the run elsewhere stops there), and only then is the run announced. The embedded broker
    has neither TLS nor passwords: it listens on loopback unless ``insecure_listen``. The
    retained run description is cleared only when the run finished; after a crash agents
    keep it and wait for the restarted coordinator. ``observers``: event sinks with an
    optional ``attach(engine)`` (metrics exporter, live page). ``on_broker(url, key)``: called
    just before the run is announced, with the broker's URL and the coordinator's public key
    (what the demo starts its agents with). ``parts``: the model and method the caller built
    while checking the config (:func:`coordinator.run_parts.build_parts`).
    """
    from coordinator.broker import EmbeddedBroker
    from coordinator.mqtt_transport import DuplicateCoordinatorError, MqttTransport
    from coordinator.server_workers import cannot_share, from_env
    from sfl_core.wire.signing import KEY_FILE, Signer, TrustError, public_text

    console = console or Console(stderr=True)
    data = run_dataset(cfg)
    shards = from_env(pick_device(device), timeout_s=max(1800.0, 3 * cfg.register_timeout_s))
    problem = cannot_share(cfg.server_mode, broker is not None) if shards is not None else None
    if problem:
        raise RunError(problem)
    if shards is not None and not shards.leader:
        assert broker is not None   # cannot_share: server workers need a broker all of them reach
        return _serve_shard(cfg, broker, data, shards)
    out = cfg.resolved_output_dir
    lock = lock_run(out, cfg.run_id)
    embedded = transport = None
    finished = False
    try:
        checkpoint = read_checkpoint(out, resume)
        try:
            signer = Signer.load_or_create(signing_key or out / KEY_FILE)
        except (TrustError, OSError) as exc:
            raise RunError(f"signing key: {exc}") from None
        if broker is None:
            host, port = _parse_listen(listen)
            if not _loopback(host):
                if not insecure_listen:
                    raise RunError(f"--listen {listen}: the embedded broker has no TLS and no passwords, so it "
                                   f"listens only on loopback (127.0.0.1). Anyone who can reach {host} could read "
                                   f"activations, labels and weights. For a fleet on other hosts run Mosquitto with "
                                   f"TLS and credentials (sfl-coord broker-config) and pass --broker; to listen "
                                   f"anyway, add --insecure-listen.")
                console.print(f"WARNING: the embedded broker listens on {host} without TLS or authentication "
                              f"(--insecure-listen): anyone on that network can read and inject this run's "
                              f"messages", style="bold yellow", markup=False)
        transport_args: dict[str, Any] = dict(signer=signer, where={"pid": os.getpid(), "host": socket.gethostname(),
                                                    "out_dir": str(out.resolve())})
        display = RunDisplay(cfg.rounds, console=console, quiet=quiet)
        events = _Events([display, *(observers or [])])
        # every check that can refuse a resume runs here, in the engine's constructor, before
        # anything reaches the broker (its transport is built but not connected)
        engine = RoundEngine(cfg, _Unconnected(), WallClock(), (data.x_test, data.y_test),
                             input_shape=data.input_shape, num_classes=data.num_classes, out_dir=out,
                             device=shards.device if shards else pick_device(device), on_event=events,
                             checkpoint=checkpoint, preprocessing=data.preprocessing, shards=shards,
                             parts=parts)
        if broker is None:
            embedded = EmbeddedBroker(host=host, port=port).start()
            broker = embedded.url
            console.print(f"embedded MQTT broker listening at {broker}", markup=False, highlight=False,
                          soft_wrap=True)
        else:
            console.print(f"MQTT broker: {broker}", markup=False, highlight=False,   # prints without the password
                          soft_wrap=True)
        transport = MqttTransport(broker, cfg.run_id, **transport_args)
        transport.start()
        try:
            transport.claim()
        except DuplicateCoordinatorError as exc:
            raise RunError(str(exc)) from None
        engine.use_transport(transport)
        if checkpoint is None:
            set_aside_earlier_run(out, console)
        public = public_text(signer.public)
        console.print(f"coordinator key (agents follow it with --coordinator-key {public}"
                      + (f" or --coordinator-key {(out / KEY_FILE).with_suffix('.pub')}" if signing_key is None else "")
                      + ")", markup=False, highlight=False, style="dim", soft_wrap=True)
        for obs in observers or []:
            if hasattr(obs, "attach"):
                obs.attach(engine)
        if on_broker is not None:
            on_broker(broker, public)
        transport.publish_run_info(run_info_body(cfg, data, engine.known_normalization(), engine.method,
                                                     engine.architecture))
        with display:
            history = engine.run()
        finished = True
        rejected = engine.rejected_totals()
        if rejected:
            console.print(f"{sum(rejected.values())} message(s) were rejected: "
                          + ", ".join(f"{k} {v}" for k, v in sorted(rejected.items())) + " (see the log)",
                          style="yellow", markup=False)
        return history, engine
    finally:
        for obs in observers or []:
            if hasattr(obs, "finish"):
                obs.finish(finished)
        if transport is not None:
            transport.close(finished=finished)
        if embedded is not None:
            embedded.stop()
        lock.release()


class _Unconnected(LocalTransport):
    """The engine's transport until the broker is reached: nothing may be sent yet."""

    def send(self, agent_id: str, msg: Any) -> int:
        raise RuntimeError("not connected")

    def poll(self, timeout: float) -> None:
        raise RuntimeError("not connected")


def _serve_shard(cfg: RunConfig, broker: "str | BrokerAddress", data, shards) -> tuple[list[dict], RoundEngine]:
    """A server worker other than the leader: its own MQTT connection, its agents' rows."""
    from coordinator.mqtt_transport import MqttTransport
    from coordinator.server_workers import workers_hold_validation

    held = len(data.y_test) if workers_hold_validation(cfg) else 0   # the leader's set, or none
    transport = MqttTransport(broker, cfg.run_id, worker=shards.rank)
    try:
        transport.start()
        engine = RoundEngine(cfg, transport, WallClock(), (data.x_test[:held], data.y_test[:held]),
                             input_shape=data.input_shape, num_classes=data.num_classes, out_dir=cfg.resolved_output_dir,
                             device=shards.device, preprocessing=data.preprocessing, shards=shards)
        engine.serve_shard()
        return [], engine
    finally:
        transport.close(finished=False)   # the leader owns the run's retained description
