"""``sfl-coord agents list`` and ``readmit``: the agents a run knows, and readmitting a
quarantined one (``robust.quarantine``, docs/methods/robust.md)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from cli.coord.app import app, console, tell
from coordinator import state as ckpt

agents = typer.Typer(help="A run's agents: list them, readmit a quarantined one.", no_args_is_help=True,
                     add_completion=False, rich_markup_mode=None)
app.add_typer(agents, name="agents")

RUN_DIR = typer.Argument(..., help="A run's output directory, e.g. runs/demo.")


def _registry(run_dir: Path) -> dict:
    import json

    if not run_dir.is_dir():
        tell(f"{run_dir}: not a directory (a run's output directory, e.g. runs/demo)")
        raise typer.Exit(2)
    try:
        st = ckpt.load_state(run_dir)
    except ckpt.CheckpointError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    reg = st.get("registry") or {}
    return json.loads(reg) if isinstance(reg, str) else reg


@agents.command("list")
def list_agents(run_dir: Path = RUN_DIR) -> None:
    """Every agent of the run's last checkpoint: rounds trained, and why it is quarantined, if it is."""
    from coordinator.readmission import READMIT_DIR

    reg = _registry(run_dir)
    pending = {p.name for p in (run_dir / READMIT_DIR).iterdir()} if (run_dir / READMIT_DIR).is_dir() else set()
    out = Console()
    for a, info in sorted(reg.items()):
        why = info.get("quarantined") or ""
        state = (f"quarantined: {why}" + (" (readmission requested)" if a in pending else "")) if why else "selectable"
        out.print(f"{a}  rounds {info.get('rounds', 0)}  {state}", markup=False, highlight=False, soft_wrap=True)
    quarantined = sum(bool(i.get("quarantined")) for i in reg.values())
    out.print(f"{len(reg)} agent(s), {quarantined} quarantined", markup=False, highlight=False)


@agents.command("readmit")
def readmit(run_dir: Path = RUN_DIR,
            agent_id: str = typer.Argument(..., help="The agent to readmit, as `agents list` names it.")) -> None:
    """Readmit a quarantined agent: the coordinator serving the run selects it again from its next
    round (a run not serving, when it is resumed)."""
    from coordinator.readmission import request_readmission
    from sfl_core.wire.codec import WireError

    reg = _registry(run_dir)
    if agent_id not in reg:
        tell(f"{run_dir}: no agent {agent_id!r} in the run's checkpoint")
        raise typer.Exit(2)
    if not reg[agent_id].get("quarantined"):
        tell(f"{agent_id} is not quarantined (in the last checkpoint); nothing to do", style="yellow")
        raise typer.Exit(0)
    try:
        path = request_readmission(run_dir, agent_id)
    except (WireError, OSError) as exc:
        tell(str(exc))
        raise typer.Exit(2)
    console.print(f"readmission of {agent_id} requested ({path}); the coordinator applies it before its next round",
                  markup=False, highlight=False, soft_wrap=True)
