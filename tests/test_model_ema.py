"""``model_ema``: the average over rounds of the global model that a run delivers.

The arithmetic by hand; through the engine, that training is untouched, that the checkpointed
average is the hand-computed average of the rounds' global models, that a resumed run continues
it, and that evaluation, federated evaluation and export all use it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from coordinator import evaluation
from coordinator import state as ckpt
from coordinator.export import load_global_model
from sfl_core.options.model_ema.average import STATE_PREFIX, ModelAverage, delivered_weights
from sfl_core.options.model_ema.config import ModelEmaConfig
from sfl_core.options.model_ema.option import ModelEma
from sfl_core.config.fields import ConfigError
from sfl_core.config.run import default_profiles_dir, load_run_config, run_config_from_dict
from sfl_core.options.base import split_state
from simulation import run_simulation

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from identical import canonical  # noqa: E402


def test_the_average_by_hand():
    avg = ModelAverage(0.75)
    states = [{"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(1)},
              {"w": torch.tensor([0.0, 0.0]), "n": torch.tensor(2)},
              {"w": torch.tensor([8.0, 4.0]), "n": torch.tensor(3)}]
    avg.update(states[0])
    assert torch.equal(avg.tensors["w"], torch.tensor([4.0, 8.0]))      # the first round: the model itself
    avg.update(states[1])
    assert torch.allclose(avg.tensors["w"], torch.tensor([3.0, 6.0]))   # 0.75·a + 0.25·x
    avg.update(states[2])
    assert torch.allclose(avg.tensors["w"], torch.tensor([4.25, 5.5]))
    state = avg.state({"w": torch.zeros(2), "n": torch.tensor(7), "new": torch.ones(1)})
    assert torch.allclose(state["w"], torch.tensor([4.25, 5.5]))
    assert int(state["n"]) == 7 and torch.equal(state["new"], torch.ones(1))   # integers and unknowns: current
    states[2]["w"].add_(100)
    assert torch.allclose(avg.tensors["w"], torch.tensor([4.25, 5.5]))   # holds copies, not the model's tensors


def test_the_state_round_trips_and_the_checkpoint_delivers_the_average():
    avg = ModelAverage(0.5)
    avg.update({"w": torch.tensor([2.0]), "b": torch.tensor([1.0])})
    avg.update({"w": torch.tensor([4.0]), "b": torch.tensor([3.0])})
    saved = avg.state_tensors()
    assert set(saved) == {f"{STATE_PREFIX}w", f"{STATE_PREFIX}b"}
    again = ModelAverage(0.5)
    again.load_state_tensors({**saved, "@server_opt/m/w": torch.zeros(1), "w": torch.zeros(1)})
    assert set(again.tensors) == {"w", "b"} and torch.equal(again.tensors["w"], torch.tensor([3.0]))
    model = {"w": torch.tensor([4.0]), "b": torch.tensor([3.0]), "steps": torch.tensor(5)}
    weights = delivered_weights(*split_state({**model, **saved}))
    assert torch.equal(weights["w"], torch.tensor([3.0])) and torch.equal(weights["b"], torch.tensor([2.0]))
    assert int(weights["steps"]) == 5
    assert delivered_weights(model) == model   # a run without the average delivers its model


@pytest.mark.parametrize("decay", [0.0, 1.0])
def test_the_average_refuses_a_decay_that_averages_nothing(decay):
    with pytest.raises(ValueError, match="model_ema"):
        ModelAverage(decay)


@pytest.mark.parametrize("bad", [1.0, -0.1, "x"])
def test_the_config_refuses_a_decay_outside_0_1(bad):
    with pytest.raises(ConfigError, match="model_ema"):
        run_config_from_dict({"run": "x", "fleet": [{"profile": "rpi4", "count": 1}], "model_ema": bad}, "run.yaml")
    assert run_config_from_dict({"run": "x", "fleet": [{"profile": "rpi4", "count": 1}], "model_ema": 0.8},
                                "run.yaml").sections["model_ema"].decay == 0.8


def _demo(tmp_path: Path, name: str, rounds: int, decay: float = 0.5, **kw):
    cfg = load_run_config(default_profiles_dir() / "runs" / "demo.yaml")
    cfg = dataclasses.replace(cfg, rounds=rounds, output_dir=str(tmp_path / name), strategy="sfl", **kw)
    return ModelEmaConfig.of(cfg).replace_in(cfg, decay=decay)   # auto plans for the rounds left: stepwise would differ


def test_through_the_engine_the_run_delivers_the_average_of_its_rounds_models(tmp_path, monkeypatch):
    """The rounds' global models M1, M2, M3 (as the engine hands them over); the run's average at
    decay 0.5 is ¼ M1 + ¼ M2 + ½ M3, its training is the plain run's, and what it scores and
    exports is the average."""
    seen = []
    update = ModelAverage.update

    def spy(self, state):
        seen.append({k: v.detach().clone() for k, v in state.items()})
        update(self, state)

    monkeypatch.setattr(ModelAverage, "update", spy)
    cfg = _demo(tmp_path, "averaged", 3)
    history, engine = run_simulation(cfg, device="cpu")
    _, plain = run_simulation(_demo(tmp_path, "plain", 3, decay=0.0), device="cpu")
    model = engine.model.state_dict()
    assert all(torch.equal(model[k], t) for k, t in plain.model.state_dict().items())   # training is untouched
    assert len(seen) == 3 and all(torch.equal(seen[-1][k], t) for k, t in model.items())

    tensors, _ = ckpt.load(Path(cfg.output_dir))
    saved, own = split_state(tensors)
    averaged = [k for k, t in saved.items() if t.is_floating_point()]
    assert averaged and set(own) == {STATE_PREFIX + k for k in saved}
    for k in averaged:
        expected = 0.25 * seen[0][k] + 0.25 * seen[1][k] + 0.5 * seen[2][k]
        assert torch.allclose(own[STATE_PREFIX + k], expected, atol=1e-6), k
        assert torch.equal(saved[k], model[k])   # the checkpoint keeps the trained model beside the average

    delivered, _ = load_global_model(Path(cfg.output_dir))
    accuracy, loss = engine.validation.evaluate(delivered, "cpu", 256)
    assert accuracy == history[-1]["accuracy"] and loss == pytest.approx(history[-1]["test_loss"], rel=1e-6)
    assert engine.validation.evaluate(engine.model, "cpu", 256)[1] != loss   # not the last round's model


def test_a_resumed_run_continues_the_average(tmp_path, monkeypatch):
    first = _demo(tmp_path, "resumed", 2)
    run_simulation(first, device="cpu")
    before, _ = ckpt.load(Path(first.output_dir))
    _, again = run_simulation(dataclasses.replace(first, rounds=3), device="cpu", resume=True)
    after = again.model.state_dict()
    for k, t in after.items():
        if t.is_floating_point():
            expected = 0.5 * before[STATE_PREFIX + k] + 0.5 * t
            assert torch.allclose(again.option(ModelEma).average.tensors[k], expected, atol=1e-6), k


def test_federated_evaluation_scores_the_average(tmp_path, monkeypatch):
    sent = []
    real = evaluation.request_body

    def spy(model, *args, **kwargs):
        sent.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(evaluation, "request_body", spy)
    cfg = _demo(tmp_path, "federated", 2)
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, federated_every=1))
    _, engine = run_simulation(cfg, device="cpu")
    assert len(sent) == 2
    averaged = engine.option(ModelEma).average.state(engine.model.state_dict())
    assert all(torch.equal(sent[-1][k], averaged[k].cpu()) for k in averaged)
    assert any(not torch.equal(sent[-1][k], v) for k, v in engine.model.state_dict().items()
               if v.is_floating_point())
