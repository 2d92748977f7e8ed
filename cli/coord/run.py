"""``sfl-coord serve``, ``simulate`` and ``demo``: run a round engine, and turn every way it stops
into one line and an exit status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from cli.broker_options import CaFile, CertFile, KeyFile, PasswordFile, address_from_options
from cli.coord.app import DATA_OPTION, app, checked_parts, console, load_config, setup_logging, tell, web_access
from coordinator import state as ckpt
from coordinator.allocator import keep_freed_memory
from coordinator.garbage_collection import spare_startup_objects
from coordinator.api import RunError
from coordinator.api import serve as serve_run
from coordinator.broker import BrokerStartError, BrokerUnavailable
from coordinator.console import print_table, summary_table
from coordinator.engine import RoundEngine, RoundFailed
from coordinator.server_workers import cannot_share, launch_workers
from sfl_core.config.run import RunConfig, default_profiles_dir
from simulation import run_simulation

if TYPE_CHECKING:
    from coordinator.web import WebAccess

DEMO_CONFIG = "runs/demo.yaml"


RESUME_OPTION = typer.Option(None, "--resume", metavar="[auto]",
                             help="Continue the run from its last checkpoint. '--resume auto': continue if the "
                             "run's checkpoint exists, start fresh if there is none, refuse a damaged one (what a "
                             "service manager's restart needs).")


def _resume_mode(value: Optional[str]) -> "bool | str":
    if value is None:
        return False
    if value in ("yes", "auto"):
        return True if value == "yes" else "auto"
    tell(f"--resume {value}: expected no value (resume) or auto")
    raise typer.Exit(2)


def _observers(cfg: RunConfig, metrics: Optional[str], dashboard: Optional[str], access: "WebAccess") -> list:
    """The metrics exporter and the live page, bound before the run starts (a taken port, or a
    non-loopback address without a token and TLS, is a configuration error: exit 2)."""
    from coordinator.web import WebError, start_dashboard, start_metrics

    scheme = "https" if access.tls else "http"
    observers: list[Any] = []
    try:
        if metrics:
            observers.append(start_metrics(metrics, cfg, access))
            tell(f"metrics: {scheme}://{metrics}/metrics", style="dim")
        if dashboard:
            observers.append(start_dashboard(dashboard, cfg.resolved_output_dir, cfg, access))
            tell(f"live fleet page: {scheme}://{dashboard}/" + ("?token=..." if access.token else ""), style="dim")
    except WebError as exc:
        for obs in observers:
            obs.finish(False)
        tell(str(exc))
        raise typer.Exit(2)
    return observers


class _Stopped(BaseException):
    """SIGTERM (a service manager's stop): unwind like Ctrl-C, so the MQTT session closes cleanly.
    A BaseException, like KeyboardInterrupt, so no ``except Exception`` on the way swallows it."""


def _run_daemon(cfg: RunConfig, fn) -> tuple[list[dict], RoundEngine]:
    """Run ``fn()`` and turn every way it can stop early into one line and an exit status.
    None of them tells the agents to stop: they wait for ``--resume``. What the process was set
    up with is left out of the garbage collector's passes first
    (:mod:`coordinator.garbage_collection`)."""
    spare_startup_objects()
    def on_term(signum, frame):
        raise _Stopped()
    previous = signal.signal(signal.SIGTERM, on_term)
    resume_hint = f"the run is checkpointed in {cfg.resolved_output_dir}: continue it with --resume"
    try:
        return fn()
    except (KeyboardInterrupt, _Stopped):
        tell(f"stopped by a signal; agents keep waiting; {resume_hint}", style="yellow")
        raise typer.Exit(130)
    except RunError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    except BrokerUnavailable as exc:   # a configuration error: --broker URL is the way out
        tell(f"{exc}; or give --broker mqtt://host:1883")
        raise typer.Exit(2)
    except BrokerStartError as exc:   # e.g. its port still held by a process on its way out
        tell(str(exc))
        raise typer.Exit(1)
    except ckpt.CheckpointError as exc:
        tell(f"cannot resume: {exc}")
        raise typer.Exit(2)
    except ckpt.CheckpointWriteError as exc:
        tell(f"{exc.strerror}; the previous checkpoint is intact; agents keep waiting; {resume_hint} once "
             f"there is room")
        raise typer.Exit(1)
    except RoundFailed as exc:   # a round nobody could train: the completed ones are checkpointed
        tell(str(exc))
        raise typer.Exit(1)
    except (ConnectionError, TimeoutError) as exc:  # broker unreachable; no fleet (the checkpoint stays)
        tell(str(exc))
        raise typer.Exit(1)
    finally:
        signal.signal(signal.SIGTERM, previous)


@app.command()
def serve(config: Path = typer.Option(..., "--config", "-c", help="Run config YAML (see profiles/runs/)."),
          broker: Optional[str] = typer.Option(None, help="MQTT broker URL, e.g. mqtt://host:1883. "
                                               "Default: start an embedded broker on 127.0.0.1."),
          listen: str = typer.Option("127.0.0.1:1883", help="Where the embedded broker listens (HOST:PORT) "
                                     "when no --broker is given. It has no TLS and no passwords: an address "
                                     "other than loopback needs --insecure-listen."),
          insecure_listen: bool = typer.Option(False, "--insecure-listen", help="Let the embedded broker listen "
                                               "on a non-loopback --listen address without TLS or authentication "
                                               "(anyone on that network can read the run's data)."),
          ca_file: CaFile = None,
          cert_file: CertFile = None,
          key_file: KeyFile = None,
          password_file: PasswordFile = None,
          resume: Optional[str] = RESUME_OPTION,
          rounds: Optional[int] = typer.Option(None, help="Override the config's number of rounds."),
          output: Optional[Path] = typer.Option(None, help="Override the output directory."),
          data: Optional[Path] = DATA_OPTION,
          device: str = typer.Option("auto", help="Server-portion device: auto, cpu, cuda, cuda:1 ..."),
          signing_key: Optional[Path] = typer.Option(None, "--signing-key", help="The coordinator's Ed25519 key "
                                                     "(PEM; created if missing). Default: coordinator.key in the "
                                                     "output directory. Agents follow only what it signs."),
          metrics: Optional[str] = typer.Option(None, "--metrics", metavar="HOST:PORT", help="Serve Prometheus "
                                                "metrics at http://HOST:PORT/metrics, e.g. 127.0.0.1:9464."),
          dashboard: Optional[str] = typer.Option(None, "--dashboard", metavar="HOST:PORT", help="Serve the live "
                                                  "fleet page at http://HOST:PORT/, e.g. 127.0.0.1:8080."),
          dashboard_token: Optional[str] = typer.Option(None, "--dashboard-token", envvar="SFL_DASHBOARD_TOKEN",
                                                        help="Require ?token=... on the page and the metrics "
                                                        "(needed to serve them beyond loopback)."),
          web_tls_cert: Optional[Path] = typer.Option(None, "--web-tls-cert", help="Serve the page and the "
                                                      "metrics over HTTPS with this certificate (PEM)."),
          web_tls_key: Optional[Path] = typer.Option(None, "--web-tls-key", help="The certificate's key (PEM)."),
          insecure_web: bool = typer.Option(False, "--insecure-web", help="Serve the page and the metrics "
                                            "beyond loopback without TLS (the token crosses the network in "
                                            "clear)."),
          server_workers: int = typer.Option(1, min=1, help="Server processes that share the round's agents "
                                             "(torch.distributed: gloo on CPU, NCCL with one GPU each); needs "
                                             "--broker. Or start every rank with torchrun."),
          quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
          verbose: bool = typer.Option(False, "--verbose", "-v")) -> None:
    """Coordinate a real deployment: agents connect through the MQTT broker."""
    setup_logging(verbose)
    keep_freed_memory()
    cfg = load_config(config, rounds, output, data)
    parts = checked_parts(cfg, config)
    problem = cannot_share(cfg.server_mode, broker is not None) if server_workers > 1 else None
    if problem:   # before any rank starts
        tell(f"--server-workers {server_workers}: {problem}")
        raise typer.Exit(2)
    address = None
    if broker is not None:
        try:
            address = address_from_options(broker, ca_file, cert_file, key_file, password_file)
        except ValueError as exc:
            tell(str(exc))
            raise typer.Exit(2)
    elif any((ca_file, cert_file, key_file, password_file)):
        tell("--ca-file/--cert-file/--key-file/--password-file need --broker (the embedded broker "
             "has neither TLS nor passwords)")
        raise typer.Exit(2)
    how = _resume_mode(resume)
    observers = _observers(cfg, metrics, dashboard, web_access(dashboard_token, web_tls_cert, web_tls_key,
                                                                insecure_web))
    workers = []
    if server_workers > 1 and "RANK" not in os.environ:   # not started by torchrun: start ranks 1..N-1
        workers = launch_workers(server_workers, sys.argv[1:])
    try:
        history, engine = _run_daemon(cfg, lambda: serve_run(cfg, address, resume=how, device=device,
                                                              listen=listen, quiet=quiet,
                                                              insecure_listen=insecure_listen, console=console,
                                                              signing_key=signing_key, observers=observers,
                                                              parts=parts))
    finally:
        _end_processes(workers, grace_s=30)
    if engine.shards is not None and not engine.shards.leader:
        return                                             # the leader reports the run
    print_table(console, summary_table(history, engine.registry))
    tell(f"metrics: {cfg.resolved_output_dir / ckpt.METRICS_FILE}", style="default")


@app.command()
def simulate(config: Path = typer.Option(..., "--config", "-c", help="Run config YAML."),
             rounds: Optional[int] = typer.Option(None, help="Override the config's number of rounds."),
             output: Optional[Path] = typer.Option(None, help="Override the output directory."),
             data: Optional[Path] = DATA_OPTION,
             resume: Optional[str] = RESUME_OPTION,
             device: str = typer.Option("auto", help="Server-portion device."),
             ray: bool = typer.Option(False, "--ray", help="Train the agents in Ray actors, in parallel, on a "
                                      "local Ray (same results as without it). Needs pip install 'sfl-edge[ray]'."),
             ray_address: Optional[str] = typer.Option(None, help="With --ray (implies it): join this Ray cluster "
                                                       "instead, e.g. ray://head:10001 or auto."),
             ray_workers: Optional[int] = typer.Option(None, min=1, help="With --ray: number of actors "
                                                       "(default: one per CPU of the Ray cluster)."),
             quiet: bool = typer.Option(False, "--quiet", "-q"),
             verbose: bool = typer.Option(False, "--verbose", "-v")) -> None:
    """Simulate the fleet with a virtual clock (times from the device profiles; docs/methods/time-model.md):
    agents in this process, or in Ray actors with --ray."""
    setup_logging(verbose)
    keep_freed_memory()
    if ray_workers is not None and not (ray or ray_address):
        tell("--ray-workers needs --ray (or --ray-address)")
        raise typer.Exit(2)
    cfg = load_config(config, rounds, output, data)
    parts = checked_parts(cfg, config)
    how = _resume_mode(resume)
    history, engine = _run_daemon(cfg, lambda: run_simulation(cfg, resume=how, device=device, quiet=quiet,
                                                              console=console,
                                                              ray=ray_address or ("local" if ray else None),
                                                              ray_workers=ray_workers, parts=parts))
    print_table(console, summary_table(history, engine.registry))
    tell(f"metrics: {cfg.resolved_output_dir / ckpt.METRICS_FILE}", style="default")


@app.command()
def demo(config: Optional[Path] = typer.Option(None, "--config", "-c", help="Default: the shipped runs/demo.yaml."),
         rounds: Optional[int] = typer.Option(None, help="Override the number of rounds."),
         output: Optional[Path] = typer.Option(None, help="Override the output directory."),
         data: Optional[Path] = DATA_OPTION,
         broker: Optional[str] = typer.Option(None, help="Run through this MQTT broker (mqtt://host:port, "
                                              "anonymous clients allowed) instead of an embedded one: a "
                                              "quick check that a broker carries the protocol."),
         verbose: bool = typer.Option(False, "--verbose", "-v")) -> None:
    """Zero-setup demo: embedded broker + coordinator + one emulated agent process per fleet member."""
    setup_logging(verbose)
    config = config or default_profiles_dir() / DEMO_CONFIG
    cfg = load_config(config, rounds, output, data)
    parts = checked_parts(cfg, config)
    if broker is not None:
        try:
            address_from_options(broker, None, None, None, None)
        except ValueError as exc:
            tell(f"--broker: {exc}")
            raise typer.Exit(2)
    procs: list[subprocess.Popen] = []
    logs_dir = cfg.resolved_output_dir / "agent-logs"

    def launch(broker_url: Any, coordinator_key: str) -> None:   # the demo's embedded broker: a URL
        logs_dir.mkdir(parents=True, exist_ok=True)
        from sfl_core.model.user_models import model_source
        source = model_source(cfg.model)
        for i, (profile, own) in enumerate(zip(cfg.agent_profiles(), cfg.agent_data())):
            cmd = [sys.executable, "-m", "cli.agent", "start", "--profile", profile, "--broker", str(broker_url),
                   "--run", cfg.run_id, "--agent-id", f"agent-{i}", "--emulate", "--coordinator-key", coordinator_key]
            if own is not None:     # a task run: each agent its own data
                cmd += ["--data", own]
            else:                   # a benchmark run: shard i of the built-in set
                cmd += ["--index", str(i)] + (["--data", cfg.data.root] if cfg.data.root else [])
            if source is not None:  # the user's model file, the same one here
                cmd += ["--model-file", source[0]]
            log_file = open(logs_dir / f"agent-{i}.log", "w")
            env = dict(os.environ, OMP_NUM_THREADS="1")  # several agents share this machine's cores
            procs.append(subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env))
        console.print(f"started {len(procs)} agent processes (logs in {logs_dir})")

    t0 = time.monotonic()
    finished = False
    try:
        history, engine = _run_daemon(cfg, lambda: serve_run(cfg, broker, on_broker=launch, console=console,
                                                               parts=parts))
        finished = True
    finally:
        # after a finished run the agents exit by themselves; otherwise (they would wait for a resumed
        # coordinator) the demo, which started them, ends them
        _end_processes(procs, grace_s=20 if finished else 0)
    print_table(console, summary_table(history, engine.registry))
    codes = [p.returncode for p in procs]
    tell(f"demo finished in {time.monotonic() - t0:.1f} s wall; agent exit codes {codes}; "
         f"metrics in {cfg.resolved_output_dir / ckpt.METRICS_FILE}", style="default")
    if any(codes):
        raise typer.Exit(1)


def _end_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` for each process, then SIGTERM, then SIGKILL: never leave a stray one."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
