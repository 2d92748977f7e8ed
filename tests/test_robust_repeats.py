"""A row sent twice is trained on once (``robust.repeated_rows: once``): found by equality, the
server's step trains on each (row, label) pair once and every copy gets the gradient it would
have got; a device holding fewer samples than its batch weighs by its samples."""

from __future__ import annotations

import copy

import torch

from coordinator.server_trainer import ServerTrainer
from sfl_core.config.run import run_config_from_dict
from sfl_core.model.zoo import build_model
from sfl_core.options.base import RowsTrained
from sfl_core.options.robust.repeats import repeats
from simulation import run_simulation


def test_repeats_keeps_each_pairs_first_row_and_says_where_each_row_takes_its_gradient():
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.5]), torch.tensor([0.0, 3.0])
    rows = torch.stack([a, b, a, c, b, a])
    found = repeats(rows, torch.tensor([0, 1, 0, 2, 1, 1]))   # the last a has another label: not a repeat
    assert found is not None
    assert found.kept.tolist() == [0, 1, 3, 5]
    assert found.source.tolist() == [0, 1, 0, 2, 1, 3]
    assert torch.equal(found.take(rows), torch.stack([a, b, c, a]))
    assert repeats(rows[:4], torch.tensor([0, 1, 1, 2])) is None      # same row, other label
    assert repeats(torch.stack([a, b]), torch.tensor([0, 0])) is None
    assert repeats(rows[:1], torch.tensor([0])) is None
    # same peak, same label, different rows: compared row by row, not a repeat
    assert repeats(torch.stack([a, torch.tensor([2.0, 1.0])]), torch.tensor([4, 4])) is None


def test_rows_trained_spread_and_compose_by_hand():
    rows = RowsTrained(torch.tensor([0, 1, 3]), torch.tensor([0, 1, 0, 2]))
    grad = torch.tensor([[3.0], [6.0], [9.0]])      # of the 3 rows kept
    assert rows.spread(grad).flatten().tolist() == [2.25, 4.5, 2.25, 6.75]   # x 3/4, each copy its source's
    then = rows.then(RowsTrained(torch.tensor([0, 2]), torch.tensor([0, 0, 1])))   # of the kept, 0 and 1 alike
    assert then.kept.tolist() == [0, 3] and then.source.tolist() == [0, 0, 0, 1]
    assert then.spread(torch.tensor([[4.0], [8.0]])).flatten().tolist() == [2.0, 2.0, 2.0, 4.0]


def _trainer() -> ServerTrainer:
    torch.manual_seed(0)
    trainer = ServerTrainer(build_model("small_cnn", (1, 8, 8), 3), lr=0.1)
    trainer.begin_round([["a", "b"]], {"a": 2, "b": 2})
    return trainer


def test_a_step_trains_a_repeated_row_once_and_each_copy_gets_the_gradient_it_would_have():
    """Agent a sends x1, x2, x1, x1 (a sampler wrapping two images); b sends two rows. Trained
    once, a weighs 2 of the step's 4 rows (as sent, 4 of 6), and its gradients are those of its
    mean loss over what it sent at the step's starting weights, as sent."""
    torch.manual_seed(1)
    trainer = _trainer()
    shape = trainer.model.client(2)(torch.randn(1, 1, 8, 8)).shape[1:]
    x = torch.randn(2, *shape)
    xa, ya = x[[0, 1, 0, 0]], torch.tensor([0, 2, 0, 0])
    xb, yb = torch.randn(2, *shape), torch.tensor([1, 1])
    as_sent, once, by_hand = trainer, copy.deepcopy(trainer), copy.deepcopy(trainer)
    g_sent, _ = as_sent.step({"a": (xa, ya), "b": (xb, yb)})
    found = repeats(xa, ya)
    assert found is not None and found.kept.tolist() == [0, 1]
    g_once, _ = once.step({"a": (found.take(xa), found.take(ya)), "b": (xb, yb)})
    assert torch.allclose(found.spread(g_once["a"]), g_sent["a"], atol=1e-6)
    assert torch.equal(found.spread(g_once["a"])[0], found.spread(g_once["a"])[3])
    # the server's layers took the step of the distinct rows: a weighs its two images
    by_hand.step({"a": (x, torch.tensor([0, 2])), "b": (xb, yb)})
    for p, q, r in zip(once.member_state("a", 2).values(), by_hand.member_state("a", 2).values(),
                       as_sent.member_state("a", 2).values()):
        assert torch.equal(p, q)
    assert any(not torch.equal(p, r) for p, r in zip(once.member_state("a", 2).values(),
                                                     as_sent.member_state("a", 2).values()))


def test_the_server_step_trains_a_small_devices_images_once_by_default(tmp_path, monkeypatch):
    """On the digits split by Dirichlet 0.1 over ten devices given batches of 64, devices holding
    fewer samples than a batch wrap around their data: by default no step trains on a row
    twice, and such a device weighs its images; ``repeated_rows: each`` trains on every row
    sent. The devices' gradients come back row for row either way."""
    seen: list[dict[str, tuple[int, int]]] = []
    step = ServerTrainer.step

    def watched(self, batches, exchange=None):
        counts = {}
        for a, (x, y) in batches.items():
            found = repeats(x.cpu(), y.cpu())
            counts[a] = (len(x), len(x) if found is None else len(found.kept))
        seen.append(counts)
        grads, loss = step(self, batches, exchange)
        return grads, loss

    monkeypatch.setattr(ServerTrainer, "step", watched)

    def run(name: str, **robust):
        seen.clear()
        spec = {"run": "repeats", "model": "small_cnn", "strategy": "sfl", "server_mode": "merged",
                "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.1}, "seed": 3,
                "fleet": [{"profile": "s2fl-mid-mid", "count": 10}], "rounds": 2, "batch_size": 64, "lr": 0.05,
                "local_iters": 3, "robust": robust, "output_dir": str(tmp_path / name)}
        history, _ = run_simulation(run_config_from_dict(spec), device="cpu")
        return history, list(seen)

    history_once, once = run("once")
    history_each, each = run("each", repeated_rows="each")
    assert once and each
    assert all(n == distinct for step_ in once for n, distinct in step_.values())
    steps = {a: [counts for step_ in each for b, counts in step_.items() if b == a] for s in each for a in s}
    small = {a for a, counts in steps.items() if all(distinct < n for n, distinct in counts)}
    assert small   # the split holds devices of fewer samples than a batch: every step of theirs repeats
    assert all(n < 64 for step_ in once for a, (n, _) in step_.items() if a in small)   # they weigh their images
    assert history_once[-1]["accuracy"] != history_each[-1]["accuracy"] or history_once[-1]["loss"] != \
        history_each[-1]["loss"]
