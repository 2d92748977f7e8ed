"""The bound against peers (``robust.peer_factor``): agents given the same assignment are held
to a tighter bound than the round's, computed by hand here through :meth:`Robust.screen`."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sfl_core.config.run import run_config_from_dict
from sfl_core.model.zoo import build_model
from sfl_core.options.robust.option import Robust, change_scale, peer_key


class Host:
    """What :meth:`Robust.screen` uses of the round engine: a log, the quarantine and the fleet
    (nobody registered: the weight cap's median is the round's)."""

    def __init__(self):
        self.lines: list[str] = []
        self.fleet: dict = {}

    def log(self, text, *, warning=False):
        self.lines.append(text)

    def quarantine(self, agent_id, why):
        self.lines.append(f"quarantined {agent_id}")


def assignment(batch: int = 16, split: int = 1, lr: float = 0.1):
    return SimpleNamespace(mode="split", split=split, width=0, batch_size=batch, tau=10, window=1, lr=lr)


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


def test_the_rounds_bound_measures_a_change_over_its_learning_rate_and_the_root_of_its_batch():
    """The demo's case: the joint planner gives slow devices a batch of 2 and a learning rate
    scaled with it; per unit of learning rate their honest changes (mostly their gradients'
    noise) are 12 times those of devices given 30. Over the root of the batch too, 3.1 times:
    they stay in, and one of them scaled x10 is left out."""
    big, small = assignment(batch=30, lr=0.1), assignment(batch=2, lr=0.1 * 2 / 30)
    assert change_scale(big) == 0.1 / 30 ** 0.5
    # big devices: 1.0 per unit of learning rate; small ones 12
    clients = {"a": change(0.1), "b": change(0.1), "s1": change(12 * small.lr), "s2": change(12 * small.lr)}
    assignments = {"a": big, "b": big, "s1": small, "s2": small}
    kept, metrics, _ = screen(clients, assignments)
    assert kept == ["a", "b", "s1", "s2"] and "clipped" not in metrics
    # per change scale: big 0.1 / 0.01826 = 5.48, small 0.08 / 0.004714 = 16.97 (3.1x the
    # round's typical, the lower median of the four); scaled x10, 169.7: 31x
    clients["s2"] = change(120 * small.lr)
    kept, metrics, _ = screen(clients, assignments)
    assert kept == ["a", "b", "s1"] and round(metrics["clipped"]["s2"], 1) == 31.0
