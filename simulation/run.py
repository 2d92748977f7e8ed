"""A run of the real round engine with simulated devices (``sfl-coord simulate``).

The coordinator's engine, unchanged; the agents are the edge agent's own training code, run in
this process (:mod:`simulation.inprocess`) or in Ray actors (:mod:`simulation.ray_fleet`), and
time follows the time model (:class:`simulation.clock.VirtualClock`). This package sits above
both ``coordinator`` and ``edge_agent``, which never import each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from rich.console import Console

from coordinator.api import (
    Resume,
    RunError,
    lock_run,
    read_checkpoint,
    run_dataset,
    set_aside_earlier_run,
)
from coordinator.console import RunDisplay
from coordinator.engine import RoundEngine
from coordinator.run_parts import RunParts
from coordinator.server_trainer import pick_device
from coordinator.transport import Transport
from sfl_core.config.run import RunConfig
from sfl_core.data.builtin import Dataset, DatasetError
from simulation.adversary import Attack
from simulation.clock import VirtualClock
from simulation.inprocess import build_fleet


def run_simulation(cfg: RunConfig, *, resume: Resume = False, device: str = "auto", quiet: bool = True,
                   console: Optional[Console] = None, ray: Optional[str] = None,
                   ray_workers: Optional[int] = None, parts: Optional[RunParts] = None,
                   attacks: Optional[Mapping[str, Attack]] = None) -> tuple[list[dict], RoundEngine]:
    """The same engine as :func:`coordinator.api.serve`, with in-process agents and a virtual clock: real
    training on real data, times from the device profiles and the real encoded bytes.

    ``ray``: place the agents in Ray actors instead, ``"local"`` for a Ray started here, else
    a cluster address (``ray_workers`` actors, default one per CPU); same results, in parallel.
    ``attacks``: agents (``sim-000``...) that lie, and how (:mod:`simulation.adversary`; in process only).
    ``parts``: the model and method the caller built while checking the config."""
    console = console or Console(stderr=True)
    data = run_dataset(cfg)
    out = cfg.resolved_output_dir
    lock = lock_run(out, cfg.run_id)
    try:
        checkpoint = read_checkpoint(out, resume)
        return _simulate(cfg, data, out, checkpoint, device, quiet, console, ray, ray_workers, parts, attacks)
    finally:
        lock.release()


def _simulate(cfg: RunConfig, data: Dataset, out: Path, checkpoint: Optional[tuple[dict, dict]], device: str,
              quiet: bool, console: Console, ray: Optional[str],
              ray_workers: Optional[int], parts: Optional[RunParts] = None,
              attacks: Optional[Mapping[str, Attack]] = None) -> tuple[list[dict], RoundEngine]:
    if checkpoint is None:
        set_aside_earlier_run(out, console)
    dev = pick_device(device)
    if ray is not None:
        if attacks:
            raise RunError("attacks are simulated in process, not in Ray actors")
        from simulation.ray_fleet import build_ray_fleet
        try:
            transport: Transport = build_ray_fleet(cfg, data, None if ray == "local" else ray, ray_workers)
        except RuntimeError as exc:
            raise RunError(str(exc)) from exc
    else:
        try:
            transport = build_fleet(cfg, data, dev, attacks)
        except DatasetError as exc:
            raise RunError(str(exc)) from None
    if cfg.task is not None and not quiet:   # which simulated device read which folder
        for i, (profile, path) in enumerate(zip(cfg.agent_profiles(), cfg.agent_data())):
            console.print(f"sim-{i:03d} ({profile}): {path}", markup=False, highlight=False, soft_wrap=True)
    try:
        with RunDisplay(cfg.rounds, console=console, quiet=quiet) as display:
            engine = RoundEngine(cfg, transport, VirtualClock(), (data.x_test, data.y_test),
                                 input_shape=data.input_shape, num_classes=data.num_classes, out_dir=out,
                                 device=dev, on_event=display, checkpoint=checkpoint,
                                 preprocessing=data.preprocessing, parts=parts)
            history = engine.run()
    finally:
        close = getattr(transport, "close", None)
        if close is not None:
            close()
    return history, engine
