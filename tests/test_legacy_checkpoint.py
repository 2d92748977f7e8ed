"""A checkpoint written by an earlier release resumes, and resumes to the same history.

The folders under ``tests/data/checkpoints`` were written before the code was re-laid out
(their README names the commit). Resuming a copy to 4 rounds must give the history that the old
code gave, host-time fields aside: the on-disk format and the engine's behaviour are unchanged
(but for a planner's deliberate change, which :data:`PLANNED_DIFFERENTLY` names, from the
round after the one the checkpoint's own state plans).
On the CPU that wrote the reference it is the same to the bit. Another CPU's float kernels
change the weights' last bits, and with them the compressed sizes of what is sent (and the
transfer times computed from them) by well under 0.1 %: numbers may differ by 0.2 %, which
still holds every accuracy to the same count of correct samples; every round, selection,
group and plan must be the same.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest

from simulation import run_simulation
from sfl_core.config.run import default_profiles_dir, load_run_config

DATA = Path(__file__).parent / "data" / "checkpoints"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from identical import canonical, first_difference, without_keys  # noqa: E402


@pytest.mark.parametrize("name", ["demo", "heterosfl-demo"])
def test_a_checkpoint_from_before_the_relayout_resumes_to_the_same_history(tmp_path: Path, name: str) -> None:
    out = tmp_path / name
    shutil.copytree(DATA / name, out)
    expected = json.loads((out / "expected-after-resume.json").read_text())
    cfg = load_run_config(default_profiles_dir() / "runs" / f"{name}.yaml")
    # the server mode the old release trained with: auto now decides the sequential copy on these
    # fleets (docs/methods/auto.md), which is not what the checkpoint's rounds were trained with
    cfg = dataclasses.replace(cfg, rounds=4, output_dir=str(out), server_mode="merged")
    history, _ = run_simulation(cfg, resume=True, device="cpu")
    # less what this release adds to every round: auto's decisions on the training options
    # (all off on these fleets, so the training is the old release's)
    got = json.loads(json.dumps(without_keys(canonical(history), {"learning"})))
    assert [r["round"] for r in got] == [r["round"] for r in expected]
    if name in PLANNED_DIFFERENTLY:
        # the round planned from the checkpoint's own state is the old release's; the next
        # follows this release's planner: the same agents, groups, cuts and codecs
        *expected, last = expected
        *got, now = got
        assert (now["selected"], now["groups"], _cuts(now)) == (last["selected"], last["groups"], _cuts(last))
    difference = first_difference(expected, got, rel=2e-3)
    assert not difference, difference


PLANNED_DIFFERENTLY = {"demo"}
"""Fleets whose last round auto plans differently since the link factor stopped counting the
codec's ratio a second time (docs/methods/auto.md, "It adapts"): the demo's, whose fp16 the wire
compresses past its nominal half. Its batches after the resumed round differ from the old
release's (its round is shorter)."""


def _cuts(record: dict) -> dict:
    return {a: (v["split"], v["codec"]) for a, v in record["auto"]["assign"].items()}
