"""The agent's side of a run on the devices' own data: read the task from the run
description, load the device's data under it, and say what was loaded.

``sfl-agent start`` and ``sfl-agent check-data`` both go through :func:`load_for_task`, so
what ``check-data`` prints is what ``start`` would train on.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from sfl_core.config import ConfigError, TaskConfig, task_from_wire
from sfl_core.data import DatasetError
from sfl_core.local_data import MAX_NAMED, DeviceData, load_local

log = logging.getLogger("sfl.agent")

__all__ = ["task_of", "load_for_task", "describe"]


def task_of(body: dict[str, Any]) -> tuple[TaskConfig, str]:
    """The task contract and the bad-file policy a run description carries (validated)."""
    wire_task = dict(body["task"])
    bad_files = wire_task.pop("bad_files", "skip")
    if bad_files not in ("skip", "fail"):
        raise ConfigError(f"run_info.task.bad_files: expected 'skip' or 'fail', got {bad_files!r}")
    return task_from_wire(wire_task, "run_info.task"), bad_files


def load_for_task(path: Optional[str], task: TaskConfig, bad_files: str = "skip") -> DeviceData:
    """This device's data under ``task``: all of it (no partition), logged per class."""
    if not path:
        raise DatasetError("this run trains on each device's own data: give the agent --data PATH (an image "
                           "folder, .npz, a folder of x.npy/y.npy, CSV, Parquet or a Hugging Face data set)")
    data = load_local(path, task, bad_files)
    log.info("%s", describe(data, task))
    if data.skipped:
        named = "; ".join(f"{p} ({why})" for p, why in data.skipped[:MAX_NAMED])
        more = f" and {len(data.skipped) - MAX_NAMED} more" if len(data.skipped) > MAX_NAMED else ""
        log.warning("skipped %d unreadable file(s) in %s: %s%s", len(data.skipped), path, named, more)
    return data


def describe(data: DeviceData, task: TaskConfig) -> str:
    """One line: samples per class, held-out samples, skipped files."""
    counts = ", ".join(f"{c} {n}" for c, n in zip(task.classes, data.train.label_counts(task.num_classes)))
    held = f"; held out {len(data.val)}" if data.val is not None else "; no held-out split"
    return (f"loaded {len(data.train)} samples from {data.path} ({data.kind}): {counts}{held}"
            f"{f'; skipped {len(data.skipped)} file(s)' if data.skipped else ''}")
