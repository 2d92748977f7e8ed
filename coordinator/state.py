"""Checkpoints and metrics on disk: what a crash must never lose or tear.

**One file is the checkpoint.** ``checkpoint.pt`` holds the global model's tensors *and* the
run state (round, registry, time table, ...) as JSON text, so the pair can never disagree: it
is written to a temporary file, flushed to disk, and moved over the old one with one
``os.replace``. A kill at any instant leaves either the previous checkpoint or the new one.
``state.json`` beside it is a copy of the same state (one line of JSON) for people and scripts; nothing
resumes from it.

**Safe to read.** ``torch.load(..., weights_only=True)`` refuses anything but tensors and
plain containers, so a tampered checkpoint cannot run code. Every way a checkpoint can be
unusable (missing, empty, truncated, corrupted, another program's file, another model's)
becomes one :class:`CheckpointError` naming the file and what is wrong; torch's own messages
are not relayed (they advise ``weights_only=False``, which a checkpoint must never need).

**Disk full** (or any write error) raises :class:`CheckpointWriteError` naming the file
system and the file; the temporary file is removed and the previous checkpoint stays intact.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

log = logging.getLogger("sfl.coord")

MODEL_FILE = "checkpoint.pt"
STATE_FILE = "state.json"
METRICS_FILE = "metrics.jsonl"
FORMAT = "sfl-edge checkpoint 1"
"""Written into every checkpoint; a file without it is not ours (or predates this format)."""
REQUIRED_STATE = ("round", "model")


class CheckpointError(ValueError):
    """A checkpoint, state or metrics file that cannot be resumed from; the message names it."""


class CheckpointWriteError(OSError):
    """Writing the checkpoint or the metrics failed (disk full, read-only, ...); the previous
    checkpoint is intact."""


# ================================================================ writing

def save(out_dir: Path, model_state: dict[str, torch.Tensor], state: dict[str, Any],
         encoded: Mapping[str, str] | None = None) -> None:
    """Replace the checkpoint atomically, then refresh the ``state.json`` copy. ``encoded``: more
    top-level keys of the state whose values are JSON text already (the registry's, kept
    encoded between rounds by :meth:`coordinator.registry.Registry.to_json_text`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(state)   # once, and compact: an indented dump takes json's pure-Python encoder
    if encoded:
        extra = ",".join(f"{json.dumps(k)}:{v}" for k, v in encoded.items())
        text = f"{text[:-1]},{extra}}}" if state else f"{{{extra}}}"
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "state": text,
                "model": {k: v.detach().cpu() for k, v in model_state.items()}}, buf)
    _write_atomic(out_dir / MODEL_FILE, buf.getvalue())
    _write_atomic(out_dir / STATE_FILE, text.encode() + b"\n")


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` beside ``path``, flush it to the disk, move it over ``path``. On any error
    the temporary file is removed and ``path`` is untouched."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise _write_error(path, exc) from None
    _fsync_dir(path.parent)


def _fsync_dir(d: Path) -> None:
    """Make the rename itself durable (a power cut after it must not bring back the old file)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_error(path: Path, exc: OSError) -> CheckpointWriteError:
    """One line for an operator: which file system is full (or read-only), which file it was."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"no space left on {_mount_point(path)}"
    elif exc.errno == errno.EROFS:
        what = f"{_mount_point(path)} is read-only"
    else:
        what = exc.strerror or type(exc).__name__
    return CheckpointWriteError(exc.errno, f"{what} writing {path}")


def _mount_point(path: Path) -> str:
    p = path.resolve().parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


# ================================================================ reading

def load(out_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's tensors and the run state of the last completed round.

    CheckpointError, naming the file, for anything that is not a complete checkpoint of ours.
    """
    path = out_dir / MODEL_FILE
    if not path.exists():
        raise CheckpointError(f"{path}: no checkpoint to resume (file not found; was this run ever started "
                              f"with this output directory?)")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror})") from None
    if size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes): not a checkpoint")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: truncated or corrupted ({size} bytes that are not a complete checkpoint "
                              f"archive)")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    except Exception as exc:  # noqa: BLE001 - torch raises many types; none of their texts is relayed
        raise CheckpointError(f"{path}: corrupted (its archive is complete but its contents cannot be read "
                              f"as tensors: {type(exc).__name__})") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a checkpoint of this program's format ({FORMAT!r}): written by "
                              f"another program or an older version")
    model, text = blob.get("model"), blob.get("state")
    if not isinstance(model, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in model.items()):
        raise CheckpointError(f"{path}: its model entry is not a mapping of names to tensors")
    try:
        state = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: its run state is not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: its run state is missing or not a mapping")
    missing = [k for k in REQUIRED_STATE if k not in state]
    if missing:
        raise CheckpointError(f"{path}: its run state lacks {', '.join(map(repr, missing))}")
    if not isinstance(state["round"], int) or isinstance(state["round"], bool) or state["round"] < 0:
        raise CheckpointError(f"{path}: its run state has round {state['round']!r}, not a round number")
    return model, state


def check_fits(path: Path, st: dict[str, Any], *, model: str, run_id: str, rounds: int) -> None:
    """CheckpointError unless the checkpoint ``st`` (read from ``path``) can continue a run of
    ``model`` named ``run_id`` with ``rounds`` rounds."""
    if st["model"] != model:
        raise CheckpointError(f"{path}: a checkpoint of model {st['model']!r}, but the run config says {model!r}")
    if st.get("run", run_id) != run_id:
        raise CheckpointError(f"{path}: a checkpoint of run {st['run']!r}, but the run config says {run_id!r}")
    if st["round"] > rounds:
        raise CheckpointError(f"{path}: already after round {st['round']}, beyond the config's "
                              f"{rounds} rounds (raise --rounds to train further)")


def check_tensors(path: Path, got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *,
                  model: str) -> None:
    """CheckpointError unless the checkpoint's tensors ``got`` have exactly the names and shapes
    of the run's model ``expected`` (the first three of each kind of mismatch are named)."""
    missing = [k for k in expected if k not in got]
    extra = [k for k in got if k not in expected]
    shaped = [f"{k} {tuple(got[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
              if k in got and tuple(got[k].shape) != tuple(v.shape)]
    for what, keys in (("lacks the tensor(s)", missing), ("has tensor(s) this model does not have", extra),
                       ("has tensor(s) of another shape", shaped)):
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            raise CheckpointError(f"{path}: does not fit this run's model {model!r}: it {what} "
                                  f"{', '.join(keys[:3])}{more}")


def load_state(out_dir: Path) -> dict[str, Any]:
    """The run state alone (``sfl-coord status``), from the checkpoint itself."""
    return load(out_dir)[1]


# ================================================================ metrics

def append_metrics(out_dir: Path, record: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / METRICS_FILE
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise _write_error(path, exc) from None


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """Every round's record. A last line cut short (a crash or a full disk while appending it)
    is left out with a warning; any other unreadable line is a CheckpointError naming it."""
    path = out_dir / METRICS_FILE
    if not path.exists():
        return []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("round"), int):
                raise ValueError("not a round record")
        except ValueError:
            if i == len(lines):  # no newline after it: an append that never finished
                log.warning("%s: line %d is incomplete (an append cut short); ignored", path, i)
                continue
            raise CheckpointError(f"{path}: line {i} is not a round record (corrupted)") from None
        records.append(rec)
    return records


def truncate_metrics(out_dir: Path, last_round: int) -> None:
    """On resume, rounds after the checkpoint are redone: drop their stale records (atomically)."""
    path = out_dir / METRICS_FILE
    if not path.exists():
        return
    keep = [m for m in read_metrics(out_dir) if m["round"] <= last_round]
    _write_atomic(path, "".join(json.dumps(m) + "\n" for m in keep).encode())
