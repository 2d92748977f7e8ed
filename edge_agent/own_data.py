"""The agent's side of a run on the devices' own data: read the task from the run
description, load the device's data under it, and say what was loaded.

``sfl-agent start`` and ``sfl-agent check-data`` both go through :func:`load_for_task`, so
what ``check-data`` prints is what ``start`` would train on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from edge_agent.agent import LocalData
from sfl_core.config.run import ConfigError, TaskConfig, task_from_wire
from sfl_core.data.builtin import DatasetError
from sfl_core.data.local import MAX_NAMED, DeviceData, load_local
from sfl_core.data.preprocessing import ChannelStats
from sfl_core.model.fingerprint import digest

log = logging.getLogger("sfl.agent")

__all__ = ["Device", "task_of", "load_for_task", "prepare_device", "describe"]


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


@dataclass
class Device:
    """What a device brings to a task run: its data and what its registration adds."""

    data: DeviceData
    extra: dict[str, Any]
    """``register`` fields of a task run: the model's digest and, for ``normalize: federated``,
    the channel statistics of the training inputs."""

    def local(self, num_classes: int) -> tuple[LocalData, Optional[LocalData]]:
        """The training split and the held-out split as the agent core takes them."""
        train = LocalData(self.data.train.x, self.data.train.y, num_classes)
        val = self.data.val
        return train, (LocalData(val.x, val.y, num_classes) if val is not None else None)


def prepare_device(path: Optional[str], task: TaskConfig, bad_files: str, model_lines: list[str]) -> Device:
    """Load this device's data and build its registration additions, as ``sfl-agent start``
    does and as the simulation does for each simulated device."""
    data = load_for_task(path, task, bad_files)
    extra: dict[str, Any] = {"architecture": digest(model_lines)}
    if task.normalize == "federated":
        extra["channel_stats"] = ChannelStats.of(data.train.x).to_wire()
    return Device(data, extra)


def describe(data: DeviceData, task: TaskConfig) -> str:
    """One line: samples per class, held-out samples, skipped files."""
    counts = ", ".join(f"{c} {n}" for c, n in zip(task.classes, data.train.label_counts(task.num_classes)))
    held = f"; held out {len(data.val)}" if data.val is not None else "; no held-out split"
    return (f"loaded {len(data.train)} samples from {data.path} ({data.kind}): {counts}{held}"
            f"{f'; skipped {len(data.skipped)} file(s)' if data.skipped else ''}"
            + "".join(f"; {note}" for note in data.notes))
