"""The privacy defenses' building blocks (sfl_core.privacy): distance correlation, clipped noise."""

from __future__ import annotations

import pytest
import torch

from sfl_core.privacy import ActivationNoise, clip_and_noise, distance_correlation


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
from sfl_core import wire  # noqa: E402
from sfl_core.data import load_dataset  # noqa: E402
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
    from coordinator.api import run_simulation
    from sfl_core.config import run_config_from_dict

    cfg = run_config_from_dict({
        "run": "priv", "model": "small_cnn", "data": {"dataset": "digits"}, "strategy": "sfl",
        "fleet": [{"profile": "s2fl-high-high", "count": 2}], "rounds": 2, "local_iters": 10, "lr": 0.1,
        "momentum": 0.5, "privacy": {"nopeek": 0.5, "activation_noise": {"clip": 20.0, "sigma": 0.01}},
        "output_dir": str(tmp_path / "out")})
    history, engine = run_simulation(cfg, device="cpu")
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.2
    assert all(r["privacy"] == {"nopeek": 0.5, "activation_noise": {"clip": 20.0, "sigma": 0.01}}
               for r in history[1:])
    assert all(a.privacy == cfg.privacy.agent() for a in engine.transport.agents.values())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_agents_defend_themselves_against_a_coordinator_that_knows_nothing(mosquitto, tmp_path):
    """Two of three agent processes switch defenses on with their own flags; the coordinator's
    config says nothing of privacy. The run completes with every agent and the model learns."""
    from helpers import finish, logs, metrics, start_agents, start_coord, write_config

    config = write_config(tmp_path, "prv", rounds=2)
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "prv", tmp_path, emulate=False,
                          extra={0: ["--nopeek", "0.5"], 1: ["--activation-noise", "20,0.01"]})
    assert finish([coord, *agents], timeout=180) == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    assert all(sorted(r["completed"]) == ["a0", "a1", "a2"] for r in m[1:])
    assert m[-1]["accuracy"] > m[0]["accuracy"] + 0.2, m
    assert "privacy defenses on what this agent sends: {'nopeek': 0.5}" in (tmp_path / "agent-0.log").read_text()
    assert "activation_noise" in (tmp_path / "agent-1.log").read_text()


def test_bad_privacy_settings_are_one_line_naming_the_field(tmp_path):
    from typer.testing import CliRunner

    from edge_agent.cli import app
    from sfl_core.config import ConfigError, run_config_from_dict

    with pytest.raises(ConfigError, match="privacy.activation_noise"):
        run_config_from_dict({"fleet": ["s2fl-low-low"], "privacy": {"activation_noise": {"clip": 0, "sigma": 1}}})
    as_flag = run_config_from_dict({"fleet": ["s2fl-low-low"], "privacy": {"activation_noise": "2,0.5"}})
    assert as_flag.privacy.activation_noise == ActivationNoise(2.0, 0.5)   # the agent flag's form works too
    with pytest.raises(ConfigError, match="privacy.nopeek"):
        run_config_from_dict({"fleet": ["s2fl-low-low"], "privacy": {"nopeek": -1}})
    res = CliRunner().invoke(app, ["start", "--profile", "s2fl-low-low", "--activation-noise", "1"])
    assert res.exit_code == 2 and "--activation-noise 1: expected CLIP,SIGMA" in res.output
    assert "Traceback" not in res.output
