"""The programmatic API: run a simulation or serve a deployment from Python.

    from sfl_core.config import load_run_config
    from coordinator.api import run_simulation, serve

    history, engine = run_simulation(load_run_config("profiles/runs/demo.yaml"))

Both build the same :class:`~coordinator.engine.RoundEngine`; only the transport (in-process
or MQTT) and the clock (virtual or wall) differ. They raise exceptions — :class:`RunError`
for a run that cannot start (its message names the file, option or field), the engine's
own for a run that stops (``TimeoutError`` without a fleet, ``ConnectionError`` without a
broker, :class:`~coordinator.state.CheckpointWriteError` on a full disk) — and never exit the
process: the ``sfl-coord`` CLI maps them to one line and an exit status.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from rich.console import Console

from sfl_core.transport.broker_url import BrokerAddress
from sfl_core.config import RunConfig
from sfl_core.data import Dataset, DatasetError, load_dataset
from sfl_core.accounting import model_costs
from sfl_core.methods import build_method
from sfl_core.models import build_model

from coordinator import state as ckpt
from coordinator.clock import VirtualClock, WallClock
from coordinator.console import RunDisplay
from coordinator.engine import RoundEngine
from coordinator.server_trainer import pick_device

__all__ = ["RunError", "run_simulation", "serve", "output_dir", "run_info_body"]


class RunError(ValueError):
    """A run that cannot start: a missing data set, a checkpoint that cannot be resumed, an
    address the embedded broker must not listen on. The message says what to fix."""


def output_dir(cfg: RunConfig) -> Path:
    """Where a run's metrics and checkpoints go: ``output_dir``, else ``runs/<run>``."""
    return Path(cfg.output_dir) if cfg.output_dir else Path("runs") / cfg.run_id


def _dataset(cfg: RunConfig) -> Dataset:
    try:
        return load_dataset(cfg.data.dataset, cfg.data.root, cfg.data.image_size)
    except DatasetError as exc:
        raise RunError(str(exc)) from None


def _prepare_out_dir(out: Path, resume: bool, console: Console) -> Optional[tuple[dict, dict]]:
    """A fresh run moves an earlier run's files aside; a resumed one reads its checkpoint first,
    before anything starts or changes."""
    if resume:
        try:
            return ckpt.load(out)
        except ckpt.CheckpointError as exc:
            raise RunError(f"cannot resume: {exc}") from None
    if (out / ckpt.METRICS_FILE).exists():
        # never silently mix two runs' metrics: keep the old ones aside
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name in (ckpt.METRICS_FILE, ckpt.STATE_FILE, ckpt.MODEL_FILE):
            if (out / name).exists():
                (out / name).rename(out / f"{name}.{stamp}")
        console.print(f"[yellow]{out} held an earlier run; its files were renamed with suffix .{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    return None


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


def run_info_body(cfg: RunConfig, data) -> dict:
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    method = build_method(cfg, model, model_costs(cfg.model, data.input_shape, data.num_classes))
    splits = method.splits_to_time()   # the split points the agents should time: the ones they can be assigned
    return {"model": cfg.model, "dataset": cfg.data.dataset, "input_shape": list(data.input_shape),
            "num_classes": data.num_classes, "splits": splits,
            "partition": {"scheme": cfg.data.partition, "alpha": cfg.data.alpha, "seed": cfg.data.seed},
            "num_agents": cfg.num_agents}


def serve(cfg: RunConfig, broker: "Optional[str | BrokerAddress]" = None, *, resume: bool = False,
          device: str = "auto", quiet: bool = False, on_broker: Optional[Callable[[str], None]] = None,
          listen: str = "127.0.0.1:0", insecure_listen: bool = False,
          console: Optional[Console] = None) -> tuple[list[dict], RoundEngine]:
    """Start (or connect to) a broker, announce the run, drive the rounds. Used by ``serve`` and ``demo``.

    The embedded broker has neither TLS nor passwords: it listens on loopback unless
    ``insecure_listen`` allows another address. The retained run description is cleared only
    when the run finished; after a crash agents keep it and wait for ``--resume``.
    """
    from coordinator.broker import EmbeddedBroker
    from coordinator.mqtt_transport import MqttTransport
    from coordinator.server_workers import cannot_share, from_env

    console = console or Console(stderr=True)
    data = _dataset(cfg)
    shards = from_env(pick_device(device), timeout_s=max(1800.0, 3 * cfg.register_timeout_s))
    problem = cannot_share(cfg.server_mode, broker is not None) if shards is not None else None
    if problem:
        raise RunError(problem)
    if shards is not None and not shards.leader:
        return _serve_shard(cfg, broker, data, shards)
    out = output_dir(cfg)
    checkpoint = _prepare_out_dir(out, resume, console)
    embedded = None
    if broker is None:
        host, port = _parse_listen(listen)
        if not _loopback(host):
            if not insecure_listen:
                raise RunError(f"--listen {listen}: the embedded broker has no TLS and no passwords, so it listens "
                               f"only on loopback (127.0.0.1). Anyone who can reach {host} could read activations, "
                               f"labels and weights. For a fleet on other hosts run Mosquitto with TLS and "
                               f"credentials (sfl-coord broker-config) and pass --broker; to listen anyway, add "
                               f"--insecure-listen.")
            console.print(f"WARNING: the embedded broker listens on {host} without TLS or authentication "
                          f"(--insecure-listen): anyone on that network can read and inject this run's messages",
                          style="bold yellow", markup=False)
        embedded = EmbeddedBroker(host=host, port=port).start()
        broker = embedded.url
        console.print(f"embedded MQTT broker listening at {broker}")
    else:
        console.print(f"MQTT broker: {broker}")  # BrokerAddress prints without the password
    if on_broker is not None:
        on_broker(broker)
    transport = MqttTransport(broker, cfg.run_id)
    finished = False
    try:
        transport.start()
        transport.publish_run_info(run_info_body(cfg, data))
        with RunDisplay(cfg.rounds, console=console, quiet=quiet) as display:
            engine = RoundEngine(cfg, transport, WallClock(), (data.x_test, data.y_test),
                                 input_shape=data.input_shape, num_classes=data.num_classes, out_dir=out,
                                 device=shards.device if shards else pick_device(device), on_event=display,
                                 checkpoint=checkpoint, preprocessing=data.preprocessing, shards=shards)
            history = engine.run()
        finished = True
        rejected = engine.rejected_totals()
        if rejected:
            console.print(f"[yellow]{sum(rejected.values())} message(s) were rejected: "
                          + ", ".join(f"{k} {v}" for k, v in sorted(rejected.items())) + " (see the log)")
        return history, engine
    finally:
        transport.close(finished=finished)
        if embedded is not None:
            embedded.stop()


def _serve_shard(cfg: RunConfig, broker: "str | BrokerAddress", data, shards) -> tuple[list[dict], RoundEngine]:
    """A server worker other than the leader: its own MQTT connection, its agents' rows."""
    from coordinator.mqtt_transport import MqttTransport

    transport = MqttTransport(broker, cfg.run_id, worker=shards.rank)
    try:
        transport.start()
        engine = RoundEngine(cfg, transport, WallClock(), (data.x_test[:0], data.y_test[:0]),
                             input_shape=data.input_shape, num_classes=data.num_classes, out_dir=output_dir(cfg),
                             device=shards.device, preprocessing=data.preprocessing, shards=shards)
        engine.serve_shard()
        return [], engine
    finally:
        transport.close(finished=False)   # the leader owns the run's retained description


def run_simulation(cfg: RunConfig, *, resume: bool = False, device: str = "auto", quiet: bool = True,
                   console: Optional[Console] = None, ray: Optional[str] = None,
                   ray_workers: Optional[int] = None) -> tuple[list[dict], RoundEngine]:
    """The same engine as :func:`serve`, with in-process agents and a virtual clock: real
    training on real data, times from the device profiles and the real encoded bytes.

    ``ray``: place the agents in Ray actors instead, ``"local"`` for a Ray started here, else
    a cluster address (``ray_workers`` actors, default one per CPU); same results, in parallel."""
    from coordinator.inprocess import build_fleet

    console = console or Console(stderr=True)
    data = _dataset(cfg)
    out = output_dir(cfg)
    checkpoint = _prepare_out_dir(out, resume, console)
    dev = pick_device(device)
    if ray is not None:
        from coordinator.ray_fleet import build_ray_fleet
        try:
            transport = build_ray_fleet(cfg, data, None if ray == "local" else ray, ray_workers)
        except RuntimeError as exc:
            raise RunError(str(exc)) from exc
    else:
        transport = build_fleet(cfg, data, dev)
    try:
        with RunDisplay(cfg.rounds, console=console, quiet=quiet) as display:
            engine = RoundEngine(cfg, transport, VirtualClock(), (data.x_test, data.y_test),
                                 input_shape=data.input_shape, num_classes=data.num_classes, out_dir=out,
                                 device=dev, on_event=display, checkpoint=checkpoint,
                                 preprocessing=data.preprocessing)
            history = engine.run()
    finally:
        close = getattr(transport, "close", None)
        if close is not None:
            close()
    return history, engine
