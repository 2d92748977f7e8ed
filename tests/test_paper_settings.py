"""What the papers' settings need from the product: model variants (width, normalisation), resized
images, SplitFed v2, learning-rate decay, FedFC's aggregation, S2FL's warm-up on every device and
one byte model for the planner and the clock."""

from __future__ import annotations

import copy

import pytest
import torch

from sfl_core.model.accounting import model_costs
from sfl_core.aggregation import layerwise_average
from sfl_core.config.run import ConfigError, run_config_from_dict
from sfl_core.model.zoo import ModelSpec, build_model
from sfl_core.model.zoo import candidate_splits

from coordinator.server_trainer import ServerTrainer


# ---------------------------------------------------------------------- model variants

def test_model_spec_round_trips_and_names_the_model():
    assert str(ModelSpec.parse("vgg16")) == "vgg16"
    assert str(ModelSpec.parse("vgg16:norm=group,width=0.25")) == "vgg16:width=0.25,norm=group"
    m = build_model("vgg11:width=0.5", (1, 32, 32), 10)
    assert m.name == "vgg11:width=0.5"
    assert candidate_splits(m.name) == candidate_splits("vgg11")


@pytest.mark.parametrize("spec, words", [
    ("vgg17", "unknown model"), ("vgg16:width=0", "width must be in"), ("vgg16:width=x", "width must be a number"),
    ("vgg16:norm=layer", "norm must be one of"), ("vgg16:depth=3", "unknown option"),
    ("alexnet:norm=group", "no normalisation layers"), ("vgg16:width", "not key=value"),
])
def test_model_spec_errors_name_the_problem(spec, words):
    with pytest.raises(ValueError, match=words):
        build_model(spec, (1, 32, 32), 10)


def test_width_scales_flops_and_bytes_like_a_replica_should():
    full, quarter = model_costs("vgg16", (1, 32, 32), 10), model_costs("vgg16:width=0.25", (1, 32, 32), 10)
    s = 4
    assert quarter[s].activation_bytes * 4 == full[s].activation_bytes          # channels / 4
    assert 12 < full[s].client_flops / quarter[s].client_flops < 17             # ~ width^2 (first conv is linear)


def test_group_norm_variant_has_no_running_statistics():
    m = build_model("resnet8:norm=group", (1, 28, 28), 10)
    assert not any("running_mean" in k for k in m.state_dict())
    assert any(isinstance(x, torch.nn.GroupNorm) for x in m.modules())
    assert m(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_run_config_accepts_a_model_mapping():
    cfg = run_config_from_dict({"run": "x", "model": {"name": "vgg16", "width": 0.25, "norm": "group"},
                                "fleet": [{"profile": "rpi4", "count": 1}]})
    assert cfg.model == "vgg16:width=0.25,norm=group"
    with pytest.raises(ConfigError, match="field 'model'.*unknown option"):
        run_config_from_dict({"run": "x", "model": "vgg16:size=3", "fleet": [{"profile": "rpi4", "count": 1}]})


def test_image_size_resizes_train_and_test_alike():
    from sfl_core.data.builtin import load_dataset
    d = load_dataset("digits", image_size=16)
    assert d.input_shape == (1, 16, 16) and d.x_test.shape[1:] == (1, 16, 16)
    assert load_dataset("digits").input_shape == (1, 8, 8)      # the unresized copy is untouched


# ---------------------------------------------------------------------- SplitFed v2 and lr decay

def _trainer_after_one_step(sequential: bool):
    torch.manual_seed(0)
    model = build_model("small_cnn", (1, 8, 8), 10)
    xa, xb = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)
    ya, yb = torch.randint(0, 10, (4,)), torch.randint(0, 10, (4,))
    acts = {"a": (model.client(2)(xa).detach(), ya), "b": (model.client(2)(xb).detach(), yb)}
    trainer = ServerTrainer(model, lr=0.5)
    trainer.begin_round([["a", "b"]], {"a": 2, "b": 2}, sequential=sequential)
    trainer.step(acts)
    return model, acts, trainer


def test_sequential_server_takes_one_step_per_agent_in_turn():
    model, acts, trainer = _trainer_after_one_step(sequential=True)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD([p for b in ref.blocks[2:] for p in b.parameters()], lr=0.5)
    for a in ("a", "b"):                       # agent after agent, each an optimiser step
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref.server(2)(acts[a][0]), acts[a][1]).backward()
        opt.step()
    got = trainer.member_state("a", 2)
    for k, v in ref.server_state(2).items():
        torch.testing.assert_close(got[k], v)
    merged = _trainer_after_one_step(sequential=False)[2].member_state("a", 2)
    assert any(not torch.allclose(got[k], merged[k]) for k in got)


def test_a_sequential_turn_steps_at_its_members_rate_at_most():
    """A member given a smaller rate (a smaller batch under batch regulation) has its turn of the
    sequential copy step at that rate; a larger one is capped at the round's."""
    torch.manual_seed(0)
    model = build_model("small_cnn", (1, 8, 8), 10)
    xa, xb = torch.randn(2, 1, 8, 8), torch.randn(8, 1, 8, 8)
    acts = {"a": (model.client(2)(xa).detach(), torch.randint(0, 10, (2,))),
            "b": (model.client(2)(xb).detach(), torch.randint(0, 10, (8,)))}
    trainer = ServerTrainer(model, lr=0.5)
    trainer.begin_round([["a", "b"]], {"a": 2, "b": 2}, sequential=True, member_lr={"a": 0.125, "b": 2.0})
    trainer.step(acts)
    ref = copy.deepcopy(model)
    params = [p for b in ref.blocks[2:] for p in b.parameters()]
    for a, lr in (("a", 0.125), ("b", 0.5)):
        opt = torch.optim.SGD(params, lr=lr)
        torch.nn.functional.cross_entropy(ref.server(2)(acts[a][0]), acts[a][1]).backward()
        opt.step()
        opt.zero_grad()
    got = trainer.member_state("a", 2)
    for k, v in ref.server_state(2).items():
        torch.testing.assert_close(got[k], v)
    merged = ServerTrainer(model, lr=0.5)   # a merged step keeps the round's rate
    merged.begin_round([["a", "b"]], {"a": 2, "b": 2}, member_lr={"a": 0.125, "b": 2.0})
    merged.step(acts)
    assert merged._groups[0].opt.param_groups[0]["lr"] == 0.5


def test_lr_decay_reaches_agents_and_server(tmp_path):
    from simulation import run_simulation
    cfg = run_config_from_dict({
        "run": "decay", "model": "small_cnn", "data": {"dataset": "digits"},
        "fleet": [{"profile": "rpi4", "count": 2}], "rounds": 3, "batch_size": 8, "local_iters": 2,
        "lr": 0.1, "lr_decay": 0.5, "server_mode": "sequential", "output_dir": str(tmp_path / "out")})
    history, engine = run_simulation(cfg, device="cpu")
    lrs = [{a["lr"] for a in rec["agents"].values()} for rec in history[1:]]
    assert lrs == [{0.1}, {0.05}, {0.025}]
    assert engine.server._groups[0].opt.param_groups[0]["lr"] == pytest.approx(0.025)


# ---------------------------------------------------------------------- FedFC aggregation

def test_server_copy_counts_once_with_server_groups():
    one = {"w": torch.tensor([1.0])}
    srv = {"w": torch.tensor([4.0])}
    clients = {"a": {}, "b": {}, "c": one}          # a and b cut before layer w, c holds it
    servers = {"a": srv, "b": srv, "c": {}}
    weights = {"a": 1.0, "b": 1.0, "c": 1.0}
    per_member = layerwise_average(clients, servers, weights)
    once = layerwise_average(clients, servers, weights, server_groups={"a": 0, "b": 0, "c": 0})
    assert per_member["w"].item() == pytest.approx((4 + 4 + 1) / 3)
    assert once["w"].item() == pytest.approx((4 + 1) / 2)


# ---------------------------------------------------------------------- S2FL warm-up and byte model

def _s2fl(tmp_path, **over):
    return run_config_from_dict({
        "run": "s2", "model": "small_cnn", "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
        "fleet": [{"profile": "s2fl-low-low", "count": 3}, {"profile": "s2fl-high-high", "count": 3}],
        "rounds": 5, "per_round": 2, "strategy": "s2fl", "batch_size": 8, "local_iters": 2, "zstd_level": 3,
        "output_dir": str(tmp_path / "out"), "s2fl": {"sliding": True, "balance": False, "candidates": [1, 2, 3]},
        **over})


def test_s2fl_warm_up_measures_every_device(tmp_path):
    from simulation import run_simulation
    history, engine = run_simulation(_s2fl(tmp_path), device="cpu")
    assert [len(rec["selected"]) for rec in history[1:]] == [6, 6, 6, 2, 2]
    table = engine.method.time_table
    assert all(not table.get(a, s).estimated for a in engine.registry.agents for s in (1, 2, 3))


def test_planner_estimates_charge_the_measured_wire_bytes(tmp_path):
    from simulation import run_simulation
    _, engine = run_simulation(_s2fl(tmp_path, rounds=3), device="cpu")
    ratios = engine.method.wire_ratio
    assert set(ratios) == {"1/fp32", "2/fp32", "3/fp32"}
    assert all(0 < r < 1 for r in ratios.values())       # zstd shrinks what fp32 accounting counts
    # an estimate for a new agent uses the ratio: less transfer than fp32 would charge
    planner = engine.method
    info = engine.registry.agents[sorted(engine.registry.agents)[0]]
    planner.time_table = type(planner.time_table)()
    planner.fill_estimates([info.agent_id], engine.registry.agents)
    with_ratio = planner.time_table.get(info.agent_id, 1).seconds
    planner.wire_ratio = {}
    planner.time_table = type(planner.time_table)()
    planner.fill_estimates([info.agent_id], engine.registry.agents)
    assert with_ratio < planner.time_table.get(info.agent_id, 1).seconds
