"""A device profile measured on the device itself (``sfl-agent profile --detect``).

The shipped profiles describe boards from their data sheets and published measurements; a
board the product does not ship needs numbers too, and guessing them skews every plan. This
measures what the time model uses (docs/methods/time-model.md): the sustained FLOP/s of
training a client portion, the memory training may use (the RAM less what the agent's own
runtime holds), and, through a broker, the link. The file it writes
is an ordinary profile (validated like any other before it is written), with the per-split
measurements as comments so a reader can see where each number came from.
"""

from __future__ import annotations

import datetime
import platform
from dataclasses import dataclass
from typing import Dict, Optional

import yaml

from sfl_core.config.run import profile_from_dict

__all__ = ["Measured", "profile_text"]


@dataclass(frozen=True)
class Measured:
    """What ``sfl-agent profile --detect`` measured."""

    model: str
    input_shape: tuple
    batch_size: int
    seconds_per_sample: Dict[int, float]
    """Forward+backward of ``blocks[:s]``, per sample, for each split ``s``."""
    flops_per_sample: Dict[int, float]
    memory_bytes: Optional[int]
    link: Optional[Dict[str, float]]
    """``rtt_s``, ``up_bytes_per_s``, ``down_bytes_per_s``; None: given by hand."""
    link_how: str
    ram_bytes: Optional[int] = None
    runtime_bytes: Optional[int] = None
    """The measuring process's resident memory (interpreter, torch, the model): not free for training."""


def sustained_flops(m: Measured) -> float:
    """The FLOP/s of training the deepest client portion measured: the most work per pass, so
    the least distorted by per-call overheads (the shallow cuts run a few small layers)."""
    deepest = max(m.seconds_per_sample)
    return m.flops_per_sample[deepest] / m.seconds_per_sample[deepest]


def profile_text(name: str, m: Measured, *, link_bytes_per_s: Optional[float] = None,
                 torch_version: str = "") -> str:
    """The profile's YAML: validated (a ConfigError names what is wrong) before it is returned."""
    up = link_bytes_per_s if link_bytes_per_s is not None else (m.link or {}).get("up_bytes_per_s")
    doc = {"name": name, "compute_flops": float(f"{sustained_flops(m):.4g}"),
           "link_bytes_per_s": float(f"{up:.4g}") if up else None}
    if m.link is not None and link_bytes_per_s is None:
        doc["downlink_bytes_per_s"] = float(f"{m.link['down_bytes_per_s']:.4g}")
        doc["latency_s"] = round(m.link["rtt_s"] / 2, 5)
    if m.memory_bytes:
        doc["memory_bytes"] = int(m.memory_bytes)
    doc["description"] = f"{platform.node() or 'this device'} ({platform.machine()}), measured by sfl-agent profile --detect"
    doc["source"] = (f"measured {datetime.date.today().isoformat()}: {m.model} {tuple(m.input_shape)} batch "
                     f"{m.batch_size} on Python {platform.python_version()}"
                     + (f", torch {torch_version}" if torch_version else "") + f"; link: {m.link_how}")
    profile_from_dict(doc, "<measured profile>")   # the file must load like any profile
    lines = [f"# Measured on {platform.node() or 'this device'} ({platform.machine()}) by `sfl-agent profile --detect`.",
             f"# Client-portion training of {m.model}, forward+backward per sample:"]
    for s in sorted(m.seconds_per_sample):
        sec = m.seconds_per_sample[s]
        lines.append(f"#   split {s:>2}: {sec * 1e3:9.3f} ms/sample  {m.flops_per_sample[s] / sec / 1e9:8.3f} GFLOP/s")
    lines.append("# compute_flops: the deepest split's rate (the most work per pass).")
    if m.ram_bytes and m.runtime_bytes:
        lines.append(f"# memory_bytes: RAM {m.ram_bytes / 2**20:.0f} MiB less the agent runtime's "
                     f"{m.runtime_bytes / 2**20:.0f} MiB (interpreter, torch, model): what training may use.")
    if m.link is not None:
        lines.append(f"# link: {m.link_how}; round trip {m.link['rtt_s'] * 1e3:.1f} ms.")
    return "\n".join(lines) + "\n" + yaml.safe_dump(doc, sort_keys=False)
