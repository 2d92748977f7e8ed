"""Server optimisers (``server_opt:``): FedAvgM, FedAdam and FedYogi on the aggregated client portion.

The updates by hand; plain aggregation as FedAvgM's special case, through the real engine; the
optimiser's state checkpointed with the model and continued on resume; the config refuses what
the optimisers cannot use.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from coordinator import state as ckpt
from coordinator.export import load_global_model
from sfl_core.config.fields import ConfigError
from sfl_core.config.run import default_profiles_dir, load_run_config, run_config_from_dict
from sfl_core.options.base import split_state
from sfl_core.options.server_opt.config import ServerOptConfig
from sfl_core.options.server_opt.option import ServerOpt
from sfl_core.options.server_opt.optimiser import STATE_PREFIX, ServerOptimizer, averaged_names
from simulation import run_simulation

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from identical import canonical  # noqa: E402


def test_fedavgm_by_hand():
    opt = ServerOptimizer("momentum", lr=0.5, beta1=0.9)
    x = {"w": torch.tensor([1.0, 2.0])}
    new = opt.step(x, {"w": torch.tensor([2.0, 0.0])}, ["w"])    # Δ = [1, -2]; v = Δ; x + 0.5 v
    assert torch.allclose(new["w"], torch.tensor([1.5, 1.0]))
    new2 = opt.step(new, {"w": torch.tensor([1.5, 2.0])}, ["w"])  # Δ = [0, 1]; v = 0.9 [1, -2] + [0, 1]
    assert torch.allclose(new2["w"], torch.tensor([1.5 + 0.5 * 0.9, 1.0 + 0.5 * (-1.8 + 1.0)]))


def test_fedavgm_without_momentum_at_lr_1_is_the_average():
    opt = ServerOptimizer("momentum", lr=1.0, beta1=0.0)
    x = {"w": torch.randn(5), "bn.running_mean": torch.zeros(3)}
    agg = {"w": torch.randn(5), "bn.running_mean": torch.ones(3)}
    new = opt.step(x, agg, ["w"])
    assert torch.allclose(new["w"], agg["w"]) and new["bn.running_mean"] is agg["bn.running_mean"]


@pytest.mark.parametrize("kind", ["adam", "yogi"])
def test_fedadam_and_fedyogi_by_hand(kind):
    tau, b1, b2, lr = 1e-3, 0.9, 0.99, 0.1
    opt = ServerOptimizer(kind, lr=lr, beta1=b1, beta2=b2, tau=tau)
    d = 0.5
    new = opt.step({"w": torch.tensor([0.0])}, {"w": torch.tensor([d])}, ["w"])
    m = (1 - b1) * d
    v0 = tau ** 2
    v = b2 * v0 + (1 - b2) * d * d if kind == "adam" else v0 - (1 - b2) * d * d * math.copysign(1, v0 - d * d)
    assert new["w"].item() == pytest.approx(lr * m / (math.sqrt(v) + tau), rel=1e-5)
    assert kind == "adam" or v > b2 * v0 + (1 - b2) * d * d - 1e-12   # yogi's second moment: v0 + (1-b2)Δ²


def test_the_state_round_trips_and_skips_model_tensors():
    opt = ServerOptimizer("adam", lr=0.1)
    opt.step({"a.w": torch.zeros(2)}, {"a.w": torch.ones(2)}, ["a.w"])
    tensors = {"a.w": torch.ones(2), **opt.state_tensors()}
    model, state = split_state(tensors)
    assert list(model) == ["a.w"] and all(k.startswith(STATE_PREFIX) for k in state)
    again = ServerOptimizer("adam", lr=0.1)
    again.load_state_tensors(state)
    assert torch.equal(again.m["a.w"], opt.m["a.w"]) and torch.equal(again.v["a.w"], opt.v["a.w"])


@pytest.mark.parametrize("bad,why", [({"kind": "adm"}, "server_opt.kind"), ({"lr": 0}, "server_opt.lr"),
                                     ({"beta1": 1.0}, "server_opt.beta1"), ({"tau": -1}, "server_opt.tau")])
def test_the_config_refuses_what_the_optimisers_cannot_use(bad, why):
    with pytest.raises(ConfigError, match=f"field '{why}'"):
        run_config_from_dict({"run": "x", "fleet": [{"profile": "rpi4", "count": 1}], "server_opt": bad}, "run.yaml")


def _demo(tmp_path: Path, name: str, rounds: int = 3, **server_opt):
    cfg = load_run_config(default_profiles_dir() / "runs" / "demo.yaml")
    cfg = dataclasses.replace(cfg, rounds=rounds, output_dir=str(tmp_path / name))   # auto: resumes to the bit
    if server_opt:
        cfg = ServerOptConfig.of(cfg).replace_in(cfg, **server_opt)
    return cfg


def _history(cfg, **kw):
    return json.loads(json.dumps(canonical(run_simulation(cfg, device="cpu", **kw)[0])))


def test_through_the_engine_fedavgm_at_beta_0_lr_1_is_plain_aggregation_and_adam_is_not(tmp_path):
    """x + 1·(x̄ - x) is x̄ up to float rounding: one round gives the same model to 1e-6."""
    _, plain = run_simulation(_demo(tmp_path, "plain", rounds=1), device="cpu")
    _, same = run_simulation(_demo(tmp_path, "m0", rounds=1, kind="momentum", lr=1.0, beta1=0.0), device="cpu")
    a, b = plain.model.state_dict(), same.model.state_dict()
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a)
    plain3 = _history(_demo(tmp_path, "plain3"))
    adam = _history(_demo(tmp_path, "adam", kind="adam", lr=0.02))
    assert [r["accuracy"] for r in adam] != [r["accuracy"] for r in plain3]
    assert adam[-1]["accuracy"] > adam[0]["accuracy"] + 0.2     # it trains


def test_a_resumed_run_continues_the_optimisers_state(tmp_path):
    """The state is in the checkpoint, a resumed engine starts from it (not afresh), and it
    matters: the same resume without it trains another model."""
    first = _demo(tmp_path, "resumed", rounds=2, kind="momentum", lr=1.0, beta1=0.9)
    _, engine = run_simulation(first, device="cpu")
    out = Path(first.output_dir)
    tensors, st = ckpt.load(out)
    saved = {k: t for k, t in tensors.items() if k.startswith(STATE_PREFIX)}
    assert saved and set(saved) == set(engine.option(ServerOpt).optimiser.state_tensors())
    bare = tmp_path / "bare"
    shutil.copytree(out, bare)
    ckpt.save(bare, {k: t for k, t in tensors.items() if not k.startswith(STATE_PREFIX)}, st)

    _, again = run_simulation(dataclasses.replace(first, rounds=2), device="cpu", resume=True)   # nothing to train
    assert all(torch.equal(again.option(ServerOpt).optimiser.state_tensors()[k], t) for k, t in saved.items())
    with_state = _history(dataclasses.replace(first, rounds=3), resume=True)
    without = _history(dataclasses.replace(first, rounds=3, output_dir=str(bare)), resume=True)
    assert with_state[:3] == without[:3] and with_state[3]["test_loss"] != without[3]["test_loss"]
    model, _ = load_global_model(out)   # export reads past the optimiser's state
    assert not any(k.startswith(STATE_PREFIX) for k in model.state_dict())


def test_what_steps_is_every_client_portion_and_the_server_layers_of_several_copies():
    t = torch.zeros(1)
    clients = {"a": {"c.w": t}, "b": {"c.w": t, "s.w": t}}
    servers = {"a": {"s.w": t, "top.w": t, "top.bn_mean": t}, "b": {"top.w": t, "top.bn_mean": t}}
    params = {"c.w", "s.w", "top.w"}                       # top.bn_mean: a buffer, averaged as before
    # one copy per agent (SplitFed v1, S2FL's groups): top.w was averaged over two copies
    assert averaged_names(clients, servers, {"a": 0, "b": 1}, params) == ["c.w", "s.w", "top.w"]
    # one merged copy trained on every row: not an average, its own optimiser stepped it
    assert averaged_names(clients, servers, {"a": 0, "b": 0}, params) == ["c.w", "s.w"]


@pytest.mark.parametrize("mode, stepped", [("merged", False), ("per_agent", True)])
def test_server_copies_step_where_the_round_averaged_several(tmp_path, mode, stepped):
    """Round 1 trains the same in both runs; only aggregation differs. The classifier (always on
    the server here) is stepped by adam where the round averaged one copy per agent, and left as
    trained where one merged copy trained on every row."""
    def run(name, **opt):
        cfg = dataclasses.replace(_demo(tmp_path, name, rounds=1, **opt), server_mode=mode)
        return run_simulation(cfg, device="cpu")[1].model.state_dict()

    plain, adam = run("plain"), run("adam", kind="adam", lr=0.02)
    top = [k for k in plain if k.endswith("weight")][-1]   # the last layer's weights
    assert torch.allclose(plain[top], adam[top], atol=1e-6) != stepped
