"""Drift correction (``drift:``): FedProx's proximal term and SCAFFOLD's control variates.

Momentum's effective steps against torch's SGD; the control variates by hand; a real agent's
local steps against a hand-written loop with each correction; through the engine, SCAFFOLD's
extra bytes counted and its state checkpointed and continued on resume.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from coordinator import state as ckpt
from edge_agent.agent import AgentCore, BatchSampler, LocalData
from sfl_core.config.fields import ConfigError
from sfl_core.config.run import default_profiles_dir, load_run_config, run_config_from_dict
from coordinator.server_trainer import ServerTrainer
from sfl_core.options.drift.config import DriftConfig
from sfl_core.options.drift.option import Drift
from sfl_core.options.drift.variates import STATE_PREFIX, ControlVariates, effective_steps
from sfl_core.model.zoo import build_model
from sfl_core.options.base import split_state
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.assignment import WHOLE_MODEL, Assignment
from sfl_core.wire.protocol import Message
from simulation import run_simulation

SHAPE = (1, 8, 8)
MODEL = "small_cnn"


@pytest.mark.parametrize("m", [0.0, 0.5, 0.9])
def test_effective_steps_is_how_far_momentum_sgd_moves_for_a_constant_gradient(m):
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1, momentum=m)
    for _ in range(7):
        opt.zero_grad()
        w.grad = torch.ones(1)
        opt.step()
    assert -w.item() == pytest.approx(0.1 * effective_steps(7, m), rel=1e-6)


def test_the_control_variates_by_hand():
    """Two devices of a fleet of 4, one parameter each; then the first again."""
    cv = ControlVariates()
    full = {"w": torch.zeros(2)}
    x = {"w": torch.tensor([1.0, 2.0])}
    ys = {"a": {"w": torch.tensor([0.5, 1.0])}, "b": {"w": torch.tensor([1.5, 2.0])}}
    cv.update(x, ys, {"a": (0.1, 5, 0.0), "b": (0.1, 5, 0.0)}, fleet_size=4, full=full)
    ga, gb = (x["w"] - ys["a"]["w"]) / 0.5, (x["w"] - ys["b"]["w"]) / 0.5   # (x − y)/(Kη), c = cᵢ = 0 before
    assert torch.allclose(cv.ci["a"]["w"], ga) and torch.allclose(cv.ci["b"]["w"], gb)
    assert torch.allclose(cv.c["w"], (ga + gb) / 4)
    assert torch.allclose(cv.correction("a", {"w": torch.zeros(2)})["w"], cv.c["w"] - ga)
    c_before = cv.c["w"].clone()
    y2 = {"a": {"w": torch.tensor([0.0, 0.0])}}
    cv.update(x, y2, {"a": (0.1, 5, 0.0)}, fleet_size=4, full=full)
    ga2 = ga - c_before + (x["w"] - y2["a"]["w"]) / 0.5
    assert torch.allclose(cv.ci["a"]["w"], ga2)
    assert torch.allclose(cv.c["w"], c_before + (ga2 - ga) / 4)
    # a narrower device holds the leading rows: its updates land there
    cv2 = ControlVariates()
    cv2.update({"e": torch.ones(4, 2)}, {"n": {"e": torch.zeros(2, 2)}}, {"n": (1.0, 1, 0.0)}, fleet_size=1,
               full={"e": torch.zeros(4, 2)})
    assert torch.equal(cv2.c["e"], torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
    assert set(cv.state_tensors()) == {f"{STATE_PREFIX}c/w", f"{STATE_PREFIX}i/a/w", f"{STATE_PREFIX}i/b/w"}
    again = ControlVariates()
    again.load_state_tensors(cv.state_tensors())
    assert torch.equal(again.c["w"], cv.c["w"]) and torch.equal(again.ci["b"]["w"], cv.ci["b"]["w"])


def _agent_and_data(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    data = LocalData(torch.randn(40, *SHAPE, generator=g), torch.randint(0, 4, (40,), generator=g), 10)
    return AgentCore("dev", "r", data, SHAPE, seed=seed), data


@pytest.mark.parametrize("kind", ["fedprox", "scaffold"])
def test_a_devices_local_steps_are_the_corrected_sgd_steps(kind):
    torch.manual_seed(0)
    model = build_model(MODEL, SHAPE, 10)
    split = model.num_blocks
    x0 = {k: v.clone() for k, v in model.state_dict().items()}
    tau, lr, mom, batch, mu = 4, 0.05, 0.5, 8, 0.3
    a = Assignment(model=MODEL, mode=WHOLE_MODEL, split=split, width=0, batch_size=batch, lr=lr, momentum=mom,
                   tau=tau, codec="fp32", zstd_level=1, activation_shape=(10,))
    body = a.to_body(wire.encode_state(model.client_state(split), 1))
    g = torch.Generator().manual_seed(9)
    corr = {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in model.named_parameters()}
    if kind == "fedprox":
        body["prox_mu"] = mu
    else:
        body["correction"] = wire.encode_state(corr, 1)
    agent, data = _agent_and_data()
    [reply] = agent.handle(Message("assign", "r", protocol.COORDINATOR_ID, body, round=1, seq=1))
    got = wire.decode_state(reply.body["weights"], model.client_state(split))

    ref = build_model(MODEL, SHAPE, 10)
    ref.load_state_dict(x0)
    ref.train()
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=mom)
    sampler = BatchSampler(len(data), 5)
    for _ in range(tau):
        idx = sampler.next(batch)
        opt.zero_grad()
        F.cross_entropy(ref(data.x[idx]), data.y[idx]).backward()
        for n, p in ref.named_parameters():
            p.grad += mu * (p.detach() - x0[n]) if kind == "fedprox" else corr[n]
        opt.step()
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, atol=1e-6), k


def test_a_bad_correction_or_mu_is_refused():
    torch.manual_seed(0)
    model = build_model(MODEL, SHAPE, 10)
    split = model.num_blocks
    a = Assignment(model=MODEL, mode=WHOLE_MODEL, split=split, width=0, batch_size=4, lr=0.05, momentum=0.0,
                   tau=1, codec="fp32", zstd_level=1, activation_shape=(10,))
    body = a.to_body(wire.encode_state(model.client_state(split), 1))
    agent, _ = _agent_and_data()
    with pytest.raises(wire.WireError, match="prox_mu"):
        agent.handle(Message("assign", "r", protocol.COORDINATOR_ID, {**body, "prox_mu": float("nan")}, round=1, seq=1))
    bad = {n: torch.zeros(3) for n, _ in model.named_parameters()}
    with pytest.raises(wire.WireError):
        agent.handle(Message("assign", "r", protocol.COORDINATOR_ID,
                             {**body, "correction": wire.encode_state(bad, 1)}, round=1, seq=2))


def test_the_config_takes_one_word():
    base = {"run": "r", "model": "small_cnn", "fleet": [{"profile": "rpi4", "count": 2}]}
    assert run_config_from_dict({**base, "drift": "scaffold"}).sections["drift"].kind == "scaffold"
    assert run_config_from_dict({**base, "drift": {"kind": "fedprox", "mu": 0.1}}).sections["drift"].mu == 0.1
    with pytest.raises(ConfigError, match="drift.kind"):
        run_config_from_dict({**base, "drift": "feddyn"})
    with pytest.raises(ConfigError, match="drift.mu"):
        run_config_from_dict({**base, "drift": {"kind": "fedprox", "mu": -1}})


def _run(tmp_path, kind: str, rounds: int = 2, name: str = "", **kw):
    cfg = load_run_config(default_profiles_dir() / "runs" / "demo.yaml")
    cfg = dataclasses.replace(cfg, rounds=rounds, strategy="sfl", split=2, local_iters=4,
                              output_dir=str(tmp_path / (name or kind)))
    cfg = DriftConfig.of(cfg).replace_in(cfg, kind=kind)
    return run_simulation(cfg, device="cpu", **kw)


def test_scaffold_through_the_engine_costs_one_client_portion_down_and_resumes(tmp_path):
    plain, _ = _run(tmp_path, "none")
    scaffold, engine = _run(tmp_path, "scaffold")
    client_bytes = sum(v.numel() * 4 for k, v in engine.model.client_state(2).items() if k in engine.parameter_names)
    for a, b in zip(plain[2:], scaffold[2:]):   # round 1's c − cᵢ is all zeros: zstd sends next to nothing
        extra = b["bytes_down"] - a["bytes_down"]
        n = len(b["completed"])
        assert 0.9 * n * client_bytes < extra < 1.2 * n * client_bytes + 2000   # zstd, msgpack framing
        assert b["bytes_up"] == pytest.approx(a["bytes_up"], rel=0.02)
    assert scaffold[2]["train_loss"] != plain[2]["train_loss"]
    tensors, _ = ckpt.load(tmp_path / "scaffold")
    model_state, own = split_state(tensors)
    assert any(k.startswith(f"{STATE_PREFIX}c/") for k in own) and not any(k.startswith("@") for k in model_state)
    _, resumed = _run(tmp_path, "scaffold", resume=True)   # nothing left to train: the state as loaded
    assert set(resumed.option(Drift).variates.c) == set(engine.option(Drift).variates.c) and set(resumed.option(Drift).variates.ci) == set(engine.option(Drift).variates.ci)
    for k, v in engine.option(Drift).variates.c.items():
        assert torch.equal(resumed.option(Drift).variates.c[k], v), k


def test_fedprox_through_the_engine_at_mu_0_is_plain_training_and_pulls_towards_x_above(tmp_path):
    def engine(name: str, kind: str, mu: float = 0.01):
        cfg = load_run_config(default_profiles_dir() / "runs" / "demo.yaml")
        cfg = dataclasses.replace(cfg, rounds=1, strategy="sfl", split=2, local_iters=4,
                                  output_dir=str(tmp_path / name))
        cfg = DriftConfig.of(cfg).replace_in(cfg, kind=kind, mu=mu)
        return run_simulation(cfg, device="cpu")[1]

    plain, zero, strong = engine("plain", "none"), engine("mu0", "fedprox", 0.0), engine("mu5", "fedprox", 5.0)
    for k, v in plain.model.state_dict().items():
        assert torch.equal(zero.model.state_dict()[k], v), k
    client = [k for k in plain.model.client_keys(2) if k in plain.parameter_names]

    def moved(e) -> float:   # how far the round took the client portion from where it began
        return sum(float(((e.model.state_dict()[k] - e._round_start[k]) ** 2).sum()) for k in client)
    assert moved(strong) < 0.8 * moved(plain)


def test_the_time_model_prices_what_each_correction_adds_to_a_device():
    """SCAFFOLD's correction rides down with the weights (one more client portion's transfer);
    FedProx and SCAFFOLD hold one more copy of the client portion while training."""
    from sfl_core import timing
    from sfl_core.config.run import load_profile
    from sfl_core.fleet import AgentInfo
    from sfl_core.model.accounting import model_costs

    cost = model_costs("small_cnn", (1, 28, 28), 10)[2]
    info = AgentInfo("a", 0, load_profile("s2fl-low-low"), {}, [10] * 10, 100)
    opts = {}
    for kind in ("none", "fedprox", "scaffold"):
        cfg = run_config_from_dict({"run": "d", "model": "small_cnn", "data": {"dataset": "digits"},
                                    "fleet": [{"profile": "s2fl-low-low", "count": 2}], "drift": kind})
        opts[kind] = timing.price_option(cfg, cost, "fp32", info, ratio=1.0)
    none, prox, scaf = opts["none"], opts["fedprox"], opts["scaffold"]
    one_portion = timing.transfer_time(0, cost.client_param_bytes, 1.0, info.profile.downlink)
    assert prox.fixed_s == pytest.approx(none.fixed_s) and prox.per_sample_s == pytest.approx(none.per_sample_s)
    assert scaf.fixed_s - none.fixed_s == pytest.approx(one_portion, rel=1e-6)
    assert scaf.weights_down_s - none.weights_down_s == pytest.approx(one_portion, rel=1e-6)
    assert scaf.weights_up_s == none.weights_up_s
    for kind in ("fedprox", "scaffold"):
        assert opts[kind].mem_fixed - none.mem_fixed == pytest.approx(cost.client_param_bytes)


def _engine(tmp_path, name: str, strategy: str, server_mode: str, kind: str = "scaffold", rounds: int = 3):
    cfg = load_run_config(default_profiles_dir() / "runs" / "demo.yaml")
    cfg = dataclasses.replace(cfg, rounds=rounds, strategy=strategy, split=2, local_iters=4, server_mode=server_mode,
                              codec="fp32", output_dir=str(tmp_path / name))
    cfg = DriftConfig.of(cfg).replace_in(cfg, kind=kind)
    return run_simulation(cfg, device="cpu")[1]


def test_scaffold_on_one_server_copy_per_agent_is_scaffold_on_the_whole_model(tmp_path):
    """SplitFed v1 (one server copy per agent, averaged) at a lossless codec is FedAvg's
    arithmetic split in two. The server copies drift as the client portions do, so SCAFFOLD
    corrects them too, from the coordinator's own copies: the run is FedAvg+SCAFFOLD's, and
    every agent's ``cᵢ`` covers the whole model."""
    fedavg = _engine(tmp_path, "fedavg", "fedavg", "per_agent")
    sfl = _engine(tmp_path, "sfl", "sfl", "per_agent")
    for k, v in fedavg.model.state_dict().items():
        torch.testing.assert_close(sfl.model.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    params = sfl.parameter_names
    for a, mine in sfl.option(Drift).variates.ci.items():
        assert set(mine) == params == set(fedavg.option(Drift).variates.ci[a]), a
        for k, v in mine.items():
            torch.testing.assert_close(v, fedavg.option(Drift).variates.ci[a][k], rtol=1e-4, atol=1e-5)


def test_fedprox_on_one_server_copy_per_agent_is_fedprox_on_the_whole_model(tmp_path):
    """Likewise FedProx: each server copy is pulled towards the round's start by ``μ (w − x)``."""
    fedavg = _engine(tmp_path, "fedavg", "fedavg", "per_agent", kind="fedprox")
    sfl = _engine(tmp_path, "sfl", "sfl", "per_agent", kind="fedprox")
    merged = _engine(tmp_path, "merged", "sfl", "merged", kind="fedprox", rounds=1)
    assert all(g.terms.proximal == 0 for g in merged.server._groups)
    assert DriftConfig.of(sfl.cfg).mu > 0 and all(g.terms.proximal == DriftConfig.of(sfl.cfg).mu for g in sfl.server._groups)
    for k, v in fedavg.model.state_dict().items():
        torch.testing.assert_close(sfl.model.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_one_merged_server_copy_steps_without_a_correction(tmp_path):
    """Nothing averages a copy that trained on every row: it gets no correction, and the
    agents' ``cᵢ`` cover their client portions only."""
    merged = _engine(tmp_path, "merged", "sfl", "merged", rounds=2)
    assert merged._terms.corrections == {}
    client = {k for k in merged.model.client_keys(2) if k in merged.parameter_names}
    assert merged.option(Drift).variates.ci and all(set(mine) == client for mine in merged.option(Drift).variates.ci.values())


def test_a_server_copy_of_one_agent_steps_with_that_agents_correction():
    """One SGD step (no momentum) of agent a's own server copy moves each parameter by
    ``−η (g + c − cₐ)``: against the same step without a correction, exactly ``−η`` times the
    correction, which may cover a leading block only (a bottleneck slice). Agent b's copy,
    given none, steps as before."""
    torch.manual_seed(0)
    model = build_model(MODEL, SHAPE, 10)
    splits = {"a": 2, "b": 2}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        batches = {a: (model.client(2)(torch.randn(6, *SHAPE, generator=gen)), torch.randint(0, 10, (6,), generator=gen))
                   for a in splits}
    names = [k for k, _ in model.named_parameters() if k in model.server_state(2)]
    full, part = names[0], names[-1]
    ca = {full: torch.randn(model.state_dict()[full].shape, generator=gen),
          part: torch.ones(model.state_dict()[part].shape[:1][0] // 2)}

    def one_step(corrections):
        trainer = ServerTrainer(model, lr=0.1, momentum=0.0)
        trainer.begin_round([["a"], ["b"]], splits, corrections=corrections)
        trainer.step(batches)
        return trainer, trainer.member_state("a", 2), trainer.member_state("b", 2)

    _, plain_a, plain_b = one_step(None)
    trainer, corrected_a, corrected_b = one_step({"a": ca})
    assert trainer.member_steps("a") == (0.1, 1, 0.0)
    torch.testing.assert_close(corrected_a[full] - plain_a[full], -0.1 * ca[full], rtol=1e-4, atol=1e-6)
    expected = torch.zeros_like(plain_a[part])
    expected[:ca[part].shape[0]] = -0.1
    torch.testing.assert_close(corrected_a[part] - plain_a[part], expected, rtol=1e-4, atol=1e-6)
    for k in names[1:-1]:
        torch.testing.assert_close(corrected_a[k], plain_a[k])
    for k in names:
        torch.testing.assert_close(corrected_b[k], plain_b[k])


def test_a_server_copy_shared_by_several_agents_takes_no_correction():
    """A copy that trains on the merged rows of several agents mixes their classes: the
    trainer refuses a correction for it rather than guess how to combine theirs."""
    model = build_model(MODEL, SHAPE, 10)
    name = next(k for k, _ in model.named_parameters() if k in model.server_state(2))
    trainer = ServerTrainer(model, lr=0.1, momentum=0.0)
    with pytest.raises(ValueError, match="one agent"):
        trainer.begin_round([["a", "b"]], {"a": 2, "b": 2},
                            corrections={"a": {name: torch.zeros(model.state_dict()[name].shape)}})


def test_s2fl_groups_train_on_merged_rows_and_take_no_correction(tmp_path):
    """S2FL's data-balance groups (two copies of two members each) are averaged, but each
    trains on its members' merged rows: like MergeSFL's one copy they step uncorrected (no
    SCAFFOLD term, no FedProx pull), and the members' ``cᵢ`` cover their client portions only
    (each its own)."""
    common = {
        "run": "s2", "model": "small_cnn", "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
        "fleet": [{"profile": "s2fl-low-low", "count": 2}, {"profile": "s2fl-high-high", "count": 2}],
        "rounds": 2, "strategy": "s2fl", "batch_size": 16, "lr": 0.05, "momentum": 0.5, "local_iters": 4,
        "s2fl": {"sliding": False, "balance": True, "group_size": 2, "candidates": [1, 2, 3]},
    }
    _, prox = run_simulation(run_config_from_dict({**common, "output_dir": str(tmp_path / "prox"),
                                                   "drift": {"kind": "fedprox", "mu": 0.1}}), device="cpu")
    assert prox.server._groups and all(g.terms.proximal == 0 for g in prox.server._groups)
    history, engine = run_simulation(run_config_from_dict({**common, "output_dir": str(tmp_path / "s2"),
                                                           "drift": "scaffold"}), device="cpu")
    groups = history[-1]["groups"]
    assert sorted(len(g) for g in groups) == [2, 2]
    assert engine._terms.corrections == {}
    client = {k for k in engine.model.client_keys(3) if k in engine.parameter_names}
    assert engine.option(Drift).variates.ci and all(set(mine) == client for mine in engine.option(Drift).variates.ci.values())
    for a, b in groups:
        assert any(not torch.allclose(engine.option(Drift).variates.ci[a][k], engine.option(Drift).variates.ci[b][k]) for k in client)
