"""Frozen BatchNorm statistics after an exploration phase (``norm_stats.freeze_after``, FixBN).

A frozen layer against the formula; a real agent's local steps with the statistics frozen
against a hand-written loop; through the engine, the statistics stop at the freeze on the
devices and on the server (and the statistics pass with them) while the weights train on, and
the plan prices the pass only before the freeze; the assignment's flag is validated.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from edge_agent.agent import AgentCore, BatchSampler, LocalData
from sfl_core.options.norm_stats import stats as norm_stats
from sfl_core.options.norm_stats.config import NormStatsConfig
from sfl_core.config.fields import ConfigError
from sfl_core.config.run import default_profiles_dir, load_run_config, run_config_from_dict
from sfl_core.model.zoo import build_model
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.assignment import WHOLE_MODEL, Assignment
from sfl_core.wire.protocol import Message
from simulation import run_simulation

SHAPE = (1, 16, 16)
MODEL = "vgg_mini:width=0.25"


def test_rounds_after_the_exploration_are_frozen_and_zero_never_freezes():
    assert [norm_stats.frozen(2, r) for r in (1, 2, 3, 4)] == [False, False, True, True]
    assert not any(norm_stats.frozen(0, r) for r in range(1, 10))
    base = {"run": "r", "model": "small_cnn", "fleet": [{"profile": "rpi4", "count": 2}]}
    assert run_config_from_dict({**base, "norm_stats": {"freeze_after": 5}}).sections["norm_stats"].freeze_after == 5
    with pytest.raises(ConfigError, match="norm_stats.freeze_after"):
        run_config_from_dict({**base, "norm_stats": {"freeze_after": -1}})


def test_a_frozen_layer_normalises_with_its_statistics_keeps_them_and_its_scale_trains():
    torch.manual_seed(0)
    layer = torch.nn.BatchNorm2d(3)
    layer.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
    layer.running_var.copy_(torch.tensor([2.0, 0.5, 1.5]))
    layer.weight.data.copy_(torch.tensor([1.5, 0.5, -1.0]))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    model = norm_stats.freeze(torch.nn.Sequential(layer).train())
    x = torch.randn(4, 3, 5, 5) * 3 + 1
    out = model(x)
    shape = (1, 3, 1, 1)
    expected = (x - before["running_mean"].view(shape)) / torch.sqrt(before["running_var"].view(shape) + layer.eps) \
        * before["weight"].view(shape) + before["bias"].view(shape)
    assert torch.allclose(out, expected, atol=1e-5)
    out.square().mean().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    for k, v in before.items():
        if k not in ("weight", "bias"):
            assert torch.equal(layer.state_dict()[k], v), k
    assert model.training   # only the BatchNorm layers left train mode


def test_a_devices_local_steps_with_frozen_statistics_are_the_hand_written_loop():
    torch.manual_seed(0)
    model = build_model(MODEL, SHAPE, 10)
    with torch.no_grad():     # statistics unlike a fresh layer's, so that using them shows
        for layer in norm_stats.batch_norm_layers(model).values():
            layer.running_mean.uniform_(-0.5, 0.5)
            layer.running_var.uniform_(0.5, 2.0)
    split = model.num_blocks
    x0 = {k: v.clone() for k, v in model.state_dict().items()}
    tau, lr, batch = 3, 0.05, 8
    a = Assignment(model=MODEL, mode=WHOLE_MODEL, split=split, width=0, batch_size=batch, lr=lr, momentum=0.5,
                   tau=tau, codec="fp32", zstd_level=1, activation_shape=(10,))
    g = torch.Generator().manual_seed(5)
    data = LocalData(torch.randn(40, *SHAPE, generator=g), torch.randint(0, 4, (40,), generator=g), 10)
    agent = AgentCore("dev", "r", data, SHAPE, seed=5)
    body = {**a.to_body(wire.encode_state(model.client_state(split), 1)), "freeze_norm": True}
    [reply] = agent.handle(Message("assign", "r", protocol.COORDINATOR_ID, body, round=1, seq=1))
    got = wire.decode_state(reply.body["weights"], model.client_state(split))

    ref = build_model(MODEL, SHAPE, 10)
    ref.load_state_dict(x0)
    ref.train()
    for layer in norm_stats.batch_norm_layers(ref).values():
        layer.eval()
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.5)
    sampler = BatchSampler(len(data), 5)
    for _ in range(tau):
        idx = sampler.next(batch)
        opt.zero_grad()
        F.cross_entropy(ref(data.x[idx]), data.y[idx]).backward()
        opt.step()
    bn = {f"{n}.{b}" for n in norm_stats.batch_norm_layers(model) for b in ("running_mean", "running_var",
                                                                           "num_batches_tracked")}
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, atol=1e-6), k
        if k in bn:
            assert torch.equal(got[k], x0[k]), k
        elif k.endswith("weight"):
            assert not torch.equal(got[k], x0[k]), k


def test_the_flag_must_be_a_boolean():
    body = {"model": MODEL, "strategy": WHOLE_MODEL, "split": 4, "width": 0, "batch_size": 8, "lr": 0.05,
            "momentum": 0.0, "tau": 1, "codec": "fp32", "zstd_level": 1, "activation_shape": [10], "weights": {}}
    ok = Message("assign", "r", protocol.COORDINATOR_ID, {**body, "freeze_norm": True}, round=1, seq=1).encode()
    assert protocol.decode(ok, run="r", allowed=protocol.COORD_TYPES).body["freeze_norm"] is True
    bad = Message("assign", "r", protocol.COORDINATOR_ID, {**body, "freeze_norm": 1}, round=1, seq=1).encode()
    with pytest.raises(wire.WireError, match="freeze_norm"):
        protocol.decode(bad, run="r", allowed=protocol.COORD_TYPES)


def _run(tmp_path, name: str, rounds: int, **norm):
    cfg = load_run_config(default_profiles_dir() / "runs" / "demo.yaml")
    cfg = dataclasses.replace(cfg, rounds=rounds, model=MODEL, strategy="sfl", local_iters=3, split=2,
                              output_dir=str(tmp_path / name))
    cfg = NormStatsConfig.of(cfg).replace_in(cfg, **norm)
    return run_simulation(cfg, device="cpu")


@pytest.mark.parametrize("mode", ["averaged", "federated"])
def test_through_the_engine_the_statistics_stop_at_the_freeze_and_the_weights_train_on(tmp_path, mode):
    """Rounds 1-2 explore, 3-4 train with frozen statistics: the final statistics, the client
    portions' (devices) and the server portion's alike, are round 2's, and (federated) no pass
    runs after the freeze."""
    two, e2 = _run(tmp_path, f"{mode}-2", 2, mode=mode, freeze_after=2)
    four, e4 = _run(tmp_path, f"{mode}-4", 4, mode=mode, freeze_after=2)
    layers = norm_stats.batch_norm_layers(e4.model)
    s2, s4 = e2.model.state_dict(), e4.model.state_dict()
    stats = {f"{n}.{b}" for n in layers for b in ("running_mean", "running_var")}
    server = set(e4.model.server_state(2))
    assert stats & server and stats - server      # both sides hold BatchNorm layers
    for k in stats:
        assert torch.allclose(s2[k], s4[k], atol=1e-6), k
    first = next(n for n, _ in e4.model.named_parameters())
    assert not torch.allclose(s2[first], s4[first])
    if mode == "federated":
        assert [("norm_stats" in h) for h in four[1:]] == [True, True, False, False]
        assert four[3]["round_time_s"] < four[2]["round_time_s"]      # no pass to charge
    # and without the freeze the statistics move on
    free, e_free = _run(tmp_path, f"{mode}-free", 4, mode=mode)
    moved = e_free.model.state_dict()
    assert any(not torch.allclose(s2[k], moved[k], atol=1e-4) for k in stats)


def test_the_plan_prices_the_pass_only_before_the_freeze(tmp_path):
    from sfl_core.fleet import fleet_of
    from sfl_core.methods.preview import preview
    from sfl_core.model.accounting import model_costs

    def rows(**norm):
        cfg = run_config_from_dict({
            "run": "planned", "model": MODEL, "data": {"dataset": "digits"}, "rounds": 40,
            "fleet": [{"profile": "s2fl-low-low"}, {"profile": "jetson-nano", "count": 2}],
            "strategy": "sfl", "split": 2, "batch_size": 16, "local_iters": 5,
            "norm_stats": {"mode": "federated", **norm}})
        model, costs = build_model(MODEL, SHAPE, 10), model_costs(MODEL, SHAPE, 10)
        return {r.method: r for r in preview(cfg, model, costs, fleet_of(cfg, [[1] * 10] * 3))}

    always, quarter = rows()["SFL"], rows(freeze_after=10)["SFL"]
    assert always.phase_s > 0
    assert quarter.phase_s == pytest.approx(always.phase_s / 4)
    assert always.round_s - quarter.round_s == pytest.approx(always.phase_s * 3 / 4)
