"""A user's own model and data set plug in without a fork: by a call, or by an installed
package's entry points, and then run through the same engine as the zoo's."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from torch import nn

from sfl_core.data import builtin as data_mod
from sfl_core.model import zoo as models_mod
from sfl_core.data.builtin import DatasetError, load_dataset, register_dataset
from sfl_core.model.zoo import SplitModel, build_model, register_model


def tiny_mlp(input_shape, num_classes, *, width=1.0, norm="none"):
    hidden = max(1, int(32 * width))
    blocks = [nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), hidden), nn.ReLU()),
              nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()), nn.Linear(hidden, num_classes)]
    return SplitModel("tiny_mlp", blocks, [1, 2], 1, tuple(input_shape), num_classes, block_names=["in", "mid", "out"])


def stripes(root):
    """Two classes of 4x4 images: a bright row or a bright column, with noise."""
    rng = np.random.default_rng(0)

    def make(n):
        y = rng.integers(0, 2, n)
        x = rng.integers(0, 60, (n, 1, 4, 4))
        for i, c in enumerate(y):
            k = rng.integers(0, 4)
            if c:
                x[i, 0, k, :] += 180
            else:
                x[i, 0, :, k] += 180
        return x.astype(np.uint8), y
    return (*make(400), *make(100))


@pytest.fixture
def clean_registries():
    builders, norms = dict(models_mod._BUILDERS), dict(models_mod._NATIVE_NORM)
    from sfl_core.model import zoo
    cands = dict(zoo.CANDIDATE_SPLITS)
    plugins = dict(data_mod._PLUGINS)
    yield
    models_mod._BUILDERS.clear(), models_mod._BUILDERS.update(builders)
    models_mod._NATIVE_NORM.clear(), models_mod._NATIVE_NORM.update(norms)
    zoo.CANDIDATE_SPLITS.clear(), zoo.CANDIDATE_SPLITS.update(cands)
    data_mod._PLUGINS.clear(), data_mod._PLUGINS.update(plugins)
    data_mod.clear_cache()


def test_registered_model_and_data_set_train_through_the_engine(tmp_path, clean_registries):
    from simulation import run_simulation
    from sfl_core.config.run import load_run_config

    register_model("tiny_mlp", tiny_mlp, candidate_splits=[1, 2], norms=False)
    register_dataset("stripes", stripes, num_classes=2, input_shape=(1, 4, 4))
    ds = load_dataset("stripes")
    assert ds.num_classes == 2 and ds.input_shape == (1, 4, 4) and ds.preprocessing["scale"] == 255.0
    assert abs(float(ds.x_train.mean())) < 1e-4                       # standardised like the built-in sets
    assert build_model("tiny_mlp:width=0.5", (1, 4, 4), 2).name == "tiny_mlp:width=0.5"
    with pytest.raises(ValueError, match="already registered"):
        register_model("tiny_mlp", tiny_mlp)
    with pytest.raises(ValueError, match="no normalisation"):
        build_model("tiny_mlp:norm=group", (1, 4, 4), 2)

    cfg = {"run": "plug", "model": "tiny_mlp", "data": {"dataset": "stripes", "partition": "iid"},
           "fleet": [{"profile": "s2fl-high-high", "count": 2}], "rounds": 3, "strategy": "s2fl",
           "batch_size": 16, "lr": 0.1, "momentum": 0.9, "local_iters": 10, "output_dir": str(tmp_path / "run")}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    history, _ = run_simulation(load_run_config(tmp_path / "run.yaml"), device="cpu")
    assert history[-1]["accuracy"] > 0.8, [h["accuracy"] for h in history]


def test_bad_plugins_are_refused_with_their_name(clean_registries):
    register_dataset("floats", lambda root: (np.zeros((4, 1, 2, 2)), np.zeros(4, int), np.zeros((2, 1, 2, 2)),
                                             np.zeros(2, int)))
    with pytest.raises(DatasetError, match="'floats': x_train must be non-negative integers"):
        load_dataset("floats")
    register_dataset("labels", lambda root: (np.zeros((4, 1, 2, 2), np.uint8), np.full(4, 12), np.zeros((2, 1, 2, 2), np.uint8),
                                             np.zeros(2, int)))
    with pytest.raises(DatasetError, match="class indices in 0..9"):
        load_dataset("labels")
    with pytest.raises(DatasetError, match="already registered"):
        register_dataset("mnist", stripes)
    with pytest.raises(ValueError, match="lower-case"):
        register_model("Bad Name", tiny_mlp)


def test_entry_points_register_on_first_use(tmp_path, monkeypatch, clean_registries):
    """An installed package declares `sfl_edge.models` / `sfl_edge.datasets` entry points; the
    first lookup of an unknown name loads them (a broken one is skipped, not fatal)."""
    (tmp_path / "my_plugin.py").write_text(textwrap.dedent('''
        import numpy as np
        from torch import nn
        from sfl_core.model.zoo import SplitModel

        def wide(input_shape, num_classes, *, width=1.0, norm="batch"):
            n = int(np.prod(input_shape))
            return SplitModel("wide", [nn.Sequential(nn.Flatten(), nn.Linear(n, 8)), nn.Linear(8, num_classes)],
                              [1], 1, tuple(input_shape), num_classes)
        wide.candidate_splits = (1,)

        def blobs(root):
            rng = np.random.default_rng(1)
            return (rng.integers(0, 9, (20, 1, 3, 3)).astype(np.uint8), rng.integers(0, 3, 20),
                    rng.integers(0, 9, (5, 1, 3, 3)).astype(np.uint8), rng.integers(0, 3, 5))
        blobs.num_classes = 3
        blobs.scale = 8.0
    '''))
    dist = tmp_path / "my_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[sfl_edge.models]\nwide = my_plugin:wide\nbroken = my_plugin:nothing\n\n"
                                           "[sfl_edge.datasets]\nblobs = my_plugin:blobs\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from sfl_core import plugins
    monkeypatch.setattr(plugins, "_loaded", set())
    m = build_model("wide", (1, 3, 3), 3)
    assert m.num_blocks == 2 and "wide" in models_mod.model_names() and "broken" not in models_mod.model_names()
    from sfl_core.model.zoo import candidate_splits
    assert candidate_splits("wide") == (1,)
    ds = load_dataset("blobs")
    assert ds.num_classes == 3 and ds.preprocessing["scale"] == 8.0 and "blobs" in data_mod.dataset_names()
    sys.modules.pop("my_plugin", None)
