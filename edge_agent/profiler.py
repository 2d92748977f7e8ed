"""Measure the device: seconds per sample for each candidate split, its memory, and the link to
the coordinator (or, for a profile written before any run, through the broker alone).

Link figures come from acknowledged round trips (probe -> probe_ack through the broker),
never from a publish call returning: paho returns before the bytes have left the device.
"""

from __future__ import annotations

import math
import os
import queue
import statistics
import time
from typing import Callable, Optional, Sequence

import torch

from sfl_core.model.zoo import SplitModel
from sfl_core.wire.protocol import PROBE_AMPLIFICATION

ComputeHook = Callable[[float, float], float]


def measure_compute(model: SplitModel, splits: Sequence[int], flops_per_sample: dict[int, float], *,
                    batch_size: int = 16, repeats: int = 5, prior_flops: Optional[float] = None,
                    compute_hook: Optional[ComputeHook] = None) -> dict[int, float]:
    """Seconds per sample of forward+backward through ``blocks[:s]`` for every ``s``.

    One warm-up pass, then ``repeats`` timed passes, summarised by :func:`robust_seconds`:
    single timings on a device that shares its cores vary by 2x and more, and the planner
    sizes a device's batch from them (identical devices were handed batches of 19 and 51).
    ``prior_flops`` (the device profile's FLOP/s) is the prior the measurement is pulled
    towards. Under emulation the hook stretches each pass to the profile's FLOP/s, so the
    report matches the emulated device. The coordinator re-measures every round from the
    real step times (``auto``'s smoothed factors), so this only has to start well.
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
        prior = flops_per_sample[s] * batch_size / prior_flops if prior_flops and flops_per_sample.get(s) else None
        out[s] = robust_seconds(times, prior) / batch_size
    return out


PRIOR_WEIGHT = 1.0
"""How many timed passes the profile's figure counts as (:func:`robust_seconds`)."""


def robust_seconds(times: Sequence[float], prior: Optional[float] = None) -> float:
    """One figure from repeated timings of the same work: the median of the faster half (another
    process taking the cores only ever adds time, so the slower timings say more about the host
    than the device), then, with a ``prior`` (the profile's seconds for the same work), the
    weighted geometric mean of the two, the prior counting as :data:`PRIOR_WEIGHT` timings."""
    if not times:
        raise ValueError("robust_seconds: no timings")
    fast = sorted(times)[: (len(times) + 1) // 2]
    measured = statistics.median(fast)
    if prior is None or not prior > 0 or not measured > 0:
        return measured
    n = len(fast)
    return math.exp((n * math.log(measured) + PRIOR_WEIGHT * math.log(prior)) / (n + PRIOR_WEIGHT))


def measure_link(probe: Callable[[int, int], float], *, big: int = 128 * 1024, small: int = 64,
                 repeats: int = 5) -> dict[str, float]:
    """Latency and throughput from timed probes; ``probe(up_bytes, down_bytes) -> seconds``.

    Each figure is :func:`robust_seconds` of ``repeats`` probes. ``rtt`` is the small round
    trip; uplink rate = big / (t(big up) - rtt). The
    downlink probe pays for its big reply with a pad of ``big / PROBE_AMPLIFICATION`` bytes (a
    coordinator answers no more than that many times what a probe sent), whose upload time at
    the measured uplink rate is taken off: downlink rate = big / (t(big down) - rtt - pad / up).
    Rates are bytes/s.
    """
    rtt = robust_seconds([probe(small, small) for _ in range(repeats)])
    up = robust_seconds([probe(big, small) for _ in range(repeats)])
    pad = max(small, -(-big // PROBE_AMPLIFICATION))
    down = robust_seconds([probe(pad, big) for _ in range(repeats)])
    floor = 1e-4  # guard against a round trip not slower than the empty one
    up_rate = big / max(up - rtt, floor)
    return {"rtt_s": rtt, "up_bytes_per_s": up_rate, "down_bytes_per_s": big / max(down - rtt - pad / up_rate, floor)}


def measure_broker_echo(send: Callable[[bytes], None], echoes: "queue.Queue[bytes]", *, big: int = 128 * 1024,
                        small: int = 64, repeats: int = 3, timeout: float = 30.0) -> dict[str, float]:
    """The link through a broker alone, with no coordinator to answer: each probe is published to
    a topic this client subscribes to, so it goes up to the broker and comes back down.

    Only the sum of both directions is seen, so the rates reported assume a symmetric link:
    ``rate = big / ((t(big) - t(small)) / 2)``; ``rtt_s`` is the median small echo. Behind an
    asymmetric link (most cellular and ADSL ones) the uplink is overstated: measure against the
    coordinator instead (``sfl-agent start`` does at registration)."""
    def probe(size: int) -> float:
        token = os.urandom(8)
        t0 = time.perf_counter()
        send(token + bytes(size))
        deadline = t0 + timeout
        while True:
            try:
                got = echoes.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                raise TimeoutError(f"no echo from the broker within {timeout:.0f} s") from None
            if got[:8] == token:
                return time.perf_counter() - t0

    rtt = statistics.median(probe(small) for _ in range(repeats))
    both = statistics.median(probe(big) for _ in range(max(1, repeats - 1)))
    rate = big / max((both - rtt) / 2, 1e-4)
    return {"rtt_s": rtt, "up_bytes_per_s": rate, "down_bytes_per_s": rate}


def physical_memory() -> Optional[int]:
    """Bytes of RAM on this machine (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def own_rss() -> Optional[int]:
    """This process's resident memory in bytes (Linux; None elsewhere): after importing torch and
    building a model, what the agent holds before any training state."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
