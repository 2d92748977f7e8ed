"""``sfl-coord``: serve a run over MQTT, simulate a fleet, run the demo, inspect models and runs."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import click
import typer
from rich.console import Console
from typer.core import TyperGroup
from rich.table import Table

from sfl_core.model.accounting import format_cost_table, model_costs
from sfl_core.config.run import ConfigError, RunConfig, default_profiles_dir, list_profiles, load_run_config
from sfl_core.data.builtin import DatasetError, load_dataset
from sfl_core.methods import build_method
from sfl_core.model.zoo import build_model, model_names
from sfl_core.console import say
from sfl_core.version import version_option

from sfl_core.transport.cli_options import CaFile, CertFile, KeyFile, PasswordFile, address_from_options

from coordinator import state as ckpt
from coordinator.console import print_table, status_table, summary_table
from coordinator.engine import RoundEngine, RoundFailed
from coordinator.export import run_model
from coordinator.api import RunError, output_dir, run_simulation
from coordinator.api import serve as serve_run
from coordinator.server_workers import cannot_share, launch_workers

class _Commands(TyperGroup):
    """``--resume`` alone means resume, ``--resume auto`` resume-or-start: click has no option
    that takes a value only sometimes, so the one token is rewritten before parsing."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out: list[str] = []
        for i, a in enumerate(args):
            if a == "--resume":
                out.append("--resume=auto" if i + 1 < len(args) and args[i + 1] == "auto" else "--resume=yes")
            elif a == "auto" and i and args[i - 1] == "--resume":
                continue
            else:
                out.append(a)
        return super().parse_args(ctx, out)


app = typer.Typer(help="Split federated learning coordinator.", no_args_is_help=True, add_completion=False,
                  rich_markup_mode=None, cls=_Commands)   # help text is plain: "sfl-edge[ray]" must print as written
console = Console(stderr=True)
log = logging.getLogger("sfl.coord")

DEMO_CONFIG = "runs/demo.yaml"


@app.callback()
def _main(version: Optional[bool] = version_option("sfl-coord")) -> None:
    pass


def _say(text: str, style: str = "red") -> None:
    say(console, text, style)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _run_config_path(config: Path) -> Path:
    """A run config file, or the name of a shipped one (``demo``, ``s2fl-demo``: what
    ``sfl-coord profiles`` lists), so an installed wheel runs them from any directory."""
    if config.exists() or config.parent != Path(".") :
        return config
    for candidate in (default_profiles_dir() / "runs" / config.name,
                      default_profiles_dir() / "runs" / f"{config.name}.yaml"):
        if candidate.is_file():
            return candidate
    return config


def _load(config: Path, rounds: Optional[int], output: Optional[Path], data: Optional[Path] = None) -> RunConfig:
    config = _run_config_path(config)
    try:
        cfg = load_run_config(config)
    except ConfigError as exc:
        _say(str(exc))
        raise typer.Exit(2)
    if rounds is not None:
        cfg = dataclasses.replace(cfg, rounds=rounds)
    if output is not None:
        cfg = dataclasses.replace(cfg, output_dir=str(output))
    if data is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, root=str(data)))
    if cfg.task is None:
        try:    # read the data set now, so a wrong path names where it came from (cached for the run)
            ds = load_dataset(cfg.data.dataset, cfg.data.root, cfg.data.image_size)
        except DatasetError as exc:
            field = "data.image_size" if str(exc).startswith("image_size") else "data.root"
            where = "--data" if data is not None and field == "data.root" else f"{config}: field '{field}'"
            _say(f"{where}: {exc}")
            raise typer.Exit(2)
    shape, classes = _shape_and_classes(cfg)
    try:    # settings only the model can judge (a cut it lacks, a bottleneck wider than the cut)
        build_method(cfg, run_model(cfg, shape, classes), model_costs(cfg.model, shape, classes))
    except ValueError as exc:
        _say(f"{config}: {exc}")
        raise typer.Exit(2)
    return cfg


RESUME_OPTION = typer.Option(None, "--resume", metavar="[auto]",
                             help="Continue the run from its last checkpoint. '--resume auto': continue if the "
                             "run's checkpoint exists, start fresh if there is none, refuse a damaged one (what a "
                             "service manager's restart needs).")


def _resume_mode(value: Optional[str]) -> "bool | str":
    if value is None:
        return False
    if value in ("yes", "auto"):
        return True if value == "yes" else "auto"
    _say(f"--resume {value}: expected no value (resume) or auto")
    raise typer.Exit(2)


def _web_access(token: Optional[str], cert: Optional[Path], key: Optional[Path], insecure: bool) -> "WebAccess":
    from coordinator.web import WebAccess

    if bool(cert) != bool(key):
        _say("--web-tls-cert and --web-tls-key go together")
        raise typer.Exit(2)
    return WebAccess(token=token, tls=(str(cert), str(key)) if cert and key else None, insecure=insecure)


def _observers(cfg: RunConfig, metrics: Optional[str], dashboard: Optional[str], access: "WebAccess") -> list:
    """The metrics exporter and the live page, bound before the run starts (a taken port, or a
    non-loopback address without a token and TLS, is a configuration error: exit 2)."""
    from coordinator.web import WebError, start_dashboard, start_metrics

    scheme = "https" if access.tls else "http"
    observers = []
    try:
        if metrics:
            observers.append(start_metrics(metrics, cfg, access))
            _say(f"metrics: {scheme}://{metrics}/metrics", style="dim")
        if dashboard:
            observers.append(start_dashboard(dashboard, output_dir(cfg), cfg, access))
            _say(f"live fleet page: {scheme}://{dashboard}/" + ("?token=..." if access.token else ""), style="dim")
    except WebError as exc:
        for obs in observers:
            obs.finish(False)
        _say(str(exc))
        raise typer.Exit(2)
    return observers


DATA_OPTION = typer.Option(None, "--data", help="Directory of the run's data set; overrides the config's "
                           "data.root (not needed for 'digits').")


class _Stopped(BaseException):
    """SIGTERM (a service manager's stop): unwind like Ctrl-C, so the MQTT session closes cleanly.
    A BaseException, like KeyboardInterrupt, so no ``except Exception`` on the way swallows it."""


def _run_daemon(cfg: RunConfig, fn) -> tuple[list[dict], RoundEngine]:
    """Run ``fn()`` and turn every way it can stop early into one line and an exit status.
    None of them tells the agents to stop: they wait for ``--resume``."""
    def on_term(signum, frame):
        raise _Stopped()
    previous = signal.signal(signal.SIGTERM, on_term)
    resume_hint = f"the run is checkpointed in {output_dir(cfg)}: continue it with --resume"
    try:
        return fn()
    except (KeyboardInterrupt, _Stopped):
        _say(f"stopped by a signal; agents keep waiting; {resume_hint}", style="yellow")
        raise typer.Exit(130)
    except RunError as exc:
        _say(str(exc))
        raise typer.Exit(2)
    except ckpt.CheckpointError as exc:
        _say(f"cannot resume: {exc}")
        raise typer.Exit(2)
    except ckpt.CheckpointWriteError as exc:
        _say(f"{exc.strerror}; the previous checkpoint is intact; agents keep waiting; {resume_hint} once "
             f"there is room")
        raise typer.Exit(1)
    except RoundFailed as exc:   # a round nobody could train: the completed ones are checkpointed
        _say(str(exc))
        raise typer.Exit(1)
    except (ConnectionError, TimeoutError) as exc:  # broker unreachable; no fleet (the checkpoint stays)
        _say(str(exc))
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
    _setup_logging(verbose)
    cfg = _load(config, rounds, output, data)
    problem = cannot_share(cfg.server_mode, broker is not None) if server_workers > 1 else None
    if problem:   # before any rank starts
        _say(f"--server-workers {server_workers}: {problem}")
        raise typer.Exit(2)
    address = None
    if broker is not None:
        try:
            address = address_from_options(broker, ca_file, cert_file, key_file, password_file)
        except ValueError as exc:
            _say(str(exc))
            raise typer.Exit(2)
    elif any((ca_file, cert_file, key_file, password_file)):
        _say("--ca-file/--cert-file/--key-file/--password-file need --broker (the embedded broker "
             "has neither TLS nor passwords)")
        raise typer.Exit(2)
    how = _resume_mode(resume)
    observers = _observers(cfg, metrics, dashboard, _web_access(dashboard_token, web_tls_cert, web_tls_key,
                                                                insecure_web))
    workers = []
    if server_workers > 1 and "RANK" not in os.environ:   # not started by torchrun: start ranks 1..N-1
        workers = launch_workers(server_workers, sys.argv[1:])
    try:
        history, engine = _run_daemon(cfg, lambda: serve_run(cfg, address, resume=how, device=device,
                                                              listen=listen, quiet=quiet,
                                                              insecure_listen=insecure_listen, console=console,
                                                              signing_key=signing_key, observers=observers))
    finally:
        _end_processes(workers, grace_s=30)
    if engine.shards is not None and not engine.shards.leader:
        return                                             # the leader reports the run
    print_table(console, summary_table(history, engine.registry))
    _say(f"metrics: {output_dir(cfg) / ckpt.METRICS_FILE}", style="default")


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
    """Simulate the fleet with a virtual clock (times from the device profiles; docs/methods.md §3):
    agents in this process, or in Ray actors with --ray."""
    _setup_logging(verbose)
    if ray_workers is not None and not (ray or ray_address):
        _say("--ray-workers needs --ray (or --ray-address)")
        raise typer.Exit(2)
    cfg = _load(config, rounds, output, data)
    how = _resume_mode(resume)
    history, engine = _run_daemon(cfg, lambda: run_simulation(cfg, resume=how, device=device, quiet=quiet,
                                                              console=console,
                                                              ray=ray_address or ("local" if ray else None),
                                                              ray_workers=ray_workers))
    print_table(console, summary_table(history, engine.registry))
    _say(f"metrics: {output_dir(cfg) / ckpt.METRICS_FILE}", style="default")


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
    _setup_logging(verbose)
    cfg = _load(config or default_profiles_dir() / DEMO_CONFIG, rounds, output, data)
    if broker is not None:
        try:
            address_from_options(broker, None, None, None, None)
        except ValueError as exc:
            _say(f"--broker: {exc}")
            raise typer.Exit(2)
    procs: list[subprocess.Popen] = []
    logs_dir = output_dir(cfg) / "agent-logs"

    def launch(broker_url: str) -> None:
        logs_dir.mkdir(parents=True, exist_ok=True)
        from sfl_core.model.user_models import model_source
        source = model_source(cfg.model)
        for i, (profile, own) in enumerate(zip(cfg.agent_profiles(), cfg.agent_data())):
            cmd = [sys.executable, "-m", "edge_agent.cli", "start", "--profile", profile, "--broker", broker_url,
                   "--run", cfg.run_id, "--agent-id", f"agent-{i}", "--emulate"]
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
        history, engine = _run_daemon(cfg, lambda: serve_run(cfg, broker, on_broker=launch, console=console))
        finished = True
    finally:
        # after a finished run the agents exit by themselves; otherwise (they would wait for a resumed
        # coordinator) the demo, which started them, ends them
        _end_processes(procs, grace_s=20 if finished else 0)
    print_table(console, summary_table(history, engine.registry))
    codes = [p.returncode for p in procs]
    _say(f"demo finished in {time.monotonic() - t0:.1f} s wall; agent exit codes {codes}; "
         f"metrics in {output_dir(cfg) / ckpt.METRICS_FILE}", style="default")
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


@app.command()
def models(model: Optional[str] = typer.Argument(None, help="A zoo model (see the list with no argument) or a registered one; default all."),
           input_shape: str = typer.Option("3,32,32", help="Per-sample input shape, e.g. 1,28,28."),
           classes: int = typer.Option(10),
           config: Optional[Path] = typer.Option(None, "--config", "-c", help="A run config: its model, input "
                                                 "shape and fleet; adds each cut's round time for that fleet "
                                                 "(time model, slowest agent) and marks the fastest.")) -> None:
    """Per split point: client parameters/bytes, client and server FLOPs, activation bytes."""
    if config is not None:
        _models_for_run(config)
        return
    shape = tuple(int(v) for v in input_shape.split(","))
    for name in [model] if model else model_names():
        if name == "cnn1d" and len(shape) != 2:
            continue
        if name != "cnn1d" and len(shape) != 3:
            continue
        m = build_model(name, shape, classes)
        console.print(f"[bold]{name}[/] input {shape}, {classes} classes")
        print(format_cost_table(model_costs(name, shape, classes), m.block_names))


def _shape_and_classes(cfg: "RunConfig") -> tuple[tuple[int, ...], int]:
    """The per-sample input shape and class count of a run, without loading any data."""
    from sfl_core.data.builtin import input_shape_of

    if cfg.task is not None:
        return tuple(cfg.task.input_shape), cfg.task.num_classes
    return input_shape_of(cfg.data.dataset, cfg.data.image_size), 10


def _label_counts(cfg: "RunConfig") -> list[list[int]]:
    """Each agent's label counts for ``plan``: its own data (a task run's fleet ``data``), else
    its shard of the built-in set by the run's partition. DatasetError names what is wrong."""
    from sfl_core.data.partition import partition_indices

    if cfg.task is not None:
        from sfl_core.data.local import load_local
        counts = []
        for i, path in enumerate(cfg.agent_data()):
            if path is None:
                raise DatasetError(f"fleet: agent {i} has no 'data': planning a run on the devices' own data needs "
                                   f"each fleet entry's data path")
            counts.append(load_local(path, cfg.task, cfg.data.bad_files).train.label_counts(cfg.task.num_classes))
        return counts
    ds = load_dataset(cfg.data.dataset, cfg.data.root, cfg.data.image_size)
    labels = ds.y_train.numpy()
    shards = partition_indices(labels, cfg.num_agents, cfg.data.partition, alpha=cfg.data.alpha, seed=cfg.data.seed,
                               num_classes=ds.num_classes)
    return [[int((labels[s] == c).sum()) for c in range(ds.num_classes)] for s in shards]


def _models_for_run(config: Path) -> None:
    """The run's model, one row per cut with the round it would take on the run's fleet."""
    from sfl_core.model.accounting import split_note
    from sfl_core.config.run import load_profile
    from sfl_core.timing import fleet_round_time

    try:
        cfg = load_run_config(config)
    except ConfigError as exc:
        _say(str(exc))
        raise typer.Exit(2)
    shape, classes = _shape_and_classes(cfg)
    m = build_model(cfg.model, shape, classes)
    costs = model_costs(cfg.model, shape, classes)
    profiles = [load_profile(p) for p in dict.fromkeys(cfg.agent_profiles())]
    samples = cfg.batch_size * cfg.local_iters

    times = {s: fleet_round_time(costs[s], profiles, samples=samples, server_flops_per_s=cfg.server_flops)
             for s in sorted(costs) if s < m.num_blocks}
    fastest = min(times, key=times.get)
    configured = build_method(cfg, m, costs).configured_splits
    print(f"{cfg.model} input {shape} for run {cfg.run_id} ({len(profiles)} device profile(s), "
          f"{samples} samples per agent per round)")
    lines = format_cost_table(costs, m.block_names).splitlines()
    print(lines[0] + "  fleet round s")
    print(lines[1] + "  " + "-" * 13)
    for line, s in zip(lines[2:], sorted(costs)):
        mark = "  <- fastest" if s == fastest else ""
        mark += "  <- configured" if s in configured else ""
        print(line + (f"  {times[s]:13.1f}{mark}" if s in times else ""))
    for note in filter(None, (split_note(costs, s, shape) for s in configured)):
        _say(note, style="yellow")


@app.command()
def plan(config: Path = typer.Option(..., "--config", "-c", help="Run config YAML."),
         json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the comparison as JSON here."),
         data: Optional[Path] = typer.Option(None, help="Override data.root (for the label counts).")) -> None:
    """Before any training: each method's predicted round time, bytes and waiting time on this fleet,
    and auto's assignment per agent (time model from the device profiles; a run refines it)."""
    import json

    from sfl_core.methods.auto.method import decide_widths
    from sfl_core.fleet import fleet_of
    from sfl_core.methods.preview import preview, variants

    cfg = _load(config, None, None, data)
    try:
        counts = _label_counts(cfg)
    except DatasetError as exc:
        _say(str(exc))
        raise typer.Exit(2)
    n = cfg.num_agents
    shape, classes = _shape_and_classes(cfg)
    model = build_model(cfg.model, shape, classes)
    costs = model_costs(cfg.model, shape, classes)
    agents = fleet_of(cfg, counts)
    rows = preview(cfg, model, costs, agents)
    per_round = cfg.per_round or n
    table = Table(title=f"{cfg.run_id}: {cfg.model}, {n} agents, {per_round} per round, "
                        f"{cfg.local_iters} steps of batch {cfg.batch_size} (predicted by the time model)")
    for col in ("method", "round s", "vs auto", "MB per round", "waiting s"):
        table.add_column(col, justify="left" if col == "method" else "right")
    auto = next(r for r in rows if r.method == "auto")
    for r in rows:
        table.add_row(r.method, f"{r.round_s:.3g}", f"{r.round_s / auto.round_s:.2f}x" if auto.round_s else "-",
                      f"{r.bytes_per_round / 1e6:.3g}", f"{r.waiting_s:.3g}")
    Console().print(table)
    auto_cfg = variants(cfg, model, costs)["auto"]
    widths = decide_widths(auto_cfg, model, costs)
    if auto_cfg.auto.widths:      # what auto decided (widths: auto), or the widths listed
        _say(widths.why or f"bottleneck: widths {list(auto_cfg.auto.widths)}")
    rival = min((r for r in rows if r.method != "auto"), key=lambda r: r.round_s)
    if rival.round_s < auto.round_s:
        hint = ""
        if rival.method == "HeteroSFL" and not widths.widths:
            how = ("list widths in auto.widths, or lower auto.min_bottleneck_values"
                   if auto_cfg.auto.widths == "auto" else "set auto.widths (auto, or a list)")
            hint = f" Its bottleneck is one of auto's options: {how} (docs/methods.md §11)."
        _say(f"{rival.method}'s round is predicted {auto.round_s / rival.round_s:.2f}x shorter than auto's.{hint}", "yellow")
    names = {a: info.profile.name for a, info in agents.items()}
    detail = Table(title="auto's assignment (first round)")
    for col in ("agent", "profile", "split", "codec", "batch", "round s"):
        detail.add_column(col)
    for a, x in sorted(auto.agents.items()):
        whole = x.split == model.num_blocks
        codec = "-" if whole else f"{x.codec}, width {x.width}" if x.width else x.codec
        detail.add_row(a, names[a], "whole model" if whole else str(x.split), codec, str(x.batch), f"{x.time_s:.3g}")
    Console().print(detail)
    if json_out is not None:
        json_out.write_text(json.dumps({"run": cfg.run_id, "model": cfg.model,
                                        "methods": [r.to_json() for r in rows]}, indent=1))


@app.command()
def profiles() -> None:
    """List the device profiles (devices/) and run configs (runs/) of the profiles folder in use."""
    from sfl_core.config.run import load_profile, profiles_origin
    root, origin = default_profiles_dir(), profiles_origin()
    hint = "" if origin == "SFL_PROFILES_DIR" else "; set SFL_PROFILES_DIR to use a folder of your own"
    console.print(f"profiles folder: {root} ({origin}{hint})", markup=False, highlight=False)
    table = Table(title=f"device profiles ({root / 'devices'})")
    for col in ("name", "FLOP/s", "uplink B/s", "downlink B/s", "latency s"):
        table.add_column(col)
    for name in list_profiles():
        p = load_profile(name)
        table.add_row(name, f"{p.compute_flops:.3g}", f"{p.link_bytes_per_s:.3g}", f"{p.downlink_bytes_per_s:.3g}",
                      f"{p.latency_s:g}")
    console.print(table)
    runs = sorted(p.name for p in (root / "runs").glob("*.y*ml")) if (root / "runs").is_dir() else []
    console.print(f"run configs ({root / 'runs'}): {', '.join(runs) or 'none'}", markup=False, highlight=False)


@app.command()
def status(run_dir: Path = typer.Argument(..., help="A run's output directory, e.g. runs/demo."),
           fmt: str = typer.Option("table", "--format", help="table (fits 80 columns) or json (for scripts: "
                                   "every metric of every round and the checkpoint state).")) -> None:
    """Print a run's checkpoint state and its per-round metrics."""
    if fmt not in ("table", "json"):
        _say(f"--format: expected table or json, got {fmt!r}")
        raise typer.Exit(2)
    try:
        metrics = ckpt.read_metrics(run_dir)
    except ckpt.CheckpointError as exc:
        _say(str(exc))
        raise typer.Exit(2)
    if not metrics:
        _say(f"no metrics in {run_dir}")
        raise typer.Exit(1)
    st = None
    if (run_dir / ckpt.MODEL_FILE).exists():
        try:
            st = ckpt.load_state(run_dir)
        except ckpt.CheckpointError as exc:
            _say(f"checkpoint unreadable: {exc}", style="yellow")
    if fmt == "json":
        import json
        print(json.dumps({"run_dir": str(run_dir), "rounds": metrics, "checkpoint": st}, indent=1))
        return
    out = Console()
    print_table(out, status_table(metrics, str(run_dir)))
    if st is not None:
        from sfl_core.estimates import ClientTimeTable
        out.print(f"checkpoint after round {st['round']} (model {st['model']}, strategy {st.get('strategy', '?')})")
        if st.get("time_table") and st.get("candidates"):
            out.print("client time table: seconds per round at each candidate split (* = estimated)")
            print(ClientTimeTable.from_json(st["time_table"]).format(st["candidates"]))
    last = metrics[-1]
    if last.get("agents"):
        splits = {a: v["split"] for a, v in last["agents"].items()}
        out.print(f"round {last['round']} ({last.get('phase', '')}): splits {splits}; groups {last.get('groups')}")


@app.command()
def dashboard(run_dir: Path = typer.Argument(..., help="A run's output directory, e.g. runs/demo (running or "
                                             "finished)."),
              listen: str = typer.Option("127.0.0.1:8080", "--listen", help="Where the page listens (HOST:PORT)."),
              token: Optional[str] = typer.Option(None, "--token", envvar="SFL_DASHBOARD_TOKEN",
                                                  help="Require ?token=... (needed beyond loopback)."),
              tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="Serve over HTTPS with this "
                                                      "certificate (PEM)."),
              tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="The certificate's key (PEM)."),
              insecure: bool = typer.Option(False, "--insecure", help="Beyond loopback without TLS (the token "
                                            "crosses the network in clear).")) -> None:
    """Serve the live fleet page over a run's files until Ctrl-C or SIGTERM."""
    from coordinator.web import WebError, start_dashboard

    if not run_dir.is_dir():
        _say(f"{run_dir}: not a directory (a run's output directory, e.g. runs/demo)")
        raise typer.Exit(2)
    access = _web_access(token, tls_cert, tls_key, insecure)
    try:
        page = start_dashboard(listen, run_dir, access=access)
    except WebError as exc:
        _say(str(exc))
        raise typer.Exit(2)
    host = listen.rpartition(":")[0] or "127.0.0.1"
    _say(f"fleet page of {run_dir}: {'https' if access.tls else 'http'}://{host}:{page.port}/"
         + ("?token=..." if token else "")
         + " (Ctrl-C to stop)", style="green")
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        page.finish(True)


@app.command("export")
def export_cmd(run_dir: Path = typer.Argument(..., help="A run's output directory, e.g. runs/demo."),
           onnx: Path = typer.Option(..., "--onnx", help="Where to write the ONNX file (a .json sidecar goes beside it)."),
           split: Optional[int] = typer.Option(None, "--split", help="Export only the client portion blocks[:K] "
                                               "(what an agent at split K runs); default: the whole model."),
           config: Optional[Path] = typer.Option(None, "--config", "-c", help="The run's config; needed only for "
                                                 "runs whose state.json predates model_info.")) -> None:
    """Export a run's trained global model (or a client portion) to ONNX for `sfl-agent predict`."""
    from coordinator.export import ExportError, export_run

    try:
        meta = export_run(run_dir, onnx, split=split, config=config)
    except ExportError as exc:
        _say(str(exc))
        raise typer.Exit(2)
    what = "whole model" if meta["split"] is None else f"client portion, split {meta['split']}"
    console.print(f"wrote {onnx} ({onnx.stat().st_size / 1e6:.2f} MB): {meta['model']} ({what}) after round "
                  f"{meta.get('round')}, input (N, {', '.join(map(str, meta['input_shape']))}) -> "
                  f"(N, {', '.join(map(str, meta['output_shape']))}) {meta['output']}, opset {meta['opset']}")
    console.print(f"sidecar: {onnx.with_suffix('.json')}")


@app.command("broker-config")
def broker_config(out: Path = typer.Argument(..., help="Directory for mosquitto.conf, acl, passwd, credentials/."),
                  agent: list[str] = typer.Option([], "--agent", "-a", help="An agent's user name = its agent id "
                                                  "(repeat per device)."),
                  agents_file: Optional[Path] = typer.Option(None, help="File of agent user names, one per line."),
                  coordinator_user: str = typer.Option("coordinator", help="The coordinator's user name."),
                  port: Optional[int] = typer.Option(None, help="Listener port (default 8883 with TLS, else 1883)."),
                  bind: str = typer.Option("0.0.0.0", help="Listener address."),
                  tls_cert: Optional[Path] = typer.Option(None, help="The broker's certificate (PEM); with --tls-key "
                                                          "the listener speaks TLS (mqtts://)."),
                  tls_key: Optional[Path] = typer.Option(None, help="The broker certificate's private key."),
                  tls_ca: Optional[Path] = typer.Option(None, help="CA of client certificates (with --client-certs)."),
                  client_certs: bool = typer.Option(False, "--client-certs", help="Require client certificates; their "
                                                    "common name is the user name (no passwords)."),
                  persistence_dir: Optional[Path] = typer.Option(None, help="Keep retained messages and sessions "
                                                                 "here across broker restarts."),
                  server_workers: int = typer.Option(1, min=1, help="Also create the users of `serve "
                                                     "--server-workers N`'s further ranks (<coordinator>-w1 ...), "
                                                     "with the coordinator's rights and password.")) -> None:
    """Write a Mosquitto configuration: TLS listener, one user per device, an ACL that confines each
    agent to its own topics (`mosquitto -c OUT/mosquitto.conf`)."""
    from coordinator.broker_config import BrokerTls, write_broker_config

    names = list(agent)
    if agents_file is not None:
        names += [ln.strip() for ln in agents_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if bool(tls_cert) != bool(tls_key):
        _say("--tls-cert and --tls-key go together")
        raise typer.Exit(2)
    if client_certs and not (tls_cert and tls_ca):
        _say("--client-certs needs --tls-cert, --tls-key and --tls-ca")
        raise typer.Exit(2)
    tls = BrokerTls(str(tls_cert.resolve()), str(tls_key.resolve()), str(tls_ca.resolve()) if tls_ca else None,
                    client_certs) if tls_cert and tls_key else None
    port = port or (8883 if tls else 1883)
    try:
        files = write_broker_config(out, names, coordinator_user=coordinator_user, port=port, bind=bind, tls=tls,
                                    persistence_dir=persistence_dir, server_workers=server_workers)
    except ValueError as exc:
        _say(str(exc))
        raise typer.Exit(2)
    scheme = "mqtts" if tls else "mqtt"
    if tls is None:
        _say("no --tls-cert/--tls-key: passwords would cross the network in clear text; "
             "use this only on a trusted network", style="yellow")
    console.print(f"wrote {files.conf}, {files.acl}" + (f", {files.passwd}" if files.passwd else ""))
    if files.credentials:
        console.print(f"credentials (hand each device its own file, mode 0600): {out / 'credentials'}/<user>.password")
    console.print(f"start the broker:  mosquitto -c {files.conf}")
    console.print(f"coordinator:       sfl-coord serve -c RUN.yaml --broker {scheme}://{coordinator_user}@HOST:{port}"
                  + (" --ca-file CA.crt" if tls else "") + (f" --password-file {coordinator_user}.password"
                                                              if files.credentials else ""))
    console.print(f"each agent:        sfl-agent start --broker {scheme}://AGENT@HOST:{port}"
                  + (" --ca-file CA.crt" if tls else "")
                  + (" --password-file AGENT.password" if files.credentials else " --cert-file AGENT.crt --key-file AGENT.key")
                  + " --profile P --run R --index I")


if __name__ == "__main__":
    app()
