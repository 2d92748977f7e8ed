"""A user's own model without writing a SplitModel: a plain ``nn.Sequential`` (each child a
block, every boundary a split), or a module listing its ``blocks``, trains through the same
engine, is costed like the zoo, and anything else is refused in one line."""

from __future__ import annotations

import pytest
import torch.nn as nn

from simulation import run_simulation
from sfl_core.model import zoo as models
from sfl_core.model.accounting import model_costs
from sfl_core.config.run import run_config_from_dict


def _sequential(input_shape, num_classes, *, width=1.0, norm="batch"):
    c = input_shape[0]
    return nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * input_shape[1] * input_shape[2], 64), nn.ReLU(), nn.Linear(64, num_classes))


class _Listed(nn.Module):
    def __init__(self, input_shape, num_classes, **_):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Flatten(), nn.Linear(input_shape[1] * input_shape[2], 32),
                                     nn.Linear(32, num_classes)])


@pytest.fixture
def user_models():
    models.register_model("user_seq", _sequential, replace=True)
    models.register_model("user_listed", _Listed, replace=True, norms=False)
    models.register_model("user_bad", lambda shape, n, **_: nn.Linear(3, n), replace=True)
    yield
    for name in ("user_seq", "user_listed", "user_bad"):
        models._BUILDERS.pop(name, None)
        models._NATIVE_NORM.pop(name, None)


def test_a_plain_sequential_trains_split_at_every_boundary(tmp_path, user_models):
    m = models.build_model("user_seq", (1, 8, 8), 10)
    # the default cut follows the Linear that reduces 1,024 features to 64 (not the middle, 3)
    assert m.num_blocks == 6 and m.split_points == (1, 2, 3, 4, 5) and m.default_split == 4
    assert m.block_names[0] == "0:Conv2d"
    costs = model_costs("user_seq", (1, 8, 8), 10)
    assert costs[3].activation_shape == (1024,) and costs[3].client_flops > 0
    cfg = run_config_from_dict({"run": "seq", "model": "user_seq", "data": {"dataset": "digits"},
                                "fleet": [{"profile": "s2fl-low-low", "count": 3}], "rounds": 3, "strategy": "sfl",
                                "split": 3, "batch_size": 16, "local_iters": 10, "lr": 0.05,
                                "output_dir": str(tmp_path / "out")})
    history, _ = run_simulation(cfg)
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.3, [h["accuracy"] for h in history]
    assert all(a["split"] == 3 for a in history[-1]["agents"].values())


def test_a_module_listing_its_blocks_and_anything_else(user_models):
    m = models.build_model("user_listed", (1, 8, 8), 10)
    assert m.num_blocks == 3 and m.split_points == (1, 2)
    with pytest.raises(ValueError, match=r"model 'user_bad': its builder returned a Linear, not a SplitModel, an "
                                         r"nn.Sequential or a module with a 'blocks' list"):
        models.build_model("user_bad", (1, 8, 8), 10)


def test_the_default_cut_of_a_flat_sequential_comes_after_a_reduction():
    """Issue 63 item 7: the middle of a flat nn.Sequential fell between a ReLU and its MaxPool
    (four times the bytes of the cut after the pool); the default now prefers the boundary
    nearest the middle that follows a reduction, and keeps the middle where none does."""
    from torch import nn

    from sfl_core.model.zoo import as_split_model

    flat = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
    model = as_split_model("flat", flat, (1, 28, 28), 10)
    assert model.default_split == 3                     # after the first MaxPool, not the middle (4)
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert as_split_model("plain", plain, (8,), 4).default_split == 2   # no reduction: the middle
    assert flat[0].training and flat[7].training          # the probe left the modules' modes as they were
