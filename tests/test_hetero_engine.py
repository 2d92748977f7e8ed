"""HeteroSFL bottlenecks inside the engine: per-agent widths from link rates, narrow agents
sending fewer bytes, HetBL aggregation of the shared full-width pair, real learning."""

from __future__ import annotations

import torch

from sfl_core.config.run import run_config_from_dict


def _cfg(tmp_path, rounds=4, **bottleneck):
    return run_config_from_dict({
        "run": "het", "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid"},
        "fleet": [{"profile": "s2fl-mid-low", "count": 2}, {"profile": "s2fl-mid-high", "count": 2}],
        "rounds": rounds, "strategy": "sfl", "split": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.5,
        "local_iters": 10, "output_dir": str(tmp_path / "out"), "hetero": bottleneck,
    })


def test_slow_link_group_gets_narrow_width_and_sends_fewer_bytes(tmp_path):
    from simulation import run_simulation

    history, engine = run_simulation(_cfg(tmp_path, rounds=8, width=16, groups=2), device="cpu")
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.3, [h["accuracy"] for h in history]
    last = history[-1]["agents"]
    prof = {a: engine.registry.agents[a].profile.name for a in last}
    low = [v for a, v in last.items() if prof[a] == "s2fl-mid-low"]
    high = [v for a, v in last.items() if prof[a] == "s2fl-mid-high"]
    # 1e6 vs 5e6 B/s: widths proportional to the rates, the fast group at full width
    assert {v["width"] for v in high} == {16} and {v["width"] for v in low} == {3}
    assert max(v["bytes_up"] for v in low) < 0.5 * min(v["bytes_up"] for v in high)
    # the global model holds the full-width pair and stays finite
    state = engine.model.state_dict()
    assert state["bottlenecks.2.encoder.weight"].shape[0] == 16
    assert all(torch.isfinite(v.float()).all() for v in state.values())


def test_fixed_widths(tmp_path):
    from simulation import run_simulation

    history, engine = run_simulation(_cfg(tmp_path, width=16, groups=2, widths=[4, 8]), device="cpu")
    widths = {v["width"] for v in history[-1]["agents"].values()}
    assert widths == {4, 8}
    # channels 8..15 were trained by nobody: they keep their initial values (HetBL default)
    torch.manual_seed(0)
    from sfl_core.model.zoo import build_model
    init = build_model("small_cnn", (1, 8, 8), 10)
    init.add_bottleneck(2, 16)
    torch.testing.assert_close(engine.model.state_dict()["bottlenecks.2.encoder.weight"][8:],
                               init.state_dict()["bottlenecks.2.encoder.weight"][8:])


def test_heterosfl_calibrated_loss_and_bdks_train(tmp_path):
    """The full HeteroSFL recipe (HetBL + logit calibration + BDKS) on label-skewed shards learns."""
    from simulation import run_simulation

    cfg = run_config_from_dict({
        "run": "hsfl", "model": "small_cnn", "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.3},
        "fleet": [{"profile": "s2fl-mid-low", "count": 2}, {"profile": "s2fl-mid-high", "count": 2}],
        "rounds": 8, "strategy": "sfl", "split": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.5,
        "local_iters": 10, "output_dir": str(tmp_path / "out"), "loss": "calibrated",
        "hetero": {"width": 16, "groups": 2, "widths": [2, 16], "bdks": True, "bdks_alpha": 1.0},
    })
    history, engine = run_simulation(cfg, device="cpu")
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.25, [h["accuracy"] for h in history]
    assert all(h["train_loss"] == h["train_loss"] for h in history[1:])  # never NaN


def test_codec_per_link_group_without_bottleneck(tmp_path):
    """HeteroSFL's Top-k baseline: the slow group sends top-k sparse activations, the fast fp32."""
    from simulation import run_simulation

    history, _ = run_simulation(_cfg(tmp_path, rounds=2, groups=2, codecs=["topk5", "fp32"]), device="cpu")
    last = history[-1]["agents"]
    by_codec = {}
    for v in last.values():
        by_codec.setdefault(v["codec"], []).append(v)
    assert sorted(by_codec) == ["fp32", "topk5"] and all(v["width"] == 0 for v in last.values())
    assert max(v["bytes_up"] for v in by_codec["topk5"]) < 0.5 * min(v["bytes_up"] for v in by_codec["fp32"])
    assert history[-1]["accuracy"] > history[0]["accuracy"]
