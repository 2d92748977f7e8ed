"""``sfl-coord status``, ``dashboard``, ``export`` and ``broker-config``: a run's operator's tools."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from cli.coord.app import app, console, tell, web_access
from coordinator import state as ckpt
from coordinator.console import assignment_lines, print_table, status_table


@app.command()
def status(run_dir: Path = typer.Argument(..., help="A run's output directory, e.g. runs/demo."),
           fmt: str = typer.Option("table", "--format", help="table (fits 80 columns) or json (for scripts: "
                                   "every metric of every round and the checkpoint state).")) -> None:
    """Print a run's per-round metrics, its checkpoint state and its last round's assignments
    (split, batch, width, codec, window), each with the agents given it."""
    if fmt not in ("table", "json"):
        tell(f"--format: expected table or json, got {fmt!r}")
        raise typer.Exit(2)
    try:
        metrics = ckpt.read_metrics(run_dir)
    except ckpt.CheckpointError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    if not metrics:
        tell(f"no metrics in {run_dir}")
        raise typer.Exit(1)
    st = None
    if (run_dir / ckpt.MODEL_FILE).exists():
        try:
            st = ckpt.load_state(run_dir)
        except ckpt.CheckpointError as exc:
            tell(f"checkpoint unreadable: {exc}", style="yellow")
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
        phase = f" ({last['phase']})" if last.get("phase") else ""
        out.print(f"round {last['round']}{phase}, each assignment and the agents given it:", highlight=False)
        for line in assignment_lines(last["agents"]):
            out.print(f"  {line}", highlight=False, markup=False)
        if len(last.get("groups") or ()) > 1:
            out.print("groups: " + "; ".join(", ".join(g) for g in last["groups"]), highlight=False, markup=False)


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
        tell(f"{run_dir}: not a directory (a run's output directory, e.g. runs/demo)")
        raise typer.Exit(2)
    access = web_access(token, tls_cert, tls_key, insecure,
                        flags=("--token or SFL_DASHBOARD_TOKEN", "--tls-cert", "--tls-key", "--insecure"))
    try:
        page = start_dashboard(listen, run_dir, access=access)
    except WebError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    host = listen.rpartition(":")[0] or "127.0.0.1"
    tell(f"fleet page of {run_dir}: {'https' if access.tls else 'http'}://{host}:{page.port}/"
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
    from sfl_core.model.onnx_export import OnnxError

    try:
        meta = export_run(run_dir, onnx, split=split, config=config)
    except (ExportError, OnnxError) as exc:   # OnnxError: the exporter's, e.g. the onnx package missing
        tell(str(exc))
        raise typer.Exit(2)
    what = "whole model" if meta["split"] is None else f"client portion, split {meta['split']}"
    console.print(f"wrote {onnx} ({onnx.stat().st_size / 1e6:.2f} MB): {meta['model']} ({what}) after round "
                  f"{meta.get('round')}, input (N, {', '.join(map(str, meta['input_shape']))}) -> "
                  f"(N, {', '.join(map(str, meta['output_shape']))}) {meta['output']}, opset {meta['opset']}")
    console.print(f"sidecar: {onnx.with_suffix('.json')}")


@app.command()
def key(where: Path = typer.Argument(..., help="A run's output directory (e.g. runs/photos: its coordinator.key) "
                                    "or a key file (e.g. /etc/sfl/coordinator.key).")) -> None:
    """Create (or show) a coordinator's signing key ahead of `serve`, and print its public half:
    what each agent follows (`sfl-agent start --coordinator-key`)."""
    from sfl_core.wire.signing import KEY_FILE, Signer, TrustError, public_text

    path = where / KEY_FILE if where.is_dir() or not where.suffix else where
    try:
        signer = Signer.load_or_create(path)
    except (TrustError, OSError) as exc:
        tell(str(exc))
        raise typer.Exit(2)
    console.print(f"{public_text(signer.public)}  (private: {path}; public: {path.with_suffix('.pub')})",
                  markup=False, highlight=False, soft_wrap=True)


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
                                                     "with the coordinator's rights and password."),
                  signing_key: Optional[Path] = typer.Option(None, "--signing-key", help="The coordinator's signing "
                                                             "key (created if missing; default OUT/coordinator.key): "
                                                             "its public half goes to credentials/coordinator.pub, "
                                                             "for every device to follow.")) -> None:
    """Write a Mosquitto configuration: TLS listener, one user per device, an ACL that confines each
    agent to its own topics (`mosquitto -c OUT/mosquitto.conf`)."""
    from coordinator.broker_config import BrokerTls, write_broker_config

    names = list(agent)
    if agents_file is not None:
        names += [ln.strip() for ln in agents_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if bool(tls_cert) != bool(tls_key):
        tell("--tls-cert and --tls-key go together")
        raise typer.Exit(2)
    if client_certs and not (tls_cert and tls_ca):
        tell("--client-certs needs --tls-cert, --tls-key and --tls-ca")
        raise typer.Exit(2)
    tls = BrokerTls(str(tls_cert.resolve()), str(tls_key.resolve()), str(tls_ca.resolve()) if tls_ca else None,
                    client_certs) if tls_cert and tls_key else None
    port = port or (8883 if tls else 1883)
    try:
        files = write_broker_config(out, names, coordinator_user=coordinator_user, port=port, bind=bind, tls=tls,
                                    persistence_dir=persistence_dir, server_workers=server_workers)
    except ValueError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    from sfl_core.wire.signing import KEY_FILE, PUBLIC_FILE, Signer, TrustError, public_text

    signing_key = signing_key or out / KEY_FILE
    try:
        signer = Signer.load_or_create(signing_key)
    except (TrustError, OSError) as exc:
        tell(str(exc))
        raise typer.Exit(2)
    (out / "credentials").mkdir(parents=True, exist_ok=True)
    (out / "credentials" / PUBLIC_FILE).write_text(public_text(signer.public) + "\n")
    scheme = "mqtts" if tls else "mqtt"
    if tls is None:
        tell("no --tls-cert/--tls-key: passwords would cross the network in clear text; "
             "use this only on a trusted network", style="yellow")
    console.print(f"wrote {files.conf}, {files.acl}" + (f", {files.passwd}" if files.passwd else ""))
    if files.credentials:
        console.print(f"credentials (hand each device its own file, mode 0600): {out / 'credentials'}/<user>.password")
    console.print(f"start the broker:  mosquitto -c {files.conf}")
    console.print(f"coordinator key:   {signing_key} (hand each device {out / 'credentials' / PUBLIC_FILE})")
    console.print(f"coordinator:       sfl-coord serve -c RUN.yaml --broker {scheme}://{coordinator_user}@HOST:{port}"
                  + (" --ca-file CA.crt" if tls else "") + (f" --password-file {coordinator_user}.password"
                                                              if files.credentials else "")
                  + f" --signing-key {signing_key}")
    console.print(f"each agent:        sfl-agent start --broker {scheme}://AGENT@HOST:{port}"
                  + (" --ca-file CA.crt" if tls else "")
                  + (" --password-file AGENT.password" if files.credentials else " --cert-file AGENT.crt --key-file AGENT.key")
                  + " --coordinator-key coordinator.pub --profile P --run R --index I")
