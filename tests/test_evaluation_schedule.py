"""``eval_every`` and the round's host times: a round scored on the server's validation set
records its accuracy and the seconds that took (``eval_s``); the rounds ``eval_every`` skips
record none; ``wall_s`` covers the whole round, evaluation included; training is untouched."""

from __future__ import annotations

import dataclasses

from sfl_core.config.run import run_config_from_dict
from simulation import run_simulation


def _cfg(tmp_path, **over):
    return run_config_from_dict({
        "run": "ev", "model": "small_cnn", "data": {"dataset": "digits"},
        "fleet": [{"profile": "s2fl-low-low", "count": 2}, {"profile": "s2fl-high-high", "count": 1}],
        "rounds": 5, "strategy": "sfl", "split": 2, "batch_size": 8, "local_iters": 2,
        "output_dir": str(tmp_path / "out"), **over})


def test_every_third_round_and_the_last_are_scored_and_training_is_the_same(tmp_path):
    every, _ = run_simulation(_cfg(tmp_path, eval_every=1), device="cpu")
    third, _ = run_simulation(dataclasses.replace(_cfg(tmp_path, eval_every=3), output_dir=str(tmp_path / "b")),
                              device="cpu")
    scored = [m["round"] for m in third if m["accuracy"] is not None]
    assert scored == [0, 3, 5]                     # the untrained model, every 3rd round, the last
    for a, b in zip(every, third):
        assert a["train_loss"] == b["train_loss"] and a["bytes_up"] == b["bytes_up"]
        if b["accuracy"] is not None:
            assert a["accuracy"] == b["accuracy"] and a["test_loss"] == b["test_loss"]
        else:
            assert b["test_loss"] is None
    for m in every[1:]:
        assert m["eval_s"] > 0 and m["wall_s"] >= m["eval_s"]
    skipped = [m for m in third if m["accuracy"] is None]
    assert all(m["eval_s"] < min(e["eval_s"] for e in every[1:]) for m in skipped)
