"""Local BatchNorm layers on the devices (``norm_stats.local``, FedBN).

What a device keeps; a real agent's second assignment trains from its own BatchNorm layers
and the received rest; through the engine, each device keeps its own layers while the global
model's stay the average of what the devices upload; the assignment's flag is validated.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edge_agent.agent import AgentCore, LocalData
from sfl_core.options.norm_stats import stats as norm_stats
from sfl_core.options.norm_stats.config import NormStatsConfig
from sfl_core.options.norm_stats.option import NormStatsOnDevice
from sfl_core.config.run import default_profiles_dir, load_run_config, run_config_from_dict
from sfl_core.model.zoo import build_model
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.assignment import WHOLE_MODEL, Assignment
from sfl_core.wire.protocol import Message
from simulation import run_simulation

SHAPE = (1, 16, 16)
MODEL = "vgg_mini:width=0.25"


def _bn_names(model) -> set[str]:
    return {f"{n}.{b}" for n in norm_stats.batch_norm_layers(model)
            for b in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}


def test_a_device_keeps_its_batch_norm_layers_scale_shift_and_statistics():
    model = build_model(MODEL, SHAPE, 10)
    state = model.client_state(2)
    kept = norm_stats.local_entries(model, state)
    assert kept and set(kept) == _bn_names(model) & set(state)
    assert all(torch.equal(kept[k], state[k]) and kept[k] is not state[k] for k in kept)
    assert norm_stats.local_entries(build_model("small_cnn:norm=none", SHAPE, 10), {"x": torch.zeros(1)}) == {}
    base = {"run": "r", "model": "small_cnn", "fleet": [{"profile": "rpi4", "count": 2}]}
    assert run_config_from_dict({**base, "norm_stats": {"local": True}}).sections["norm_stats"].local is True
    assert run_config_from_dict(base).sections["norm_stats"].local is False


def _assign(model, seq: int, local: bool) -> Message:
    split = model.num_blocks
    a = Assignment(model=MODEL, mode=WHOLE_MODEL, split=split, width=0, batch_size=8, lr=0.05, momentum=0.0,
                   tau=2, codec="fp32", zstd_level=1, activation_shape=(10,))
    body = a.to_body(wire.encode_state(model.client_state(split), 1))
    if local:
        body["local_norm"] = True
    return Message("assign", "r", protocol.COORDINATOR_ID, body, round=seq, seq=seq)


@pytest.mark.parametrize("local", [True, False])
def test_a_devices_next_round_starts_from_its_own_batch_norm_layers_and_the_received_rest(local):
    torch.manual_seed(0)
    model = build_model(MODEL, SHAPE, 10)
    split = model.num_blocks
    g = torch.Generator().manual_seed(5)
    agent = AgentCore("dev", "r", LocalData(torch.randn(40, *SHAPE, generator=g),
                                             torch.randint(0, 4, (40,), generator=g), 10), SHAPE, seed=5)
    [reply] = agent.handle(_assign(model, 1, local))
    own = wire.decode_state(reply.body["weights"], model.client_state(split))   # uploaded as usual
    second = build_model(MODEL, SHAPE, 10)   # the next global model: every entry differs from ours
    with torch.no_grad():
        for v in second.state_dict().values():
            if v.is_floating_point():
                v.add_(0.25)
    bn = _bn_names(second)
    started = {}
    original = agent._train_locally

    def capture():   # the weights the second round trains from, before its first step
        started.update({k: v.detach().clone() for k, v in agent._model(MODEL, split, 0).state_dict().items()})
        return original()
    agent._train_locally = capture
    agent.handle(_assign(second, 2, local))
    received = second.state_dict()
    for k, v in started.items():
        if local and k in bn:
            assert torch.equal(v, own[k]), k
        else:
            assert torch.equal(v, received[k]), k


def test_the_flag_must_be_a_boolean():
    body = {"model": MODEL, "strategy": WHOLE_MODEL, "split": 4, "width": 0, "batch_size": 8, "lr": 0.05,
            "momentum": 0.0, "tau": 1, "codec": "fp32", "zstd_level": 1, "activation_shape": [10], "weights": {}}
    ok = Message("assign", "r", protocol.COORDINATOR_ID, {**body, "local_norm": True}, round=1, seq=1).encode()
    assert protocol.decode(ok, run="r", allowed=protocol.COORD_TYPES).body["local_norm"] is True
    bad = Message("assign", "r", protocol.COORDINATOR_ID, {**body, "local_norm": "yes"}, round=1, seq=1).encode()
    with pytest.raises(wire.WireError, match="local_norm"):
        protocol.decode(bad, run="r", allowed=protocol.COORD_TYPES)


def test_through_the_engine_devices_keep_their_own_layers_and_the_global_ones_are_averaged(tmp_path):
    """FedAvg, 3 rounds over the demo fleet: every device that trained keeps BatchNorm layers
    of its own, which differ from the global model's and from each other's; the run differs
    from one without the switch from round 2 on (round 1 starts everyone from the global model)."""
    def run(name, local):
        cfg = load_run_config(default_profiles_dir() / "runs" / "demo.yaml")
        cfg = dataclasses.replace(cfg, rounds=3, model=MODEL, strategy="fedavg", local_iters=3,
                                  output_dir=str(tmp_path / name))
        cfg = NormStatsConfig.of(cfg).replace_in(cfg, local=local)
        return run_simulation(cfg, device="cpu")
    shared, plain = run("plain", False)
    history, engine = run("local", True)
    cores = engine.transport.agents
    kept = {a: core.option(NormStatsOnDevice).own for a, core in cores.items() if core.option(NormStatsOnDevice).own}
    assert len(kept) >= 2 and not any(core.option(NormStatsOnDevice).own for core in plain.transport.agents.values())
    glob = engine.model.state_dict()
    weight = next(k for k in next(iter(kept.values())) if k.endswith("weight"))
    mine = [v[weight] for v in kept.values()]
    assert not torch.equal(mine[0], mine[1]) and all(not torch.equal(m, glob[weight]) for m in mine)
    last = history[3]["completed"]   # the global layers: the average of what round 3's devices uploaded
    n = {a: engine.registry.agents[a].num_samples for a in last}
    average = sum(kept[a][weight] * n[a] for a in last) / sum(n.values())
    torch.testing.assert_close(glob[weight], average, rtol=1e-5, atol=1e-6)
    assert history[1]["train_loss"] == pytest.approx(shared[1]["train_loss"])
    assert history[3]["train_loss"] != pytest.approx(shared[3]["train_loss"], rel=1e-6)
