"""Checkpoints: the global model as a tensor-only file, everything else as JSON.

``torch.load(..., weights_only=True)`` refuses anything but tensors and plain containers, so
a tampered checkpoint cannot run code. Writes go to a temporary file then ``os.replace`` so
a crash mid-write never leaves a torn checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

MODEL_FILE = "checkpoint.pt"
STATE_FILE = "state.json"
METRICS_FILE = "metrics.jsonl"


def save(out_dir: Path, model_state: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (MODEL_FILE + ".tmp")
    torch.save({k: v.detach().cpu() for k, v in model_state.items()}, tmp)
    os.replace(tmp, out_dir / MODEL_FILE)
    tmp = out_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, out_dir / STATE_FILE)


def load(out_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model_path, state_path = out_dir / MODEL_FILE, out_dir / STATE_FILE
    if not model_path.exists() or not state_path.exists():
        raise FileNotFoundError(f"no checkpoint to resume in {out_dir} (expected {MODEL_FILE} and {STATE_FILE})")
    model_state = torch.load(model_path, map_location="cpu", weights_only=True)
    return model_state, json.loads(state_path.read_text())


def append_metrics(out_dir: Path, record: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(out_dir: Path, last_round: int) -> None:
    """On resume, rounds after the checkpoint are redone: drop their stale records."""
    keep = [m for m in read_metrics(out_dir) if m.get("round", 0) <= last_round]
    path = out_dir / METRICS_FILE
    if path.exists():
        path.write_text("".join(json.dumps(m) + "\n" for m in keep))
