"""Run ``sfl-coord serve`` with thread CPU timers around its stages (``coordinator_load.py --stages``).

Command (what the load bench runs in place of ``python -m cli.coord serve ...``)::

    python bench/stage_timers.py OUT.json serve --config run.yaml --broker mqtt://127.0.0.1:1883

Why timers and not a sampling profiler: the coordinator has two busy threads, the round engine
and paho's network thread, and they take turns holding the GIL. A sampler such as py-spy sees
a thread that waits for the GIL as active at its last Python line, so the network thread's
share of the samples came out about twice its share of the CPU that /proc reports for it.
``time.thread_time`` charges each thread only for what it ran itself.

What is timed: each stage below is one function of the product, wrapped on the thread that
runs it; a stage's time excludes the stages nested in it (an encode inside an aggregation counts
as encoding), and each thread's untimed rest is its own "other" stage. At the end of every
round (``RoundEngine.run_counted_round``) OUT.json is rewritten with the running totals, one
entry per round, so the load bench can take the rounds it measures. A wrapper costs two clock
reads, about a microsecond, a few times per agent-step.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

ENGINE_STAGES = (
    # (stage, module, attribute path): the round engine's thread, in the order a step's work flows
    ("collect", "coordinator.session", "FleetSession.collect"),
    ("decode", "coordinator.engine", "RoundEngine._batch"),
    ("server step", "coordinator.server_trainer", "ServerTrainer.step"),
    ("encode", "sfl_core.wire.codec", "encode_tensor"),
    ("publish", "coordinator.session", "FleetSession.send_many"),
    ("aggregate", "coordinator.engine", "RoundEngine._aggregate"),
    ("evaluate", "coordinator.engine", "RoundEngine.evaluate"),
    ("checkpoint", "coordinator.state", "save"),
    ("screen rows", "coordinator.option_host", "OptionHost.screen_rows"),
)
"""``collect`` is taking messages off the network thread's queue: the replay guard, the
bookkeeping of who answered, heartbeats and registrations (its waits cost no CPU). ``screen
rows`` is the options' screens of each step's rows before the server step (the default
defense's, with its passes over held-out inputs); their screens of the round's updates count
in ``aggregate``."""
NETWORK_STAGES = (("parse/validate", "coordinator.mqtt_transport", "MqttTransport._on_message"),)
"""On paho's network thread: reassembly, envelope and schema checks, queueing. The thread's rest
is paho's own: reading packets, acknowledging them, writing what the engine published."""
ROUND = ("coordinator.engine", "RoundEngine.run_counted_round")

COLLECTOR = "garbage collection"
"""Python's garbage collector on the engine's thread (``gc.callbacks``), wherever a stage's
allocations set it off: it counts here, not in that stage."""

ENGINE_OTHER, NETWORK_OTHER, OTHER_THREADS = "engine other", "paho", "other threads"
STAGES = (*(s for s, _, _ in ENGINE_STAGES), COLLECTOR, ENGINE_OTHER, *(s for s, _, _ in NETWORK_STAGES), NETWORK_OTHER,
          OTHER_THREADS)
"""Every stage of the report, in order: the engine thread's, the network thread's, the rest."""


class Timers:
    """Exclusive thread CPU seconds per stage. Each thread keeps its own stack of open stages, so
    nesting is resolved per thread and the two busy threads never mix their figures."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._local = threading.local()

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)                 # CPU of the stages nested in this one
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - t0
                nested = stack.pop()
                if stack:
                    stack[-1] += spent
                self.seconds[stage] = self.seconds.get(stage, 0.0) + spent - nested
        return timed

    def collector(self, phase: str, info: dict[str, Any]) -> None:
        """A ``gc.callbacks`` entry: a collection on the main thread (the engine's) is a stage of
        its own, nested in whatever stage set it off; one on another thread stays in that thread's."""
        if threading.current_thread() is not threading.main_thread():
            return
        stack = self._local.__dict__.setdefault("stack", [])
        if phase == "start":
            stack.append(0.0)
            self._local.gc_t0 = time.thread_time()
            return
        spent = time.thread_time() - self._local.gc_t0
        nested = stack.pop()
        if stack:
            stack[-1] += spent
        self.seconds[COLLECTOR] = self.seconds.get(COLLECTOR, 0.0) + spent - nested


def _patch(module: str, path: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    owner: Any = __import__(module, fromlist=["_"])
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    setattr(owner, name, make(getattr(owner, name)))


def _thread_cpu(thread: threading.Thread) -> float:
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[arg-type]
    except (OSError, TypeError):   # ended meanwhile
        return 0.0


def snapshot(timers: Timers, main_cpu: float) -> dict[str, float]:
    """The running totals (seconds) of every stage in :data:`STAGES`: each thread's untimed rest
    from its own CPU clock; paho's network thread found by its name."""
    out = {s: timers.seconds.get(s, 0.0) for s in STAGES}
    out[ENGINE_OTHER] = main_cpu - sum(out[s] for s, _, _ in ENGINE_STAGES) - out[COLLECTOR]
    network = sum(_thread_cpu(t) for t in threading.enumerate() if t.name.startswith("paho-mqtt-client-"))
    out[NETWORK_OTHER] = network - sum(out[s] for s, _, _ in NETWORK_STAGES)
    out[OTHER_THREADS] = time.process_time() - main_cpu - network
    return out


def install(out: Path) -> None:
    """Wrap every stage, and write ``out`` at the end of every round."""
    timers = Timers()
    for stage, module, path in (*ENGINE_STAGES, *NETWORK_STAGES):
        _patch(module, path, functools.partial(timers.wrap, stage))
    gc.callbacks.append(timers.collector)
    rounds: list[dict[str, Any]] = []

    def at_round_end(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(engine: Any, r: int) -> Any:
            record = fn(engine, r)
            rounds.append({"round": r, "cpu_s": snapshot(timers, time.thread_time())})
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps({"stages": list(STAGES), "rounds": rounds}))
            os.replace(tmp, out)
            return record
        return counted

    _patch(*ROUND, at_round_end)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: stage_timers.py OUT.json serve [sfl-coord serve options]")
    install(Path(argv[0]))
    from cli.coord import app

    app(args=argv[1:], prog_name="sfl-coord")


if __name__ == "__main__":
    main(sys.argv[1:])
