"""Terminal display of a run: progress while it trains, a summary table when it ends."""

from __future__ import annotations

from typing import Any, Optional

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TaskID
from rich.table import Table

from coordinator.registry import Registry
from sfl_core.fleet import AgentInfo


class RunDisplay:
    """Turns engine events into a progress bar and one line per round."""

    def __init__(self, total_rounds: int, *, console: Optional[Console] = None, quiet: bool = False):
        self.console = console or Console(stderr=True)
        self.quiet = quiet
        self.total = total_rounds
        self._progress: Optional[Progress] = None
        self._task: Optional[TaskID] = None

    def __enter__(self) -> "RunDisplay":
        if not self.quiet:
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                      console=self.console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task("rounds", total=self.total, status="waiting for agents")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, event: str, data: dict[str, Any]) -> None:
        if event == "notice" and not self.quiet:
            self.console.print(data["text"], style="yellow", markup=False, highlight=False, soft_wrap=True)
        if self._progress is None:
            return
        p, t = self._progress, self._task
        if t is None:
            return
        if event == "waiting":
            p.update(t, status=f"waiting for agents: {data['registered']}/{data['needed']}")
        elif event == "registered":
            p.update(t, status=f"agent {data['agent']} registered ({data['online']} online)")
        elif event == "round_start":
            phase = f" ({data['phase']})" if data.get("phase") else ""
            p.update(t, status=f"round {data['round']}: {len(data['agents'])} agents{phase}")
        elif event == "step":
            p.update(t, status=f"round {data['round']} step {data['step']}/{data['of']} loss {data['loss']:.3f}")
        elif event == "agent_dropped":
            p.console.print(f"dropped {data['agent']}: {data['reason']}", style="yellow", markup=False, soft_wrap=True)
        elif event == "round_end":
            p.advance(t)
            p.console.print(f"round {data['round']:>3}  acc {_num(data['accuracy'], 4)}  loss "
                            f"{_num(data['test_loss'], 3)}  {_federated(data)}"
                            f"{len(data.get('completed') or [])}/{len(data.get('selected') or [])} agents  "
                            f"{data['round_time_s']:.2f} s {data['clock']}  up {_mb(data['bytes_up'])} "
                            f"down {_mb(data['bytes_down'])}", soft_wrap=True)
            p.update(t, status=f"accuracy {_num(data['accuracy'], 3)}")


def _num(v: Optional[float], digits: int) -> str:
    """A metric, or '-' where the run does not measure it (no server validation data)."""
    return "-" if v is None else f"{v:.{digits}f}"


def _federated(record: dict[str, Any]) -> str:
    """The devices' held-out accuracy (federated evaluation), where the round measured it."""
    fed = record.get("federated")
    if not fed or fed.get("accuracy") is None:
        return ""
    return f"devices' acc {fed['accuracy']:.4f} ({fed['count']} held out)  "


def print_table(console: Console, table: Table) -> None:
    """A table on a terminal fits the terminal; piped to a file or a CI log (no terminal, where
    rich assumes 80 columns) it is as wide as its content, so no cell is cut to 'agent…'."""
    if console.is_terminal:
        console.print(table)
        return
    from rich.measure import Measurement
    wide = console.options.update(max_width=1000)
    width = Measurement.get(console, wide, table).maximum
    # Console.print caps its width at the console's: a console of the table's width prints it
    Console(file=console.file, width=max(width, 20), color_system=None).print(table)


SUMMARY_ROWS = 50
"""Agents the summary lists one by one; a larger fleet is summed per profile (10,000 rows would
take a terminal many seconds to lay out, and no one reads them)."""


def summary_table(history: list[dict[str, Any]], registry: Registry) -> Table:
    """Accuracy, time and bytes: the numbers a user compares runs by. Per-agent seconds come
    from the run's clock: measured in a deployment, the time model's in a simulation (never the
    simulating host's, which says nothing about the devices). Up to :data:`SUMMARY_ROWS` agents,
    one row each; a larger fleet, one row per profile with its agents' totals summed."""
    title, clock = "run summary", "wall"
    if history:
        last = history[-1]
        clock = last["clock"]
        fed = next((m["federated"] for m in reversed(history) if (m.get("federated") or {}).get("accuracy")
                    is not None), None)
        title = (f"final accuracy {_num(last['accuracy'], 4)}"
                 + (f" (devices' held-out: {fed['accuracy']:.4f})" if fed else "")
                 + f" after {last['round']} rounds, {last['elapsed_s']:.1f} s ({clock} clock)")
    caption = ("seconds from the time model (device profiles, real bytes); not this host's time"
               if clock == "virtual" else "seconds as measured")
    agents = sorted(registry.agents.values(), key=lambda i: i.index)
    per_profile = len(agents) > SUMMARY_ROWS
    if per_profile:
        caption += (f"; {len(agents):,} agents, summed per profile (each agent's totals: the checkpoint's "
                    f"registry, the metrics endpoint)")
    table = Table(title=title, caption=caption)
    first = ("profile", "agents") if per_profile else ("agent", "profile", "last assignment")
    for col in (*first, "rounds", "compute s", "transfer s", "waiting s", "bytes up", "bytes down"):
        table.add_column(col, justify="left" if col in ("agent", "profile", "last assignment") else "right")
    if per_profile:
        groups: dict[str, list[AgentInfo]] = {}
        for a in agents:
            groups.setdefault(a.profile.name, []).append(a)
        for name, members in groups.items():
            table.add_row(name, f"{len(members):,}", *_totals(members))
        return table
    last_round = history[-1].get("agents", {}) if history else {}
    for a in agents:
        table.add_row(a.agent_id, a.profile.name, _assignment(last_round.get(a.agent_id)), *_totals([a]))
    return table


def _totals(agents: list[AgentInfo]) -> tuple[str, ...]:
    """The summary's cells for the running totals of one agent or a profile's agents."""
    return (str(sum(a.rounds for a in agents)), f"{sum(a.client_s for a in agents):.2f}",
            f"{sum(a.transfer_s for a in agents):.2f}", f"{sum(a.wait_s for a in agents):.2f}",
            _mb(sum(a.bytes_up for a in agents)), _mb(sum(a.bytes_down for a in agents)))


def status_table(metrics: list[dict[str, Any]], title: str) -> Table:
    """Per-round metrics that fit an 80-column terminal: bytes in kB/MB, short headers."""
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    federated = any(m.get("federated") for m in metrics)
    for col in ("round", "accuracy", "loss", *(("devices' acc",) if federated else ()), "round s", "elapsed s",
                "wait s", "up", "down"):
        table.add_column(col, justify="right", no_wrap=True)
    for m in metrics:
        fed = [_num((m.get("federated") or {}).get("accuracy"), 4)] if federated else []
        table.add_row(str(m["round"]), _num(m["accuracy"], 4), _num(m["test_loss"], 4), *fed,
                      f"{m['round_time_s']:.2f}", f"{m['elapsed_s']:.1f}", f"{m['waiting_s']:.2f}",
                      _mb(m["bytes_up"]), _mb(m["bytes_down"]))
    return table


def assignment_lines(agents: dict[str, dict[str, Any]], most: int = 4, kinds: int = 12) -> list[str]:
    """A round's assignments, one line per distinct one with the agents given it: 'split 2 b16,
    fp16, window 4: a0, a3' (past ``most`` agents, the first, the last and the count). The
    ``kinds`` given to most agents come first (ties in the round's agent order); the rest are
    counted in one last line, so a fleet of hundreds given as many batches reads on one screen."""
    given: dict[str, list[str]] = {}
    for a, m in agents.items():
        given.setdefault(_assignment(m), []).append(a)
    ranked = sorted(given.items(), key=lambda kv: -len(kv[1]))   # ties: in the order first given
    lines = [f"{what}: " + (", ".join(names) if len(names) <= most else f"{names[0]} … {names[-1]} ({len(names)} agents)")
             for what, names in ranked[:kinds]]
    if len(ranked) > kinds:
        rest = sum(len(names) for _, names in ranked[kinds:])
        lines.append(f"… {len(ranked) - kinds} more assignments, {rest} agents (--format json lists every one)")
    return lines


def _assignment(m: dict[str, Any] | None) -> str:
    """'split 2 b16' (or 'whole model b16'), plus the bottleneck width, codec and window where set."""
    if not m:
        return "-"
    where = "whole model" if m.get("whole_model") else f"split {m.get('split', '?')}"
    parts = [where + (f" b{m['batch_size']}" if m.get("batch_size") else "")]
    if m.get("width"):
        parts.append(f"width {m['width']}")
    if m.get("codec") and m["codec"] != "fp32" and not m.get("whole_model"):
        parts.append(m["codec"])
    if m.get("window", 1) > 1:
        parts.append(f"window {m['window']}")
    return ", ".join(parts)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"
