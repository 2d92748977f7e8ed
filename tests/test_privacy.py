"""The privacy defenses' building blocks (sfl_core.privacy): distance correlation, clipped noise."""

from __future__ import annotations

import pytest
import torch

from sfl_core.privacy import ActivationNoise, clip_and_noise, distance_correlation, distance_correlation_u


def test_distance_correlation_is_one_for_similar_and_small_for_independent():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, 4, 4, generator=gen)
    assert distance_correlation(x, x).item() == pytest.approx(1.0, abs=1e-6)
    assert distance_correlation(x, 3 * x + 1).item() == pytest.approx(1.0, abs=1e-6)   # similarity transform
    # the sample statistic is biased upwards in high dimension: independence shows in few dimensions
    u, v = torch.randn(500, 2, generator=gen), torch.randn(500, 2, generator=gen)
    assert distance_correlation(u, v).item() < 0.15
    assert 0.3 < distance_correlation(u, torch.cat([u[:, :1], v[:, :1]], 1)).item() < 0.95


def test_distance_correlation_has_finite_gradients_and_needs_two_rows():
    z = torch.randn(16, 10, requires_grad=True)
    distance_correlation(torch.randn(16, 5), z).backward()
    assert torch.isfinite(z.grad).all() and z.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="size >= 2"):
        distance_correlation(torch.randn(1, 5), torch.randn(1, 5))


def test_clipping_bounds_each_sample_norm_and_passes_gradients():
    z = (torch.randn(64, 8, 3, 3) * torch.linspace(0.1, 10, 64).view(-1, 1, 1, 1)).requires_grad_(True)
    out = clip_and_noise(z, ActivationNoise(clip=2.0, sigma=0.0))
    norms = out.detach().flatten(1).norm(dim=1)
    assert norms.max().item() <= 2.0 + 1e-5
    small = z.detach().flatten(1).norm(dim=1) < 2.0
    torch.testing.assert_close(out.detach()[small], z.detach()[small])   # small samples pass unchanged
    out.sum().backward()
    assert torch.isfinite(z.grad).all() and z.grad.abs().sum() > 0


def test_noise_has_the_specified_standard_deviation_and_follows_the_generator():
    z = torch.zeros(4000, 50)
    noise = ActivationNoise(clip=1.5, sigma=0.4)
    out = clip_and_noise(z, noise, torch.Generator().manual_seed(1))
    assert out.std().item() == pytest.approx(0.4 * 1.5, rel=0.02)
    assert out.mean().item() == pytest.approx(0.0, abs=0.01)
    again = clip_and_noise(z, noise, torch.Generator().manual_seed(1))
    assert torch.equal(out, again)


@pytest.mark.parametrize("clip, sigma", [(0.0, 1.0), (-1.0, 1.0), (1.0, -0.1)])
def test_bad_noise_settings_are_refused(clip, sigma):
    with pytest.raises(ValueError):
        ActivationNoise(clip, sigma)


# ------------------------------------------------------------------ on the agent
from agent_harness import Coordinator, make_agent, send  # noqa: E402
from sfl_core.wire import codec as wire  # noqa: E402
from sfl_core.data.builtin import load_dataset  # noqa: E402
from sfl_core.privacy import AgentPrivacy  # noqa: E402


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _first_activations(agent, coord) -> torch.Tensor:
    (reply,) = send(agent, coord.assign(0, tau=2, batch=32))
    return wire.decode_tensor(reply.body["x"])


def test_activation_noise_changes_what_leaves_by_the_specified_amount(digits):
    """Same shard, seed and weights: the noisy agent sends the clean activations plus noise of
    std sigma x clip (clip large enough not to bite), and clipped ones never exceed clip."""
    clean = _first_activations(make_agent(digits), Coordinator(digits))
    noise = ActivationNoise(clip=1e6, sigma=2e-6)
    noisy = _first_activations(make_agent(digits, privacy=AgentPrivacy(activation_noise=noise)), Coordinator(digits))
    assert (noisy - clean).std().item() == pytest.approx(2.0, rel=0.05)
    tight = ActivationNoise(clip=0.5, sigma=0.0)
    clipped = _first_activations(make_agent(digits, privacy=AgentPrivacy(activation_noise=tight)), Coordinator(digits))
    assert clipped.flatten(1).norm(dim=1).max().item() <= 0.5 + 1e-5 < clean.flatten(1).norm(dim=1).max().item()


def test_nopeek_lowers_the_distance_correlation_of_what_is_sent(digits):
    """Training rounds against a real server portion: with NoPeek the activations' distance
    correlation to the inputs ends lower than without, and the agent still learns."""
    def train(privacy):
        agent, coord = make_agent(digits, n=600, privacy=privacy), Coordinator(digits, lr=0.1, momentum=0.9)
        for rnd in range(4):
            (reply,) = send(agent, coord.assign(rnd, tau=10, batch=32, lr=0.1, momentum=0.9))
            while reply.type == "activations":
                (reply,) = send(agent, coord.gradients(reply))
            coord.take_weights(reply)
        x = digits.x_test[:256]
        with torch.no_grad():
            z = coord.model.client(2)(x)
        return distance_correlation(x, z).item(), coord.accuracy(digits)

    plain_dcor, plain_acc = train(AgentPrivacy())
    nopeek_dcor, nopeek_acc = train(AgentPrivacy(nopeek=2.0))
    assert nopeek_dcor < plain_dcor - 0.05, (nopeek_dcor, plain_dcor)
    assert nopeek_acc > 0.3, nopeek_acc


def test_a_simulation_applies_the_runs_defenses_and_records_them(tmp_path):
    from simulation import run_simulation
    from sfl_core.config.run import run_config_from_dict

    cfg = run_config_from_dict({
        "run": "priv", "model": "small_cnn", "data": {"dataset": "digits"}, "strategy": "sfl",
        "fleet": [{"profile": "s2fl-high-high", "count": 2}], "rounds": 2, "local_iters": 10, "lr": 0.1,
        "momentum": 0.5, "privacy": {"nopeek": 0.5, "activation_noise": {"clip": 20.0, "sigma": 0.01}},
        "output_dir": str(tmp_path / "out")})
    history, engine = run_simulation(cfg, device="cpu")
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.2
    assert all(r["privacy"] == [{"defenses": {"nopeek": 0.5, "activation_noise": {"clip": 20.0, "sigma": 0.01}},
                                 "agents": 2}] for r in history[1:])
    assert all(a.privacy == cfg.privacy.agent() for a in engine.transport.agents.values())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_agents_defend_themselves_against_a_coordinator_that_knows_nothing(mosquitto, tmp_path):
    """Each agent process switches defenses on with its own flags; the coordinator's config says
    nothing of privacy. The run completes with every agent, the model learns, and the metrics
    record what each agent declared and the DP agent's epsilon."""
    from helpers import finish, logs, metrics, start_agents, start_coord, write_config

    config = write_config(tmp_path, "prv", rounds=2)
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "prv", tmp_path, emulate=False,
                          extra={0: ["--nopeek", "0.5"], 1: ["--activation-noise", "20,0.01"],
                                 2: ["--withhold-labels", "--label-protection", "max_norm", "--dp-sgd", "5,0.5"]})
    assert finish([coord, *agents], timeout=180) == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    assert all(sorted(r["completed"]) == ["a0", "a1", "a2"] for r in m[1:])
    assert m[-1]["accuracy"] > m[0]["accuracy"] + 0.2, m
    declared = {a: r.get("privacy") for a, r in m[-1]["agents"].items()}
    assert declared == {"a0": {"nopeek": 0.5}, "a1": {"activation_noise": {"clip": 20.0, "sigma": 0.01}},
                        "a2": {"withhold_labels": True, "label_protection": "max_norm",
                               "dp_sgd": {"clip": 5.0, "sigma": 0.5, "delta": 1e-5}}}
    assert m[-1]["agents"]["a2"]["labels_withheld"] and m[-1]["epsilon_max"] > m[1]["epsilon_max"] > 0
    assert "privacy defenses on what this agent sends: {'nopeek': 0.5}" in (tmp_path / "agent-0.log").read_text()
    assert "activation_noise" in (tmp_path / "agent-1.log").read_text()


def test_bad_privacy_settings_are_one_line_naming_the_field(tmp_path):
    from typer.testing import CliRunner

    from cli.agent import app
    from sfl_core.config.run import ConfigError, run_config_from_dict

    with pytest.raises(ConfigError, match="privacy.activation_noise"):
        run_config_from_dict({"fleet": ["s2fl-low-low"], "privacy": {"activation_noise": {"clip": 0, "sigma": 1}}})
    as_flag = run_config_from_dict({"fleet": ["s2fl-low-low"], "privacy": {"activation_noise": "2,0.5"}})
    assert as_flag.privacy.activation_noise == ActivationNoise(2.0, 0.5)   # the agent flag's form works too
    with pytest.raises(ConfigError, match="privacy.nopeek"):
        run_config_from_dict({"fleet": ["s2fl-low-low"], "privacy": {"nopeek": -1}})
    res = CliRunner().invoke(app, ["start", "--profile", "s2fl-low-low", "--activation-noise", "1"])
    assert res.exit_code == 2 and "--activation-noise 1: expected CLIP,SIGMA" in res.output
    assert "Traceback" not in res.output


# ------------------------------------------------------------------ label protection
from sfl_core.privacy import (DpSgd, LabelProtection, clip_and_noise_per_sample, dp_epsilon,  # noqa: E402
                              dp_sgd_gradients, protect_label_grads)


def _logit_grads(n: int = 64, classes: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, classes, generator=gen).requires_grad_(True)
    y = torch.randint(0, classes, (n,), generator=gen)
    torch.nn.functional.cross_entropy(z, y).backward()
    return z.grad, y


def test_max_norm_gives_every_sample_the_largest_expected_norm_and_sigma_the_stated_noise():
    g, _ = _logit_grads()
    gen = torch.Generator().manual_seed(3)
    draws = torch.stack([protect_label_grads(g, LabelProtection("max_norm"), gen) for _ in range(2000)])
    mean_sq = draws.pow(2).sum(-1).mean(0)                         # E|g_j + noise|^2, per sample
    biggest = g.pow(2).sum(1).max()
    torch.testing.assert_close(mean_sq, torch.full_like(mean_sq, biggest.item()), rtol=0.1, atol=0)
    torch.testing.assert_close(draws.mean(0), g, rtol=0, atol=0.1 * biggest.sqrt().item())   # unbiased
    noisy = protect_label_grads(g, LabelProtection("sigma", 0.5), gen)
    assert (noisy - g).std().item() == pytest.approx(0.5 * 2 ** 0.5 / 64, rel=0.05)
    assert LabelProtection.parse("max_norm") == LabelProtection("max_norm")
    assert LabelProtection.parse({"sigma": 2}) == LabelProtection.parse("2") == LabelProtection("sigma", 2.0)
    for bad in ("maxnorm", -1, True, {"sigma": 1, "x": 2}):
        with pytest.raises(ValueError):
            LabelProtection.parse(bad)


def _direction_attack(g: torch.Tensor) -> torch.Tensor:
    """The label a curious coordinator reads off logit gradients: the one negative coordinate."""
    return g.argmin(dim=1)


def test_label_protection_changes_the_logit_gradients_an_agent_returns(digits):
    """Withheld labels leak through the logit gradients (the direction attack reads every one);
    with sigma-noise on, what the agent returns is the exact gradient plus the stated noise
    and the attack drops towards chance."""
    def reply(privacy):
        agent, coord = make_agent(digits, privacy=privacy), Coordinator(digits)
        (act,) = send(agent, coord.assign(1, tau=2, batch=64))
        z = torch.randn(64, digits.num_classes, generator=torch.Generator().manual_seed(0))
        from sfl_core.wire import protocol
        from agent_harness import RUN, through_wire
        (out,) = send(agent, through_wire(protocol.Message("logits", RUN, protocol.COORDINATOR_ID,
                                                             {"z": wire.encode_tensor(z)}, round=1, step=0, seq=9)))
        return wire.decode_tensor(out.body["g"]), agent._y   # noqa: SLF001 (the labels it kept)

    plain, y = reply(AgentPrivacy(withhold_labels=True))
    assert (_direction_attack(plain) == y).float().mean().item() == 1.0
    noisy, y2 = reply(AgentPrivacy(withhold_labels=True, label_protection=LabelProtection("sigma", 4.0)))
    assert torch.equal(y, y2)
    assert (noisy - plain).std().item() == pytest.approx(4.0 * 2 ** 0.5 / 64, rel=0.15)
    assert (_direction_attack(noisy) == y).float().mean().item() < 0.5
    with pytest.raises(ValueError, match="needs withheld labels"):
        AgentPrivacy(label_protection=LabelProtection("max_norm"))


# ------------------------------------------------------------------ DP-SGD
def test_per_sample_clipping_bounds_each_sample_and_adds_the_stated_noise():
    grads = {"w": torch.randn(32, 5, 3) * 10, "b": torch.randn(32, 5)}
    tiny = clip_and_noise_per_sample(grads, DpSgd(clip=1.0, sigma=1e-9))
    # each sample clipped to norm 1 over both tensors together: the sum's norm is at most 32
    total = torch.cat([tiny["w"].flatten(), tiny["b"].flatten()]).norm().item()
    assert total <= 32 + 1e-4
    zero = {"w": torch.zeros(4, 200, 50)}
    noisy = clip_and_noise_per_sample(zero, DpSgd(clip=0.5, sigma=2.0), torch.Generator().manual_seed(0))
    assert noisy["w"].std().item() == pytest.approx(1.0, rel=0.02)   # sigma x clip


def test_dp_sgd_gradients_are_the_batch_gradient_when_clipping_does_not_bite():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(36, 3))
    x, y = torch.randn(8, 1, 5, 5), torch.randint(0, 3, (8,))
    torch.nn.functional.cross_entropy(net(x), y).backward()
    expected = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    dp_sgd_gradients(net, x, y, lambda out, t: torch.nn.functional.cross_entropy(out.unsqueeze(0), t.unsqueeze(0)),
                     DpSgd(clip=1e6, sigma=1e-12))
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-4, atol=1e-6)
    bn = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match="without BatchNorm"):
        dp_sgd_gradients(bn, x, torch.zeros(8, 4, 3, 3), lambda o, t: (o * t).sum(), DpSgd(1.0, 1.0))


def test_epsilon_grows_with_steps_and_shrinks_with_noise():
    few, more = dp_epsilon({0.05: 100}, 1.0, 1e-5), dp_epsilon({0.05: 400}, 1.0, 1e-5)
    assert 0 < few < more
    assert dp_epsilon({0.05: 400}, 2.0, 1e-5) < more
    assert dp_epsilon({0.05: 100, 0.1: 100}, 1.0, 1e-5) > dp_epsilon({0.05: 200}, 1.0, 1e-5)   # composed over rates
    assert dp_epsilon({}, 1.0, 1e-5) == 0.0


def test_dp_sgd_agent_sends_noisy_weights_and_reports_its_epsilon(digits):
    """Same shard, seed and server: the DP agent's client weights differ from the plain agent's
    by the noise, and each weights message carries the epsilon of the steps taken so far."""
    def rounds(privacy, n_rounds=2):
        agent, coord = make_agent(digits, n=320, privacy=privacy), Coordinator(digits, lr=0.1)
        sent = []
        for rnd in range(n_rounds):
            (reply,) = send(agent, coord.assign(rnd, tau=5, batch=32, lr=0.1))
            while reply.type == "activations":
                (reply,) = send(agent, coord.gradients(reply))
            sent.append(reply)
            coord.take_weights(reply)
        return sent, coord

    plain, _ = rounds(AgentPrivacy())
    dp = DpSgd(clip=1.0, sigma=1.0, delta=1e-5)
    private, coord = rounds(AgentPrivacy(dp_sgd=dp))
    assert "epsilon" not in plain[0].body
    eps = [m.body["epsilon"] for m in private]
    assert eps == pytest.approx([dp_epsilon({0.1: 5}, 1.0, 1e-5), dp_epsilon({0.1: 10}, 1.0, 1e-5)])
    assert 0 < eps[0] < eps[1]
    a = wire.decode_state(plain[0].body["weights"], coord.model.client_state(2))
    b = wire.decode_state(private[0].body["weights"], coord.model.client_state(2))
    assert any(not torch.allclose(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="cannot be combined with nopeek"):
        AgentPrivacy(nopeek=1.0, dp_sgd=dp)


def test_a_simulation_with_every_agent_defense_trains_and_records_epsilon(tmp_path):
    """Labels withheld and protected, DP-SGD on the client portion: the run still learns, and
    each round records the defenses (with how many agents) and the largest epsilon, growing."""
    from simulation import run_simulation
    from sfl_core.config.run import run_config_from_dict

    privacy = {"withhold_labels": True, "label_protection": "max_norm",
               "dp_sgd": {"clip": 5.0, "sigma": 0.5, "delta": 1e-5}}
    cfg = run_config_from_dict({
        "run": "priv-dp", "model": "small_cnn", "data": {"dataset": "digits"}, "strategy": "sfl",
        "fleet": [{"profile": "s2fl-high-high", "count": 2}], "rounds": 3, "local_iters": 10, "lr": 0.1,
        "momentum": 0.5, "privacy": privacy, "output_dir": str(tmp_path / "out")})
    history, _ = run_simulation(cfg, device="cpu")
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.2, [r["accuracy"] for r in history]
    described = {"withhold_labels": True, "label_protection": "max_norm",
                 "dp_sgd": {"clip": 5.0, "sigma": 0.5, "delta": 1e-5}}
    assert all(r["privacy"] == [{"defenses": described, "agents": 2}] for r in history[1:])
    eps = [r["epsilon_max"] for r in history[1:]]
    assert all(e > 0 for e in eps) and eps == sorted(eps) and eps[0] < eps[-1]
    assert all(a["labels_withheld"] for r in history[1:] for a in r["agents"].values())


def test_the_new_defenses_bad_settings_are_one_line_naming_the_field():
    from typer.testing import CliRunner

    from cli.agent import app
    from sfl_core.config.run import ConfigError, run_config_from_dict

    with pytest.raises(ConfigError, match="privacy.label_protection.*withheld labels"):
        run_config_from_dict({"fleet": ["s2fl-low-low"], "privacy": {"label_protection": "max_norm"}})
    with pytest.raises(ConfigError, match="privacy.dp_sgd"):
        run_config_from_dict({"fleet": ["s2fl-low-low"], "privacy": {"dp_sgd": {"clip": 1, "sigma": 0}}})
    with pytest.raises(ConfigError, match="privacy.dp_sgd.*nopeek"):
        run_config_from_dict({"fleet": ["s2fl-low-low"], "privacy": {"nopeek": 1, "dp_sgd": "1,1"}})
    res = CliRunner().invoke(app, ["start", "--profile", "s2fl-low-low", "--label-protection", "max_norm"])
    assert res.exit_code == 2 and "withheld labels" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["start", "--profile", "s2fl-low-low", "--dp-sgd", "1"])
    assert res.exit_code == 2 and "--dp-sgd 1: expected CLIP,SIGMA" in res.output


def test_the_coordinator_records_declared_defenses_and_rejects_malformed_ones():
    from coordinator.registry import Registry
    from sfl_core.wire import protocol
    from sfl_core.config.run import load_profile

    def register(privacy):
        body = protocol.register_body(index=0, profile=load_profile("s2fl-low-low"), measured={},
                                      label_counts=[1, 1], num_samples=2, emulate=True, resume={}, privacy=privacy)
        return protocol.decode(protocol.Message("register", "r", "a1", body, seq=1).encode(), run="r")

    reg = Registry(num_classes=2)
    declared = AgentPrivacy(withhold_labels=True, label_protection=LabelProtection("sigma", 1.0),
                            dp_sgd=DpSgd(1.0, 1.0)).describe()
    assert reg.register(register(declared)).privacy == declared
    assert "privacy" not in register({}).body            # nothing declared: the old message
    assert reg.register(register({})).privacy == {}
    for bad, why in (({"telepathy": 1}, "unknown defense"), ({"dp_sgd": {"clip": -1, "sigma": 1}}, "clip"),
                     ({"label_protection": "max_norm"}, "withheld labels")):
        with pytest.raises(wire.WireError, match=f"register.privacy: .*{why}"):
            reg.register(register(bad))


def test_bias_corrected_distance_correlation_is_near_zero_for_independent_high_dimensional_data():
    """The plain sample statistic calls independent 500-dimensional samples strongly dependent;
    the U-statistic says about 0, and still 1 for a similarity transform."""
    gen = torch.Generator().manual_seed(0)
    x, z = torch.randn(200, 500, generator=gen), torch.randn(200, 500, generator=gen)
    assert distance_correlation(x, z).item() > 0.8
    assert abs(distance_correlation_u(x, z)) < 0.05
    assert distance_correlation_u(x, 2 * x + 3) == pytest.approx(1.0, abs=1e-6)
    assert 0.08 < distance_correlation_u(x, x[:, :50] + torch.randn(200, 50, generator=gen)) < 0.9   # partly dependent
    with pytest.raises(ValueError, match=">= 4"):
        distance_correlation_u(x[:3], z[:3])


def test_dp_sgd_also_covers_a_fedavg_round_on_the_whole_model(digits):
    coord = Coordinator(digits, split=4)
    agent = make_agent(digits, n=320, privacy=AgentPrivacy(dp_sgd=DpSgd(clip=1.0, sigma=1.0)))
    (reply,) = send(agent, coord.assign(0, tau=5, batch=32, strategy="fedavg"))
    assert reply.type == "weights" and reply.body["epsilon"] == pytest.approx(dp_epsilon({0.1: 5}, 1.0, 1e-5))
    assert reply.body["loss"] == reply.body["loss"]   # the agent's own loss is still reported
