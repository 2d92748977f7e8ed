"""bench/stage_timers.py: the thread CPU timers behind ``coordinator_load.py --stages``.

A stage's time excludes the stages nested in it, and each thread keeps its own figures: the
coordinator's two busy threads (round engine, paho's network thread) must not charge each
other's work. Real CPU work, real threads; the checks are on sums and order, not on speed.
"""

from __future__ import annotations

import importlib
import threading
import time

from helpers import bench_module

stage_timers = bench_module("stage_timers")


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_nested_stage_is_charged_to_itself_only():
    timers = stage_timers.Timers()
    inner = timers.wrap("inner", lambda: _burn(0.03))
    outer = timers.wrap("outer", lambda: (_burn(0.02), inner()))
    outer()
    assert 0.03 <= timers.seconds["inner"] < 0.06
    assert 0.02 <= timers.seconds["outer"] < 0.04     # its own 20 ms, not the inner 30


def test_threads_do_not_charge_each_other():
    timers = stage_timers.Timers()
    work = timers.wrap("work", lambda: _burn(0.03))
    sleeper = timers.wrap("waiting", lambda: time.sleep(0.2))
    t = threading.Thread(target=sleeper)
    t.start()
    work()                     # runs while the other thread's stage is open
    t.join()
    assert timers.seconds["waiting"] < 0.01           # sleeping costs no CPU
    assert 0.03 <= timers.seconds["work"] < 0.06


def test_every_stage_of_the_report_is_a_product_function():
    """The wrapped names exist in the product: a renamed function fails here, not in a bench run."""
    for _, module, path in (*stage_timers.ENGINE_STAGES, *stage_timers.NETWORK_STAGES, ("round", *stage_timers.ROUND)):
        owner = importlib.import_module(module)
        for name in path.split("."):
            owner = getattr(owner, name)
        assert callable(owner), (module, path)
    assert len(set(stage_timers.STAGES)) == len(stage_timers.STAGES)
