"""``--emulate``'s link: a full-duplex link carries an upload and a download at once; a
half-duplex one (a WiFi cell) books one medium for both, so a download waits for the upload
that holds it."""

from __future__ import annotations

import threading
import time

import pytest

from edge_agent.emulation import Emulator
from sfl_core.config.run import DeviceProfile

RATE, SIZE = 1e6, 200_000   # 0.2 s a message each way


def _upload_then_download(half_duplex: bool) -> float:
    """Seconds from an upload's start until a download that begins arriving just after it is in."""
    emulator = Emulator(DeviceProfile(name="x", compute_flops=1e9, link_bytes_per_s=RATE, half_duplex=half_duplex))
    sending = threading.Thread(target=emulator.uplink, args=(SIZE,))
    t0 = time.monotonic()
    sending.start()
    time.sleep(0.02)   # the upload holds the link now
    arrived = emulator.arrival(SIZE) - t0
    sending.join()
    return arrived


@pytest.mark.parametrize("half_duplex, low, high", [(False, 0.2, 0.35), (True, 0.4, 0.55)])
def test_a_download_overlaps_an_upload_only_on_a_full_duplex_link(half_duplex, low, high):
    assert low <= _upload_then_download(half_duplex) < high


def test_a_half_duplex_profile_is_read_and_sent_as_it_says():
    from sfl_core.config.run import profile_from_dict

    profile = profile_from_dict({"name": "wifi", "compute_flops": 1e9, "link_bytes_per_s": 1e6, "half_duplex": True})
    assert profile.half_duplex and profile_from_dict(profile.to_dict()).half_duplex
    assert not profile_from_dict({"name": "eth", "compute_flops": 1e9, "link_bytes_per_s": 1e6}).half_duplex
    with pytest.raises(Exception, match="half_duplex"):
        profile_from_dict({"name": "x", "compute_flops": 1e9, "link_bytes_per_s": 1e6, "half_duplex": "sometimes"})


def test_a_download_while_an_upload_runs_moves_at_the_profiles_both_ways_rate():
    """A full-duplex profile that says its downlink keeps half its rate while the uplink is
    busy: a download that starts during an upload takes twice as long; after it, not."""
    profile = DeviceProfile(name="x", compute_flops=1e9, link_bytes_per_s=RATE, bidir_downlink_bytes_per_s=RATE / 2)
    emulator = Emulator(profile)
    sending = threading.Thread(target=emulator.uplink, args=(SIZE,))
    t0 = time.monotonic()
    sending.start()
    time.sleep(0.02)
    assert 0.4 <= emulator.arrival(SIZE) - t0 < 0.55
    sending.join()
    emulator.wait_until(emulator._down_free)
    t1 = time.monotonic()
    assert 0.2 <= emulator.arrival(SIZE) - t1 < 0.3


def test_the_both_ways_rates_are_read_validated_sent_and_scaled():
    from sfl_core.config.run import profile_from_dict
    from sfl_core.wire.protocol import profile_body

    d = {"name": "eth", "compute_flops": 1e9, "link_bytes_per_s": 1e6, "downlink_bytes_per_s": 2e6,
         "bidir_link_bytes_per_s": 9e5, "bidir_downlink_bytes_per_s": 1.5e6,
         "capacity": [{"from_round": 2, "compute": 1.0, "link": 0.5}]}
    profile = profile_from_dict(d)
    assert profile.both_ways == pytest.approx((0.9, 0.75))
    assert profile_from_dict(profile_body(profile)).both_ways == pytest.approx((0.9, 0.75))   # as registered
    assert profile.at_round(2).both_ways == pytest.approx((0.9, 0.75))   # a capacity change scales both
    assert profile.at_round(2).bidir_link_bytes_per_s == pytest.approx(4.5e5)
    assert profile_from_dict({**d, "bidir_link_bytes_per_s": 2e6}).both_ways[0] == 1.0   # never above one way
    assert profile_from_dict({k: v for k, v in d.items() if not k.startswith("bidir")}).both_ways == (1.0, 1.0)
    with pytest.raises(Exception, match="bidir_link_bytes_per_s"):
        profile_from_dict({**d, "bidir_link_bytes_per_s": 0})
