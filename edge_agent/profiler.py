"""Measure the device: seconds per sample for each candidate split, and the link to the coordinator.

Link figures come from acknowledged round trips (probe -> probe_ack through the broker),
never from a publish call returning: paho returns before the bytes have left the device.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import torch

from sfl_core.model.zoo import SplitModel

ComputeHook = Callable[[float, float], float]


def measure_compute(model: SplitModel, splits: Sequence[int], flops_per_sample: dict[int, float], *,
                    batch_size: int = 16, repeats: int = 2,
                    compute_hook: Optional[ComputeHook] = None) -> dict[int, float]:
    """Seconds per sample of forward+backward through ``blocks[:s]`` for every ``s``.

    One warm-up pass, then the median of ``repeats`` timed passes. Under emulation the hook
    stretches each pass to the profile's FLOP/s, so the report matches the emulated device.
    """
    x = torch.randn(batch_size, *model.input_shape)
    out: dict[int, float] = {}
    model.train()
    for s in splits:
        client = model.client(s)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            client(x).float().sum().backward()
            dt = time.perf_counter() - t0
            if compute_hook is not None:
                dt = compute_hook(flops_per_sample[s] * batch_size, dt)
            if i:
                times.append(dt)
        model.zero_grad(set_to_none=True)
        out[s] = statistics.median(times) / batch_size
    return out


def measure_link(probe: Callable[[int, int], float], *, big: int = 128 * 1024, small: int = 64,
                 repeats: int = 3) -> dict[str, float]:
    """Latency and throughput from timed probes; ``probe(up_bytes, down_bytes) -> seconds``.

    ``rtt`` is the median small round trip; uplink rate = big / (t(big up) - rtt), downlink
    likewise with a big reply. Rates are bytes/s.
    """
    rtt = statistics.median(probe(small, small) for _ in range(repeats))
    up = statistics.median(probe(big, small) for _ in range(max(1, repeats - 1)))
    down = statistics.median(probe(small, big) for _ in range(max(1, repeats - 1)))
    floor = 1e-4  # guard against a round trip not slower than the empty one
    return {"rtt_s": rtt, "up_bytes_per_s": big / max(up - rtt, floor), "down_bytes_per_s": big / max(down - rtt, floor)}
