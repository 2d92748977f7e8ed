"""``sfl-agent start`` and ``check-data``: join a run, or check this device's data against it first."""

from __future__ import annotations

import logging
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer

from cli.agent.app import app, console, tell, use_config_file
from cli.broker_options import CaFile, CertFile, KeyFile, PasswordFile, address_from_options

if TYPE_CHECKING:
    from sfl_core.privacy import AgentPrivacy
    from sfl_core.transport.broker_url import BrokerAddress
    from sfl_core.wire.signing import Trust


def _privacy(nopeek: float, activation_noise: Optional[str], withhold_labels: bool, label_protection: Optional[str],
             dp_sgd: Optional[str]) -> "AgentPrivacy":
    """The defenses of the privacy flags; ValueError naming the flag that is wrong."""
    from sfl_core.privacy import ActivationNoise, AgentPrivacy, DpSgd, LabelProtection

    def parse(flag: str, value: Optional[str], kind):
        try:
            return None if value is None else kind.parse(value)
        except ValueError as exc:
            raise ValueError(f"{flag} {value}: {exc}") from None

    return AgentPrivacy(nopeek, parse("--activation-noise", activation_noise, ActivationNoise),
                        withhold_labels=withhold_labels,
                        label_protection=parse("--label-protection", label_protection, LabelProtection),
                        dp_sgd=parse("--dp-sgd", dp_sgd, DpSgd))


def _start_settings(config: Optional[Path]) -> dict:
    """What ``start --config FILE`` would read from ``config`` ({} without one); exit 2 with one
    line on a bad file. ``check-data`` and ``status`` read the same file as ``start``."""
    from edge_agent.settings import command_option_specs, load_settings_file
    from sfl_core.config.run import ConfigError

    if config is None:
        return {}
    start_cmd = typer.main.get_command(app).commands["start"]   # type: ignore[attr-defined]
    specs = command_option_specs(start_cmd.params, exclude={"config"},
                                 path_options={"data", "trust_file", "model_file", "status_file"},
                                 maybe_path_options={"profile"})
    try:
        return load_settings_file(config, specs)
    except ConfigError as exc:
        tell(str(exc))
        raise typer.Exit(2)


def trust_problem(trust: "Trust", run: str, address: "BrokerAddress") -> Optional[str]:
    """Why this agent cannot know whom to obey (one line), or None: trust comes from outside the
    broker (a key given or pinned) unless --trust-first-use, and that only where the broker
    authenticates devices (docs/security.md, the threat model)."""
    if trust.pinned(run) is not None:
        return None
    if not trust.first_use:
        return (f"no coordinator key for run {run!r}: give --coordinator-key (the coordinator's coordinator.pub, "
                f"printed by `sfl-coord serve` and issued by `sfl-coord broker-config`), or --trust-first-use on a "
                f"broker that authenticates devices")
    if not address.username and not address.tls_files.cert_file:
        return (f"--trust-first-use on {address.url()}, which does not authenticate this device (no user name, no "
                f"client certificate): anyone on it could publish the first run description; give "
                f"--coordinator-key instead")
    if trust.trust_file is None:
        return ("--trust-first-use needs --trust-file: the key seen first must be kept, or a restart would "
                "believe whatever description it sees first again")
    return None


@app.command()
def start(config: Optional[Path] = typer.Option(None, "--config", "-c", is_eager=True, callback=use_config_file,
                                                help="YAML file of these options (keys: the option names with "
                                                "underscores, e.g. shard_file); flags given here win over it. "
                                                "See profiles/agent.example.yaml."),
          profile: Optional[str] = typer.Option(None, "--profile", "-p", help="Device profile: a name from "
                                                "profiles/devices/ or a YAML path (required, here or in --config)."),
          broker: str = typer.Option("mqtt://127.0.0.1:1883", help="MQTT broker URL (mqtt:// or mqtts://, user:pass@ allowed)."),
          ca_file: CaFile = None,
          cert_file: CertFile = None,
          key_file: KeyFile = None,
          password_file: PasswordFile = None,
          run: str = typer.Option("demo", "--run", help="Run id announced by the coordinator."),
          data: Optional[str] = typer.Option(None, "--data", help="This device's data: an image folder "
                                             "(<class>/<image> or train/<class>/..., optional val/), .npz, a folder "
                                             "of x.npy/y.npy, CSV, Parquet, a Hugging Face data set (save_to_disk, "
                                             "or hf:BUILDER:PATH); for a built-in benchmark set, its directory."),
          index: int = typer.Option(0, help="This agent's shard index in the run's partition."),
          shard_file: Optional[Path] = typer.Option(None, help="Benchmark runs: a .npy array or JSON {\"indices\": [...]} of training-set indices (instead of --index)."),
          agent_id: Optional[str] = typer.Option(None, help="Default: the broker user name (per-device credentials: "
                                                 "the broker's ACL grants topics by it), else <hostname>-<index>."),
          emulate: bool = typer.Option(False, "--emulate/--no-emulate", help="Stretch compute and throttle the link to the profile's device."),
          slowdown: float = typer.Option(1.0, "--slowdown", help="Fault injection / testing aid, with --emulate: run this "
                                         "many times slower than the profile (compute and link) while registering the "
                                         "profile's numbers, e.g. 10 for a straggler."),
          seed: int = typer.Option(0),
          withhold_labels: bool = typer.Option(False, "--withhold-labels/--send-labels",
                                               help="Never send labels: score the coordinator's logits on the device."),
          nopeek: float = typer.Option(0.0, min=0.0, help="Privacy: weight of NoPeek's distance correlation "
                                       "between inputs and activations in the client's loss (0 = off)."),
          activation_noise: Optional[str] = typer.Option(None, metavar="CLIP,SIGMA", help="Privacy: clip each "
                                                         "sample's activations to L2 norm CLIP, then add Gaussian "
                                                         "noise of std SIGMA x CLIP before sending."),
          label_protection: Optional[str] = typer.Option(None, metavar="max_norm|SIGMA", help="Privacy, with "
                                                         "--withhold-labels: noise on the logit gradients returned "
                                                         "(max_norm: every sample's expected norm the batch's "
                                                         "largest; SIGMA: std SIGMA x sqrt 2 per sample)."),
          dp_sgd: Optional[str] = typer.Option(None, metavar="CLIP,SIGMA[,DELTA]", help="Privacy: DP-SGD on the "
                                               "client portion: clip each sample's gradient to CLIP, add noise of "
                                               "std SIGMA x CLIP; epsilon at DELTA (default 1e-5) is logged and "
                                               "reported (needs the 'privacy' extra: Opacus)."),
          coordinator_key: Optional[str] = typer.Option(None, "--coordinator-key", envvar="SFL_COORDINATOR_KEY",
                                                        help="Follow only the coordinator with this public key (its "
                                                        "coordinator.pub: the base64 text or the file; `sfl-coord "
                                                        "serve` prints it, `sfl-coord broker-config` issues it with "
                                                        "the devices' credentials). Needed unless --trust-file "
                                                        "already holds the run's key or --trust-first-use."),
          trust_file: Optional[Path] = typer.Option(None, "--trust-file", help="Keep the run's coordinator key "
                                                    "here (JSON, run id -> key): pinned by --trust-first-use, and "
                                                    "followed by every later start."),
          trust_first_use: bool = typer.Option(False, "--trust-first-use", help="Without --coordinator-key: "
                                               "believe the first signed run description seen and pin its key in "
                                               "--trust-file (required with it). "
                                               "Only on a broker that authenticates devices (credentials or a "
                                               "client certificate) and confines them with an ACL: elsewhere "
                                               "anyone could publish the first description."),
          status_file: Optional[Path] = typer.Option(None, "--status-file", help="Where this agent keeps its "
                                                     "status for `sfl-agent status` (default: "
                                                     "~/.local/state/sfl-agent/AGENT_ID.json, or under "
                                                     "$SFL_AGENT_STATE_DIR / systemd's $STATE_DIRECTORY)."),
          model_file: List[Path] = typer.Option([], "--model-file", metavar="PATH", help="A Python file of your own model "
                                                "(the same file as the coordinator's 'model: FILE.py:FUNCTION'); "
                                                "imported only when the run names it. Repeatable."),
          verbose: bool = typer.Option(False, "--verbose/--no-verbose", "-v")) -> None:
    """Join a run: measure, register, train the assigned client portion until the coordinator says stop."""
    from edge_agent.runner import (
        AgentError,
        AgentOptions,
        AgentRunner,
        AgentStopped,
        ContractError,
        DuplicateAgentError,
    )
    from sfl_core.config.run import ConfigError, load_profile
    from sfl_core.data.builtin import DatasetError
    from sfl_core.wire.signing import Trust, TrustError, parse_public

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("sfl.agent").setLevel(logging.INFO)
    if not profile:
        source = f" or 'profile:' in {config}" if config is not None else " (or 'profile:' in a --config file)"
        console.print(f"no device profile: give --profile NAME{source}", style="red", markup=False)
        raise typer.Exit(2)
    try:
        prof = load_profile(profile)
    except ConfigError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    try:
        key = parse_public(coordinator_key, "--coordinator-key") if coordinator_key else None
        trust = Trust(key, trust_file, first_use=trust_first_use)   # an unreadable trust file: found now
    except TrustError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    if slowdown != 1.0 and (not emulate or not slowdown >= 1.0):
        console.print(f"--slowdown {slowdown}: needs --emulate and a factor >= 1", style="red", markup=False)
        raise typer.Exit(2)
    if emulate:
        # emulated compute is paced by the profile, not by this machine; one thread per agent
        # keeps several emulated agents on one host from fighting over the cores
        import torch
        torch.set_num_threads(1)
    try:
        address = address_from_options(broker, ca_file, cert_file, key_file, password_file)
    except ValueError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    try:
        privacy = _privacy(nopeek, activation_noise, withhold_labels, label_protection, dp_sgd)
        if privacy.dp_sgd is not None:
            from sfl_core.privacy import require_accountant
            require_accountant()
    except (ValueError, RuntimeError) as exc:
        console.print(str(exc), style="red", markup=False)
        raise typer.Exit(2)
    problem = trust_problem(trust, run, address)
    if problem:
        tell(problem)
        raise typer.Exit(2)
    name = agent_id or address.username or f"{socket.gethostname().split('.')[0]}-{index}"
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:64]
    runner = AgentRunner(AgentOptions(broker=address, run_id=run, agent_id=name, profile=prof, index=index,
                                      data_root=data, shard_file=str(shard_file) if shard_file else None,
                                      emulate=emulate, slowdown=slowdown, seed=seed, privacy=privacy,
                                      coordinator_key=key, trust_file=str(trust_file) if trust_file else None,
                                      trust_first_use=trust_first_use,
                                      status_file=str(status_file) if status_file else None,
                                      model_files=tuple(str(f) for f in model_file)))

    def on_signal(signum, frame):
        runner.stop()   # raises AgentStopped here, in the main thread, wherever it waits

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    live = None
    if console.is_terminal:   # a person watching: a live line of the round's steps, the log above it
        from rich.logging import RichHandler

        from edge_agent.status import TerminalProgress
        root = logging.getLogger()
        root.handlers = [RichHandler(console=console, show_path=False, markup=False)]
        live = TerminalProgress(console).__enter__()
        runner.o.progress = live.show
    try:
        try:
            code = runner.run()
        finally:
            if live is not None:
                live.__exit__(None, None, None)
    except AgentStopped:   # a service manager's stop: a clean exit, not a failure to restart from
        tell(f"agent {name}: stopped by a signal", style="yellow")
        code = 0
    except DuplicateAgentError as exc:   # exit 2: a service manager must not restart into the same conflict
        tell(f"agent {name}: {exc}")
        raise typer.Exit(2)
    except (DatasetError, ContractError) as exc:   # exit 2: fixed by a person (data, model), not a restart
        tell(f"agent {name}: {exc}")
        raise typer.Exit(2)
    except (AgentError, ConnectionError, ValueError) as exc:
        tell(f"agent {name}: {exc}")
        raise typer.Exit(1)
    raise typer.Exit(code)


@app.command("check-data")
def check_data(config: Optional[Path] = typer.Option(None, "--config", "-c", help="The agent's settings file "
                                                     "(what `start --config` reads): its data and model_file."),
               data: Optional[str] = typer.Option(None, "--data", help="The device's data (default: 'data' in "
                                                  "--config)."),
               run_config: Optional[Path] = typer.Option(None, "--run-config", "-r", help="The run's config: check "
                                                         "the data against its task (class names, input shape, "
                                                         "preprocessing) and that its model builds here."),
               model_file: List[Path] = typer.Option([], "--model-file", metavar="PATH",
                                                      help="Your model's file (default: 'model_file' in --config)."),
               fmt: str = typer.Option("text", "--format", help="text | json")) -> None:
    """Load this device's data exactly as `start` would and say what it holds and whether it fits the run.

    Exit status 0: it fits (or, without --run-config, it was read); 2: it does not, with one line saying why."""
    import json as json_mod

    from edge_agent.own_data import describe, load_for_task
    from sfl_core.config.run import ConfigError
    from sfl_core.data.builtin import DatasetError
    from sfl_core.data.local import survey

    logging.getLogger("sfl.agent").setLevel(logging.ERROR)   # the report below says it all, once
    if fmt not in ("text", "json"):
        tell(f"--format {fmt}: expected text or json")
        raise typer.Exit(2)
    settings = _start_settings(config)
    path = data or settings.get("data")
    files = [str(f) for f in model_file] or list(settings.get("model_file") or [])
    if not path:
        tell("no data: give --data PATH or 'data:' in the --config file")
        raise typer.Exit(2)
    report: dict = {"data": path}
    try:
        if run_config is None:
            report.update(survey(path))
            report["fits"] = None
        else:
            from edge_agent.run_model import device_model, run_config_for_device
            cfg, body = run_config_for_device(run_config, files)   # the model as start resolves it
            if cfg.task is None:
                raise ConfigError(f"{run_config}: has no 'task' section: its agents train on shards of "
                                  f"{cfg.data.dataset}, not on their own data")
            lines = device_model({**body, "input_shape": list(cfg.task.input_shape),
                                  "num_classes": cfg.task.num_classes}, files)
            report["model"] = {"name": cfg.model, "tensors": len(lines)}
            own = load_for_task(path, cfg.task, cfg.data.bad_files)
            report.update(own.summary(cfg.task))
            report["label_counts"] = own.train.label_counts(cfg.task.num_classes)
            report["line"] = describe(own, cfg.task)
            report["fits"] = True
    except (DatasetError, ConfigError, ValueError) as exc:
        report.update(fits=False, error=str(exc))
    if fmt == "json":
        print(json_mod.dumps(report, indent=1))
    else:
        _print_check(report)
    raise typer.Exit(2 if report["fits"] is False else 0)


@app.command()
def status(config: Optional[Path] = typer.Option(None, "--config", "-c", help="The agent's settings file (what "
                                                 "`start --config` reads): its status_file and agent_id."),
           status_file: Optional[Path] = typer.Option(None, "--status-file", help="The status file `start` keeps "
                                                      "(default: the one of --agent-id, or of every agent here)."),
           agent_id: Optional[str] = typer.Option(None, "--agent-id", help="Whose status (default: every agent "
                                                  "whose status file is in the default place)."),
           fmt: str = typer.Option("text", "--format", help="text | json")) -> None:
    """What an agent on this device is doing: its state and round, and its last round (split,
    batch, steps, loss, bytes, seconds). Exit status 2 when there is no status to show."""
    import json as json_mod

    from edge_agent.status import default_status_file, describe, read_status

    if fmt not in ("text", "json"):
        tell(f"--format {fmt}: expected text or json")
        raise typer.Exit(2)
    settings = _start_settings(config)
    chosen = status_file or settings.get("status_file")
    name = agent_id or settings.get("agent_id")
    if chosen:
        paths = [Path(chosen)]
    elif name:
        paths = [default_status_file(name)]
    else:
        paths = sorted(default_status_file("x").parent.glob("*.json"))
        if not paths:
            tell(f"no agent status in {default_status_file('x').parent} (give --status-file or --config)")
            raise typer.Exit(2)
    docs = []
    for path in paths:
        try:
            docs.append(read_status(path))
        except ValueError as exc:
            tell(str(exc))
            raise typer.Exit(2)
    if fmt == "json":
        print(json_mod.dumps(docs if len(docs) > 1 else docs[0], indent=1))
        return
    for doc in docs:
        for line in describe(doc):
            print(line)   # standard output: what a script reads


def _print_check(report: dict) -> None:
    if report.get("error"):
        tell(f"{report['data']}: does not fit the run: {report['error']}")
        return
    if report["fits"] is None:
        console.print(f"{report['data']} ({report['kind']}):", markup=False, highlight=False, soft_wrap=True)
        for line in report["lines"]:
            console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
        console.print("give --run-config run.yaml to check it against a run's task", style="dim", markup=False)
        return
    console.print(report["line"], markup=False, highlight=False, soft_wrap=True)
    console.print(f"input shape {tuple(report['input_shape'])}; label counts it would register: "
                  f"{report['label_counts']}", markup=False, highlight=False, soft_wrap=True)
    for f in report["skipped_files"]:
        console.print(f"  skipped {f}", style="yellow", markup=False, highlight=False, soft_wrap=True)
    console.print(f"fits the run (model {report['model']['name']}, {report['model']['tensors']} tensors)",
                  style="green", markup=False, highlight=False)
