"""What an agent is doing, for the person at the device: one log line per round and a small
status file that ``sfl-agent status`` reads.

Between "registered" and "coordinator says stop" a device used to print nothing, for minutes
on a real board. Each finished round now logs one INFO line (round, cut, batch, steps, loss
where the device knows it, bytes, seconds), and the same facts go to a JSON file, replaced
atomically, so ``sfl-agent status`` on the device answers "is it training, and how is it
going?" without reading the journal.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = ["RoundSummary", "StatusFile", "default_status_file", "describe", "read_status"]


def default_status_file(agent_id: str) -> Path:
    """Where an agent keeps its status when not told (``--status-file``):
    ``$SFL_AGENT_STATE_DIR``, else systemd's ``$STATE_DIRECTORY``, else
    ``~/.local/state/sfl-agent``; one file per agent id."""
    base = os.environ.get("SFL_AGENT_STATE_DIR") or os.environ.get("STATE_DIRECTORY")
    root = Path(base.split(":")[0]) if base else Path.home() / ".local" / "state" / "sfl-agent"
    return root / f"{agent_id}.json"


@dataclass
class RoundSummary:
    """One finished round as the device saw it."""

    round: int
    split: int
    batch: int
    steps: int
    loss: Optional[float]
    """The device's mean training loss (whole-model rounds); None where the server holds it."""
    bytes_up: int
    bytes_down: int
    seconds: float
    window: int = 1
    """Steps kept in flight (1: lock-step; a status file of an earlier release has none)."""

    def line(self) -> str:
        loss = f"loss {self.loss:.4f}" if self.loss is not None else "loss on the server"
        window = f", window {self.window}" if self.window > 1 else ""
        return (f"round {self.round} done: split {self.split}, batch {self.batch}{window}, {self.steps} steps, "
                f"{loss}, {_size(self.bytes_up)} up, {_size(self.bytes_down)} down, {self.seconds:.1f} s")

    @staticmethod
    def loss_of(value: Any) -> Optional[float]:
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


@dataclass
class StatusFile:
    """The status of one agent process, written to ``path`` on every change (best effort: a
    device whose disk refuses it still trains; the first failure is returned for one log line)."""

    path: Path
    agent: str
    run: str
    pid: int = field(default_factory=os.getpid)
    state: str = "starting"
    round: Optional[int] = None
    rounds_done: int = 0
    last_round: Optional[dict] = None
    updated: float = 0.0

    def set(self, state: str, **fields: Any) -> Optional[str]:
        """Record ``state`` (and ``round``, ``rounds_done``, ``last_round``) and write the file;
        the reason it could not be written, or None."""
        self.state = state
        for k, v in fields.items():
            setattr(self, k, v)
        self.updated = time.time()
        doc = {k: v for k, v in asdict(self).items() if k != "path"}
        tmp = self.path.with_name(f"{self.path.name}.{self.pid}.tmp")   # two processes of one id: no clash
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            os.replace(tmp, self.path)
        except OSError as exc:
            return f"{self.path}: {exc.strerror or exc}"
        return None


def read_status(path: Path) -> dict:
    """A status file's content; ValueError in one line naming the file."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no status file (is an agent running here with this --status-file or agent id?)") \
            from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not an agent status file ({exc})") from None
    if not isinstance(doc, dict) or not {"agent", "run", "pid", "state"} <= set(doc):
        raise ValueError(f"{path}: not an agent status file")
    return doc


def describe(doc: dict, now: Optional[float] = None) -> list[str]:
    """An agent's status in a few lines of text (what ``sfl-agent status`` prints)."""
    now = time.time() if now is None else now
    alive = _alive(int(doc["pid"]))
    age = max(0.0, now - float(doc.get("updated") or now))
    head = (f"agent {doc['agent']} in run {doc['run']}: {doc['state']}"
            + (f" (round {doc['round']})" if doc.get("round") is not None and doc["state"] == "training" else "")
            + f"; pid {doc['pid']} {'running' if alive else 'not running'}; updated {_ago(age)}")
    lines = [head, f"rounds done: {doc.get('rounds_done', 0)}"]
    last = doc.get("last_round")
    if isinstance(last, dict):
        try:
            lines.append("last " + RoundSummary(**last).line())
        except (TypeError, ValueError):   # written by another release, or by hand
            lines.append(f"last round: not readable ({', '.join(sorted(map(str, last)))})")
    return lines


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ago(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _size(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


class TerminalProgress:
    """A live line on a terminal while the device trains: the round, the step of the round's
    steps, and the last round's figures; the log lines scroll above it. Only where standard
    error is a terminal (``sfl-agent start`` decides); a journal gets the per-round lines alone."""

    def __init__(self, console: Any):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=console, transient=True)
        self._task: Optional[Any] = None

    def __enter__(self) -> "TerminalProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def show(self, round_: int, steps_done: int, steps: int) -> None:
        """Round ``round_``: ``steps_done`` of its ``steps`` steps trained."""
        description = f"round {round_}"
        if self._task is None:
            self._task = self._progress.add_task(description, total=steps)
        self._progress.update(self._task, description=description, completed=steps_done, total=steps)
