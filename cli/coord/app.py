"""The ``sfl-coord`` application and what its commands share: loading a run config into one
line per problem (exit status 2), logging, the web access options."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from typer.core import TyperGroup

from sfl_core.config.run import ConfigError, RunConfig, default_profiles_dir, load_run_config
from sfl_core.console import say
from sfl_core.data.builtin import DatasetError, load_dataset
from sfl_core.version import version_option

if TYPE_CHECKING:
    from coordinator.run_parts import RunParts
    from coordinator.web import WebAccess


class _Commands(TyperGroup):
    """``--resume`` alone means resume, ``--resume auto`` resume-or-start: click has no option
    that takes a value only sometimes, so the one token is rewritten before parsing."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]
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


@app.callback()
def _main(version: Optional[bool] = version_option("sfl-coord")) -> None:
    pass


def tell(text: str, style: str = "red") -> None:
    say(console, text, style)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_config_path(config: Path) -> Path:
    """A run config file, or the name of a shipped one (``demo``, ``s2fl-demo``: what
    ``sfl-coord profiles`` lists), so an installed wheel runs them from any directory."""
    if config.exists() or config.parent != Path(".") :
        return config
    for candidate in (default_profiles_dir() / "runs" / config.name,
                      default_profiles_dir() / "runs" / f"{config.name}.yaml"):
        if candidate.is_file():
            return candidate
    return config


def load_config(config: Path, rounds: Optional[int], output: Optional[Path], data: Optional[Path] = None) -> RunConfig:
    config = run_config_path(config)
    try:
        cfg = load_run_config(config)
    except ConfigError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    if rounds is not None:
        cfg = dataclasses.replace(cfg, rounds=rounds)
    if output is not None:
        cfg = dataclasses.replace(cfg, output_dir=str(output))
    if data is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, root=str(data)))
    if cfg.task is None:
        try:    # read the data set now, so a wrong path names where it came from (cached for the run)
            load_dataset(cfg.data.dataset, cfg.data.root, cfg.data.image_size)
        except DatasetError as exc:
            field = "data.image_size" if str(exc).startswith("image_size") else "data.root"
            where = "--data" if data is not None and field == "data.root" else f"{config}: field '{field}'"
            tell(f"{where}: {exc}")
            raise typer.Exit(2)
    return cfg


def checked_parts(cfg: RunConfig, config: Path) -> "RunParts":
    """The run's model and method, built once here and handed to the engine; settings only the
    model can judge (a cut it lacks, a bottleneck wider than the cut) exit 2 with one line."""
    from coordinator.run_parts import build_parts

    shape, classes = shape_and_classes(cfg)
    try:
        return build_parts(cfg, shape, classes)
    except ValueError as exc:
        tell(f"{run_config_path(config)}: {exc}")
        raise typer.Exit(2)


def shape_and_classes(cfg: "RunConfig") -> tuple[tuple[int, ...], int]:
    """The per-sample input shape and class count of a run, without loading any data."""
    from sfl_core.data.builtin import input_shape_of

    if cfg.task is not None:
        return tuple(cfg.task.input_shape), cfg.task.num_classes
    return input_shape_of(cfg.data.dataset, cfg.data.image_size), 10


def label_counts(cfg: "RunConfig") -> list[list[int]]:
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


SERVE_WEB_FLAGS = ("--dashboard-token or SFL_DASHBOARD_TOKEN", "--web-tls-cert", "--web-tls-key", "--insecure-web")
"""How ``serve`` names the page's token, certificate, key and insecure switch (``dashboard``: its own)."""


def web_access(token: Optional[str], cert: Optional[Path], key: Optional[Path], insecure: bool,
               flags: tuple[str, str, str, str] = SERVE_WEB_FLAGS) -> "WebAccess":
    """Who may reach the page and the metrics; refusals name the command's own ``flags``."""
    from coordinator.web import WebAccess

    if bool(cert) != bool(key):
        tell(f"{flags[1]} and {flags[2]} go together")
        raise typer.Exit(2)
    return WebAccess(token=token, tls=(str(cert), str(key)) if cert and key else None, insecure=insecure,
                     flags=flags)


DATA_OPTION = typer.Option(None, "--data", help="Directory of the run's data set; overrides the config's "
                           "data.root (not needed for 'digits').")
