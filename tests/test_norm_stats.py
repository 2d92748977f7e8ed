"""Federated BatchNorm statistics (``norm_stats: federated``).

The pairwise combination against a direct computation; a device's and the server's parts
together against the same computation over the whole model in one place, through a real
agent answering a real ``norm_pass`` message; every bad answer refused with its reason;
through the engine, the statistics change and nothing else does, and the pass is charged.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from edge_agent.agent import AgentCore, BatchSampler, LocalData
from sfl_core.options.norm_stats import stats as norm_stats
from sfl_core.config.fields import ConfigError
from sfl_core.config.run import default_profiles_dir, load_run_config, run_config_from_dict
from sfl_core.model.zoo import build_model
from sfl_core.options.norm_stats import exchange as norm_pass
from sfl_core.options.norm_stats.config import NormStatsConfig
from sfl_core.options.norm_stats.stats import Moments
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.protocol import Message
from simulation import run_simulation

SHAPE = (1, 16, 16)
MODEL = "vgg_mini:width=0.25"


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(MODEL, SHAPE, 10)


def test_the_pairwise_combination_is_the_direct_mean_and_variance():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 3, generator=g) * 3 + 5 for n in (7, 1, 40, 13)]
    parts = [{"l": Moments(len(x), x.double().mean(0), ((x.double() - x.double().mean(0)) ** 2).sum(0))} for x in xs]
    both = norm_stats.combine(parts)["l"]
    whole = torch.cat(xs).double()
    assert both.count == 61
    assert torch.allclose(both.mean, whole.mean(0), atol=1e-12)
    assert torch.allclose(both.variance, whole.var(0, unbiased=True), atol=1e-12)


def test_the_first_layers_statistics_are_its_inputs_pooled_and_nothing_in_the_model_changes():
    """Layer 1's input is the first convolution's output, whatever the normalisation: its
    statistics over three devices' batches are those of all outputs stacked."""
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    g = torch.Generator().manual_seed(1)
    devices = [[torch.randn(8, *SHAPE, generator=g) + d for _ in range(2)] for d in range(3)]
    parts = [norm_stats.collect(model, model.client(2), batches)[0] for batches in devices]
    got = norm_stats.combine(parts)
    first = next(iter(norm_stats.batch_norm_layers(model)))
    conv = model.blocks[0][0]
    with torch.no_grad():
        h = torch.cat([conv(x) for batches in devices for x in batches]).double()
    flat = h.transpose(0, 1).reshape(h.shape[1], -1)
    assert got[first].count == flat.shape[1]
    assert torch.allclose(got[first].mean, flat.mean(1), atol=1e-9)
    assert torch.allclose(got[first].variance, flat.var(1, unbiased=True), atol=1e-9)
    assert not model.training and all(not m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k   # running statistics and counters untouched


def _agent(n: int = 50, seed: int = 3) -> AgentCore:
    g = torch.Generator().manual_seed(seed)
    data = LocalData(torch.randn(n, *SHAPE, generator=g), torch.randint(0, 3, (n,), generator=g), 10)
    return AgentCore("dev", "r", data, SHAPE, seed=seed)


def _ask(agent: AgentCore, model, split: int, batches: int = 3, batch: int = 8, codec: str = "fp32") -> Message:
    body = norm_pass.request_body(MODEL, split, 0, wire.encode_state(model.client_state(split), 1), batches=batches,
                                  batch_size=batch, codec=codec, zstd_level=1, activation_shape=_activation(model, split))
    [reply] = agent.handle(Message("norm_pass", "r", protocol.COORDINATOR_ID, body, round=4, step=6, seq=99))
    assert reply.type == "norm_sums" and (reply.round, reply.step) == (4, 6)
    protocol.decode(reply.encode(), run="r", allowed=protocol.AGENT_TYPES)   # passes the schema check
    return reply


def _activation(model, split: int) -> tuple[int, ...]:
    if split == model.num_blocks:
        return (10,)
    model.eval()
    with torch.no_grad():
        return tuple(model.client(split)(torch.zeros(2, *SHAPE)).shape[1:])


@pytest.mark.parametrize("split", [1, 2, 3])
def test_a_devices_part_and_the_servers_part_are_the_whole_models_statistics(split):
    """What the federated pass computes (device: its layers; server: the rest, from the
    activations it sent) equals one computation over the whole model on the same batches."""
    model = _model()
    agent = _agent()
    reply = _ask(agent, model, split)
    act = tuple(wire.decode_tensor(reply.body["x"]).shape[1:])
    moments, x = norm_pass.check_reply(reply.body, model, split, 24, act)
    assert set(moments) == set(norm_stats.expected_layers(model, model.client(split)))
    parts = norm_stats.combine([moments, norm_pass.server_moments(model, split, x, 8)])
    sampler = BatchSampler(50, 3 + 104729)   # the agent's own draw for statistics passes
    same = [agent.data.x[sampler.next(8)] for _ in range(3)]
    whole = norm_stats.collect(model, model, same)[0]
    assert set(parts) == set(whole) == set(norm_stats.batch_norm_layers(model))
    for name in whole:
        assert parts[name].count == whole[name].count
        assert torch.allclose(parts[name].mean, whole[name].mean, atol=1e-5), name
        assert torch.allclose(parts[name].variance, whole[name].variance, rtol=1e-4, atol=1e-6), name


def test_a_whole_model_agent_sends_every_layer_and_no_activations():
    model = _model()
    reply = _ask(_agent(), model, model.num_blocks)
    assert reply.body["x"] is None
    moments, x = norm_pass.check_reply(reply.body, model, model.num_blocks, 24, (10,))
    assert x is None and set(moments) == set(norm_stats.batch_norm_layers(model))


def test_the_training_batches_do_not_move_and_a_duplicate_is_answered_once():
    agent, twin = _agent(), _agent()
    model = _model()
    _ask(agent, model, 2)
    assert torch.equal(agent._sampler.next(8), twin._sampler.next(8))
    body = norm_pass.request_body(MODEL, 2, 0, wire.encode_state(model.client_state(2), 1), batches=1,
                                  batch_size=8, codec="fp32", zstd_level=1, activation_shape=_activation(model, 2))
    first = agent.handle(Message("norm_pass", "r", protocol.COORDINATOR_ID, body, round=5, step=6, seq=200))
    again = agent.handle(Message("norm_pass", "r", protocol.COORDINATOR_ID, body, round=5, step=6, seq=200))
    assert again == first   # the same reply resent, not a second pass


def _corrupt(body, **change):
    return {**body, **change}


def test_every_bad_answer_is_refused_with_its_reason():
    model = _model()
    reply = _ask(_agent(), model, 2)
    body = reply.body
    act = tuple(wire.decode_tensor(body["x"]).shape[1:])
    first = sorted(body["counts"])[0]

    def refused(b, why, samples=24):
        with pytest.raises(wire.WireError, match=why):
            norm_pass.check_reply(b, model, 2, samples, act)

    refused(_corrupt(body, counts={k: v for k, v in body["counts"].items() if k != first}), "not the client portion")
    refused(_corrupt(body, counts={**body["counts"], first: 25}), "is not a count of 24 samples")
    refused(_corrupt(body, counts={**body["counts"], first: True}), "is not a count")
    bad = dict(body["moments"])
    channels = model.state_dict()[f"{first}.running_var"].shape[0]
    bad[f"{first}.m2"] = wire.encode_tensor(-torch.ones(channels))
    refused(_corrupt(body, moments=bad), "negative")
    bad[f"{first}.m2"] = wire.encode_tensor(torch.ones(3))
    refused(_corrupt(body, moments=bad), "shape")
    nan = wire.decode_tensor(body["x"]).clone()
    nan[0] = float("nan")
    refused(_corrupt(body, x=wire.encode_tensor(nan)), "NaN")
    refused(_corrupt(body, x=None), "missing")
    refused(body, "shape", samples=16)


def test_the_config_takes_one_word_and_refuses_what_cannot_work():
    base = {"run": "r", "model": "small_cnn", "fleet": [{"profile": "rpi4", "count": 2}]}
    assert run_config_from_dict({**base, "norm_stats": "federated"}).sections["norm_stats"].mode == "federated"
    left = run_config_from_dict(base).sections["norm_stats"]
    assert left.mode == "auto" and not left.federated      # strategy auto decides; other strategies: averaged
    with pytest.raises(ConfigError, match="norm_stats.mode"):
        run_config_from_dict({**base, "norm_stats": "recomputed"})
    with pytest.raises(ConfigError, match="norm_stats.batches"):
        run_config_from_dict({**base, "norm_stats": {"mode": "federated", "batches": 0}})
    with pytest.raises(ConfigError, match="DP-SGD"):
        run_config_from_dict({**base, "norm_stats": "federated", "privacy": {"dp_sgd": "1,1"}})


def _run(tmp_path, mode: str, strategy: str = "sfl", **extra):
    cfg = load_run_config(default_profiles_dir() / "runs" / "demo.yaml")
    cfg = dataclasses.replace(cfg, rounds=2, model=MODEL, strategy=strategy, local_iters=5,
                              output_dir=str(tmp_path / f"{mode}-{strategy}"), split=2)
    cfg = NormStatsConfig.of(cfg).replace_in(cfg, mode=mode, **extra)
    return run_simulation(cfg, device="cpu")


@pytest.mark.parametrize("strategy", ["sfl", "fedavg"])
def test_through_the_engine_only_the_statistics_change_and_the_pass_is_charged(tmp_path, strategy):
    plain, e1 = _run(tmp_path, "averaged", strategy)
    fed, e2 = _run(tmp_path, "federated", strategy)
    bn = {f"{n}.{b}" for n in norm_stats.batch_norm_layers(e1.model) for b in ("running_mean", "running_var")}
    s1, s2 = e1.model.state_dict(), e2.model.state_dict()
    for k in s1:
        if k in bn:
            assert not torch.allclose(s1[k], s2[k]), k
        else:   # training never reads running statistics: the weights follow the same path
            assert torch.allclose(s1[k], s2[k], atol=1e-6), k
    for a, b in zip(plain[1:], fed[1:]):
        assert "norm_stats" not in a
        ns = b["norm_stats"]
        assert ns["agents"] == sorted(b["completed"]) and ns["bytes_up"] > 0 and ns["bytes_down"] > 0
        assert b["bytes_up"] - a["bytes_up"] == ns["bytes_up"]
        assert b["round_time_s"] == pytest.approx(a["round_time_s"] + ns["time_s"], abs=2e-4)
        assert ns["time_s"] > 0
    saved = json.loads((tmp_path / f"federated-{strategy}" / "metrics.jsonl").read_text().splitlines()[-1])
    assert saved["norm_stats"]["bytes_up"] == fed[-1]["norm_stats"]["bytes_up"]


def test_every_k_rounds_and_a_subset_of_agents(tmp_path):
    cfg_hist, _ = _run(tmp_path, "federated", every=2, agents=1)
    assert "norm_stats" not in cfg_hist[1]
    assert len(cfg_hist[2]["norm_stats"]["agents"]) == 1


def test_the_plan_prices_the_pass_as_the_simulation_charges_it(tmp_path):
    """``sfl-coord plan``'s stats-pass share of SFL's round against a simulated round of it."""
    from sfl_core.fleet import fleet_of
    from sfl_core.methods.preview import preview
    from sfl_core.model.accounting import model_costs

    cfg = run_config_from_dict({
        "run": "planned", "model": MODEL, "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
        "fleet": [{"profile": "s2fl-low-low"}, {"profile": "s2fl-mid-mid"}, {"profile": "jetson-nano", "count": 2}],
        "rounds": 1, "strategy": "sfl", "split": 2, "batch_size": 16, "local_iters": 5, "norm_stats": "federated",
        "output_dir": str(tmp_path / "run")})
    history, engine = run_simulation(cfg, device="cpu")
    model = build_model(cfg.model, engine.input_shape, 10)
    costs = model_costs(cfg.model, engine.input_shape, 10)
    rows = {r.method: r for r in preview(cfg, model, costs, fleet_of(cfg, [[1] * 10] * 4))}
    assert rows["SFL"].phase_s == pytest.approx(history[1]["norm_stats"]["time_s"], rel=0.1)
    assert rows["SFL"].round_s == pytest.approx(history[1]["round_time_s"], rel=0.1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_processes_over_mosquitto_run_the_pass_with_scaffold(mosquitto, tmp_path):
    """A coordinator and three agent processes over a real broker: the statistics pass in every
    round until the freeze (``freeze_after: 2``), then a round whose assignments freeze the
    statistics; SCAFFOLD's corrections in every assignment; all signed and validated like the rest."""
    from helpers import finish, logs, start_agents, start_coord, write_config

    config = write_config(tmp_path, "stats", model=MODEL, split=2, rounds=3, local_iters=5,
                          norm_stats={"mode": "federated", "freeze_after": 2}, drift="scaffold")
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "stats", tmp_path, n=3, emulate=False)
    assert finish([coord, *agents], 240) == [0, 0, 0, 0], logs(tmp_path)
    history = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [h["round"] for h in history] == [0, 1, 2, 3]
    for h in history[1:3]:
        assert h["norm_stats"]["agents"] == ["a0", "a1", "a2"] and h["norm_stats"]["bytes_up"] > 0, h
    assert "norm_stats" not in history[3] and len(history[3]["completed"]) == 3, history[3]
    for h in history[1:]:
        assert h["rejected"] == {}, h["rejected"]
    text = (tmp_path / "coord.log").read_text()
    assert "round 2: BatchNorm statistics of" in text and "from 3 agent(s)" in text, text
    assert "Traceback" not in logs(tmp_path)
