"""``sfl-agent``: run an edge agent against a coordinator, or measure this device."""

from __future__ import annotations

import logging
import signal
import socket
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from sfl_core.accounting import model_costs
from sfl_core.config import ConfigError, load_profile
from sfl_core.data import DatasetError
from sfl_core.models import MODEL_NAMES, build_model

from edge_agent.profiler import measure_compute

app = typer.Typer(help="Split federated learning edge agent.", no_args_is_help=True, add_completion=False)
console = Console(stderr=True)


@app.command()
def start(profile: str = typer.Option(..., "--profile", "-p", help="Device profile: a name from profiles/devices/ or a YAML path."),
          broker: str = typer.Option("mqtt://127.0.0.1:1883", help="MQTT broker URL (mqtt:// or mqtts://, user:pass@ allowed)."),
          run: str = typer.Option("demo", "--run", help="Run id announced by the coordinator."),
          data: Optional[str] = typer.Option(None, "--data", help="Directory of the run's data set (not needed for 'digits')."),
          index: int = typer.Option(0, help="This agent's shard index in the run's partition."),
          shard_file: Optional[Path] = typer.Option(None, help="JSON/.npy file of training-set indices (instead of --index)."),
          agent_id: Optional[str] = typer.Option(None, help="Default: <hostname>-<index>."),
          emulate: bool = typer.Option(False, "--emulate", help="Stretch compute and throttle the link to the profile's device."),
          seed: int = typer.Option(0),
          withhold_labels: bool = typer.Option(False, "--withhold-labels",
                                               help="Never send labels: score the coordinator's logits on the device."),
          verbose: bool = typer.Option(False, "--verbose", "-v")) -> None:
    """Join a run: measure, register, train the assigned client portion until the coordinator says stop."""
    from edge_agent.runner import AgentError, AgentOptions, AgentRunner

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("sfl.agent").setLevel(logging.INFO)
    try:
        prof = load_profile(profile)
    except ConfigError as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(2)
    if emulate:
        # emulated compute is paced by the profile, not by this machine; one thread per agent
        # keeps several emulated agents on one host from fighting over the cores
        import torch
        torch.set_num_threads(1)
    name = agent_id or f"{socket.gethostname().split('.')[0]}-{index}"
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:64]
    runner = AgentRunner(AgentOptions(broker=broker, run_id=run, agent_id=name, profile=prof, index=index,
                                      data_root=data, shard_file=str(shard_file) if shard_file else None,
                                      emulate=emulate, seed=seed, withhold_labels=withhold_labels))
    signal.signal(signal.SIGTERM, lambda *_: runner.stop())
    try:
        code = runner.run()
    except (AgentError, DatasetError, ConnectionError, ValueError) as exc:
        console.print(f"[red]agent {name}: {exc}")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        code = 130
    raise typer.Exit(code)


@app.command()
def profile(model: str = typer.Option("small_cnn", help=f"One of {', '.join(MODEL_NAMES)}."),
            input_shape: str = typer.Option("1,28,28", help="Per-sample input shape."),
            classes: int = typer.Option(10),
            batch_size: int = typer.Option(16)) -> None:
    """Time forward+backward of every client portion on this device (what `start` reports at registration)."""
    shape = tuple(int(v) for v in input_shape.split(","))
    m = build_model(model, shape, classes)
    costs = model_costs(model, shape, classes)
    splits = list(m.split_points)
    secs = measure_compute(m, splits, {s: costs[s].client_flops for s in splits}, batch_size=batch_size)
    console.print(f"{model} {shape}: seconds per sample (fwd+bwd of the client portion)")
    for s in splits:
        gflops = costs[s].client_flops / secs[s] / 1e9 if secs[s] > 0 else float("inf")
        console.print(f"  split {s:>2} ({m.block_names[s - 1]:>8}): {secs[s] * 1e3:8.3f} ms/sample  ~{gflops:.2f} GFLOP/s")


if __name__ == "__main__":
    app()
