"""``--emulate``: make a fast machine behave like the profile's device.

Compute is stretched to the profile's FLOP/s and the link is throttled to its rate, so a
laptop can host a heterogeneous fleet whose wall-clock times mean something. The link moves
one message at a time each way, beside the compute (the uplink in the agent's sending thread,
the downlink timed from each message's arrival), as a device's radio does; on a
``half_duplex`` link (a WiFi cell) one message at a time in either direction; on a full-duplex
link a message that starts while the other direction is busy moves at the profile's ``bidir_*``
rate, where it gives one (both ways at once a link moves less each way). Emulation
can only slow down: if this machine is slower than the profile, the real time stands
(and a warning says so once).

``slowdown`` (``sfl-agent start --slowdown F``) is a fault-injection aid for testing: the device
runs F times slower than its profile (compute and link) while it still registers the
profile's numbers, i.e. an unexpected straggler (thermal throttling, a congested link).
"""

from __future__ import annotations

import logging
import threading
import time

from sfl_core.config.run import DeviceProfile

log = logging.getLogger("sfl.agent.emulate")


class Emulator:
    def __init__(self, profile: DeviceProfile, slowdown: float = 1.0):
        if not slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1 (emulation can only slow down), got {slowdown}")
        self.base = profile
        self.profile = profile.at_round(0)
        self.slowdown = float(slowdown)
        self._warned = False
        self._down_free = 0.0   # when the emulated downlink finishes what it is receiving
        self._up_free = 0.0     # when the emulated uplink finishes what it is sending
        self._air_free = 0.0    # half duplex: when the shared medium finishes what it carries
        self._air = threading.Lock()   # the sending thread and the receiving one both book the medium

    def at_round(self, r: int) -> None:
        """Follow the profile's capacity schedule: from round ``r`` on, run at its scaled rates."""
        self.profile = self.base.at_round(r)

    def compute(self, flops: float, actual_s: float) -> float:
        """Sleep until ``flops`` would have taken the profile's device; return that time."""
        target = flops / self.profile.compute_flops * self.slowdown
        if target > actual_s:
            time.sleep(target - actual_s)
            return target
        if not self._warned and actual_s > 2 * target and actual_s > 0.01:
            log.warning("this machine computes slower than profile %s; reporting real times", self.profile.name)
            self._warned = True
        return actual_s

    def uplink(self, nbytes: int) -> None:
        if self.profile.half_duplex:
            self.wait_until(self._book_air(self._seconds(nbytes, self.profile.link_bytes_per_s)))
            return
        share = self.profile.both_ways[0] if time.monotonic() < self._down_free else 1.0
        seconds = self._seconds(nbytes, self.profile.link_bytes_per_s * share)
        self._up_free = time.monotonic() + seconds
        time.sleep(seconds)

    def downlink(self, nbytes: int) -> None:
        time.sleep(self.downlink_s(nbytes))

    def downlink_s(self, nbytes: int, both: bool = False) -> float:
        """A message's seconds down; ``both``: while the uplink is busy too."""
        return self._seconds(nbytes, self.profile.downlink * (self.profile.both_ways[1] if both else 1.0))

    def _seconds(self, nbytes: int, rate: float) -> float:
        """One message of ``nbytes`` over a link at ``rate`` bytes/s, its latency included."""
        return (nbytes / rate + self.profile.latency_s) * self.slowdown

    def arrival(self, nbytes: int) -> float:
        """When a message that starts arriving now is all in over the emulated downlink: one
        message at a time, while the device computes (a radio receives beside the processor);
        on a half-duplex link, after what the medium already carries either way."""
        if self.profile.half_duplex:
            return self._book_air(self.downlink_s(nbytes))
        start = max(time.monotonic(), self._down_free)
        self._down_free = start + self.downlink_s(nbytes, both=start < self._up_free)
        return self._down_free

    def _book_air(self, seconds: float) -> float:
        """Book the shared medium for ``seconds`` after what it already carries; when it is done."""
        with self._air:
            self._air_free = max(time.monotonic(), self._air_free) + seconds
            return self._air_free

    def wait_until(self, when: float) -> None:
        """Sleep until monotonic time ``when`` (a message's :meth:`arrival`)."""
        pause = when - time.monotonic()
        if pause > 0:
            time.sleep(pause)
