"""``--emulate``: make a fast machine behave like the profile's device.

Compute is stretched to the profile's FLOP/s and the link is throttled to its rate, so a
laptop can host a heterogeneous fleet whose wall-clock times mean something. Emulation
can only slow down: if this machine is slower than the profile, the real time stands
(and a warning says so once).
"""

from __future__ import annotations

import logging
import time

from sfl_core.config import DeviceProfile

log = logging.getLogger("sfl.agent.emulate")


class Emulator:
    def __init__(self, profile: DeviceProfile):
        self.base = profile
        self.profile = profile.at_round(0)
        self._warned = False

    def at_round(self, r: int) -> None:
        """Follow the profile's capacity schedule: from round ``r`` on, run at its scaled rates."""
        self.profile = self.base.at_round(r)

    def compute(self, flops: float, actual_s: float) -> float:
        """Sleep until ``flops`` would have taken the profile's device; return that time."""
        target = flops / self.profile.compute_flops
        if target > actual_s:
            time.sleep(target - actual_s)
            return target
        if not self._warned and actual_s > 2 * target and actual_s > 0.01:
            log.warning("this machine computes slower than profile %s; reporting real times", self.profile.name)
            self._warned = True
        return actual_s

    def uplink(self, nbytes: int) -> None:
        time.sleep(nbytes / self.profile.link_bytes_per_s + self.profile.latency_s)

    def downlink(self, nbytes: int) -> None:
        time.sleep(nbytes / self.profile.downlink_bytes_per_s + self.profile.latency_s)
