"""The ``sfl-agent`` application and what its commands share.

Nothing here imports torch: ``sfl-agent predict`` runs on a board without it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from sfl_core.console import say
from sfl_core.version import version_option  # standard library and typer only, no torch

# torch-using modules (sfl_core.model.zoo, .data, .config via .wire, edge_agent.profiler) are imported
# inside the commands that need them: `sfl-agent predict` must run on a board without torch


app = typer.Typer(help="Split federated learning edge agent.", no_args_is_help=True, add_completion=False,
                  rich_markup_mode=None)


console = Console(stderr=True)


def tell(text: str, style: str = "red") -> None:
    say(console, text, style)


@app.callback()
def _main(version: Optional[bool] = version_option("sfl-agent")) -> None:
    pass


def use_config_file(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Path]) -> Optional[Path]:
    """``start --config``: the file's settings become defaults that flags override (edge_agent.settings)."""
    if value is None:
        return value
    from edge_agent.settings import use_config_file  # imports sfl_core.config.run (torch): only when used

    # 'data' is a directory and 'profile' a name or a YAML path: relative ones are relative to the file
    return use_config_file(ctx, param, value, path_options={"data", "trust_file", "model_file", "status_file"},
                            maybe_path_options={"profile"})   # coordinator_key: base64 has '/', never resolved
