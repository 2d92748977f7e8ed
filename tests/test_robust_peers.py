"""The bound against peers (``robust.peer_factor``): agents given the same assignment are held
to a tighter bound than the round's, computed by hand here through :meth:`Robust.screen`."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sfl_core.config.run import run_config_from_dict
from sfl_core.model.zoo import build_model
from sfl_core.options.robust.option import Robust, peer_key


class Host:
    """What :meth:`Robust.screen` uses of the round engine: a log and the quarantine."""

    def __init__(self):
        self.lines: list[str] = []

    def log(self, text, *, warning=False):
        self.lines.append(text)

    def quarantine(self, agent_id, why):
        self.lines.append(f"quarantined {agent_id}")


def assignment(batch: int = 16, split: int = 1):
    return SimpleNamespace(mode="split", split=split, width=0, batch_size=batch, tau=10, window=1, lr=0.1)


def screen(clients, assignments, **robust):
    option = Robust(run_config_from_dict({"model": "small_cnn", "min_agents": 2, "robust": robust}),
                    build_model("small_cnn", (1, 8, 8), 10))
    host = Host()
    kept, _ = option.screen(host, 1, {"w": torch.zeros(4)}, clients, {a: 1.0 for a in clients}, assignments, {})
    return sorted(kept), option.round_metrics(), host.lines


def change(rms: float):
    return {"w": torch.full((4,), rms)}   # every element moved by rms: its root mean square change


def test_peers_share_the_mode_cut_width_batch_steps_and_window():
    assert peer_key(assignment()) == peer_key(assignment())
    assert peer_key(assignment(batch=2)) != peer_key(assignment())
    assert peer_key(assignment(split=2)) != peer_key(assignment())


def test_a_change_five_times_its_peers_passes_the_rounds_bound_and_is_left_out_and_named_by_the_peers():
    clients = {"a": change(0.1), "b": change(0.1), "c": change(0.1), "d": change(0.1), "liar": change(0.5),
               "small-batch": change(0.8)}
    assignments = {a: assignment() for a in clients} | {"small-batch": assignment(batch=2)}
    # the round's typical change is the median of six, 0.1: the liar is 5x it and the small-batch
    # device 8x it, both under the round's bound of 10x; the liar's peers' median is 0.1 too, and
    # 5x is over their bound of 3x; the small-batch device has no peers, so only the round's bound holds it
    kept, metrics, lines = screen(clients, assignments)
    assert kept == ["a", "b", "c", "d", "small-batch"]
    assert "clipped" not in metrics and metrics["clipped_by_peers"] == {"liar": 5.0}
    assert any("liar (5x)" in line and "its peers" in line for line in lines), lines
    kept, metrics, _ = screen(clients, assignments, peer_factor=0)   # off: the round's bound alone
    assert kept == sorted(clients) and "clipped_by_peers" not in metrics


def test_fewer_than_five_peers_are_not_compared():
    clients = {"a": change(0.1), "b": change(0.1), "c": change(0.1), "liar": change(0.5), "x": change(0.1)}
    assignments = {a: assignment() for a in clients} | {"x": assignment(batch=2)}
    kept, metrics, _ = screen(clients, assignments)   # four peers: the median of so few is not steady
    assert kept == sorted(clients) and "clipped_by_peers" not in metrics
