"""``sfl-coord models``, ``plan`` and ``profiles``: what a run would do, before any training."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from cli.coord.app import app, checked_parts, console, label_counts, load_config, shape_and_classes, tell
from sfl_core.config.run import ConfigError, default_profiles_dir, list_profiles, load_run_config
from sfl_core.data.builtin import DatasetError
from sfl_core.methods import build_method
from sfl_core.model.accounting import format_cost_table, model_costs
from sfl_core.model.zoo import build_model, model_names


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


def _models_for_run(config: Path) -> None:
    """The run's model, one row per cut with the round it would take on the run's fleet."""
    from sfl_core.config.run import load_profile
    from sfl_core.model.accounting import split_note
    from sfl_core.timing import fleet_round_time

    try:
        cfg = load_run_config(config)
    except ConfigError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    shape, classes = shape_and_classes(cfg)
    m = build_model(cfg.model, shape, classes)
    costs = model_costs(cfg.model, shape, classes)
    profiles = [load_profile(p) for p in dict.fromkeys(cfg.agent_profiles())]
    samples = cfg.batch_size * cfg.local_iters

    times = {s: fleet_round_time(cfg, costs[s], profiles) for s in sorted(costs) if s < m.num_blocks}
    fastest = min(times, key=lambda s: times[s])
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
        tell(note, style="yellow")


@app.command()
def plan(config: Path = typer.Option(..., "--config", "-c", help="Run config YAML."),
         json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the comparison as JSON here."),
         data: Optional[Path] = typer.Option(None, help="Override data.root (for the label counts).")) -> None:
    """Before any training: each method's predicted round time, bytes and waiting time on this fleet,
    and the default method's (auto's) assignment per agent (time model from the device profiles;
    a run refines it)."""
    import json

    from sfl_core.fleet import fleet_of
    from sfl_core.method_registry import DEFAULT_STRATEGY, method_classes
    from sfl_core.methods.preview import preview

    cfg = load_config(config, None, None, data)
    parts = checked_parts(cfg, config)   # settings only the model can judge, before any table
    try:
        counts = label_counts(cfg)
    except DatasetError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    n = cfg.num_agents
    shape, classes = shape_and_classes(cfg)
    model = build_model(cfg.model, shape, classes)
    costs = model_costs(cfg.model, shape, classes)
    agents = fleet_of(cfg, counts)
    rows = preview(cfg, model, costs, agents)
    ref = next((r for r in rows if r.strategy == DEFAULT_STRATEGY), rows[0])   # the default method
    per_round = cfg.per_round or n
    table = Table(title=f"{cfg.run_id}: {cfg.model}, {n} agents, {per_round} per round, "
                        f"{cfg.local_iters} steps of batch {cfg.batch_size} (predicted by the time model)")
    phases = any(r.phase_s for r in rows)   # a training option's phase after aggregation (a statistics pass)
    for col in ("method", "round s", f"vs {ref.method}", "MB per round", "waiting s") + (("of which phases s",)
                                                                                        if phases else ()):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        table.add_row(r.method, f"{r.round_s:.3g}", f"{r.round_s / ref.round_s:.2f}x" if ref.round_s else "-",
                      f"{r.bytes_per_round / 1e6:.3g}", f"{r.waiting_s:.3g}",
                      *((f"{r.phase_s:.3g}",) if phases else ()))
    Console().print(table)
    for method in method_classes():     # what each method has to say about its plan
        for text, style in getattr(method, "plan_notes", lambda *_: [])(cfg, model, costs, rows):
            tell(text, style)
    for line in parts.method.learning(1, agents, [])[1]:   # the training options the run's method decides
        tell(line, "cyan")
    names = {a: info.profile.name for a, info in agents.items()}
    detail = Table(title=f"{ref.method}'s assignment (first round)")
    for col in ("agent", "profile", "split", "codec", "batch", "round s"):
        detail.add_column(col)
    for a, x in sorted(ref.agents.items()):
        whole = x.split == model.num_blocks
        codec = "-" if whole else f"{x.codec}, width {x.width}" if x.width else x.codec
        codec += f", window {x.window}" if x.window > 1 else ""
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
    # in the units a datasheet and iperf3 give, in 80 columns; never cut (a name is what --profile takes)
    table = Table(title=f"device profiles ({root / 'devices'})", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("name", "GFLOP/s", "up Mb/s", "down Mb/s", "latency", "duplex", "memory"):
        table.add_column(col, no_wrap=True, justify="left" if col == "name" else "right")
    for name in list_profiles():
        p = load_profile(name)
        # half duplex (WiFi): steps in flight cannot overlap uploads with downloads (docs/methods/pipeline.md)
        table.add_row(name, f"{p.compute_flops / 1e9:.3g}", f"{p.link_bytes_per_s * 8 / 1e6:.3g}",
                      f"{p.downlink * 8 / 1e6:.3g}", f"{p.latency_s * 1e3:g} ms", "half" if p.half_duplex else "full",
                      "-" if p.memory_bytes is None else f"{p.memory_bytes / 2**30:.3g} GiB")
    console.print(table)
    runs = sorted(p.name for p in (root / "runs").glob("*.y*ml")) if (root / "runs").is_dir() else []
    console.print(f"run configs ({root / 'runs'}): {', '.join(runs) or 'none'}", markup=False, highlight=False)
