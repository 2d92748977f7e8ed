"""The objects a coordinator is set up with are left out of the garbage collector's passes
(:mod:`coordinator.garbage_collection`): a full collection after set-up walks only what the run
makes, and what the run makes is still collected."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest
import yaml
from typer.testing import CliRunner

import cli.coord.run as coord_run
from cli.coord import app as coord_app
from coordinator.api import RunError

# a fresh process set up as the coordinator is (its imports), then: a full collection's CPU time,
# before and after sparing the startup's objects; and whether a cycle made after it is collected
_FULL_PASS = textwrap.dedent("""
    import gc, time, weakref
    import cli.coord.run   # noqa: F401  (what sfl-coord serve imports)
    from coordinator.garbage_collection import spare_startup_objects

    def full_pass_s():
        gc.collect()
        best = float("inf")
        for _ in range(5):
            t0 = time.process_time()
            gc.collect()
            best = min(best, time.process_time() - t0)
        return best

    class Node:
        pass

    before = full_pass_s()
    frozen = spare_startup_objects()
    after = full_pass_s()
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    print(frozen, before, after, gone() is None)
""")


def test_a_full_collection_after_set_up_leaves_the_startups_objects_out_and_still_collects_new_cycles():
    out = subprocess.run([sys.executable, "-c", _FULL_PASS], capture_output=True, text=True, check=True)
    frozen, before, after, collected = out.stdout.split()
    assert int(frozen) > 50_000, f"only {frozen} objects spared: the coordinator's imports make far more"
    assert float(after) < float(before) / 4, f"a full pass took {after} s after, {before} s before"
    assert collected == "True", "a reference cycle made after set-up was not collected"


@pytest.mark.parametrize("command, runner", [("simulate", "run_simulation"), ("serve", "serve_run"),
                                             ("demo", "serve_run")])
def test_serve_simulate_and_demo_spare_the_startups_objects_before_the_run(tmp_path, monkeypatch, command, runner):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"run": "gc", "model": "small_cnn", "data": {"dataset": "digits"},
                                    "fleet": [{"profile": "s2fl-low-low", "count": 2}], "rounds": 1,
                                    "strategy": "sfl", "output_dir": str(tmp_path / "out")}))
    seen = []

    def run(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        raise RunError("stopped by the test before the run")

    monkeypatch.setattr(coord_run, runner, run)
    gc.unfreeze()
    try:
        result = CliRunner().invoke(coord_app, [command, "-c", str(path), *(["--quiet"] if command != "demo" else [])])
    finally:
        gc.unfreeze()   # this test process collects as before
    assert result.exit_code == 2, result.output
    assert seen and seen[0] > 0, "the run started with nothing spared"
