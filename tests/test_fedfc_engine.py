"""FedFC mixed cut layers (docs/methods/fedfc.md): agents on different splits by device profile, one merged
server pass, per-layer averaging over every holder."""

from __future__ import annotations

import pytest

from sfl_core.config.run import ConfigError, run_config_from_dict


def _cfg(tmp_path, **over):
    return run_config_from_dict({
        "run": "fedfc", "model": "small_cnn", "data": {"dataset": "digits", "partition": "class-imbalance"},
        "fleet": [{"profile": "s2fl-low-low", "count": 1}, {"profile": "s2fl-mid-mid", "count": 1},
                  {"profile": "s2fl-high-high", "count": 1}],
        "rounds": 4, "strategy": "sfl", "server_mode": "merged", "split": 2, "batch_size": 16, "lr": 0.05,
        "momentum": 0.5, "local_iters": 10, "output_dir": str(tmp_path / "out"), **over,
    })


def test_mixed_cut_layers_by_profile_train_in_one_server_pass(tmp_path):
    from simulation import run_simulation

    cfg = _cfg(tmp_path, profile_splits={"s2fl-low-low": 1, "s2fl-high-high": 3})
    history, engine = run_simulation(cfg, device="cpu")
    last = history[-1]
    prof = {a: engine.registry.agents[a].profile.name for a in last["agents"]}
    splits = {prof[a]: v["split"] for a, v in last["agents"].items()}
    assert splits == {"s2fl-low-low": 1, "s2fl-mid-mid": 2, "s2fl-high-high": 3}
    assert last["groups"] == [sorted(last["agents"])]          # one merged server batch
    assert last["accuracy"] > history[0]["accuracy"] + 0.2


def test_profile_splits_validated(tmp_path):
    with pytest.raises(ConfigError, match="profile_splits"):
        _cfg(tmp_path, profile_splits={"s2fl-low-low": 0})
    with pytest.raises(ConfigError, match="profile_splits"):
        _cfg(tmp_path, profile_splits={"s2fl-low-low": 1}, strategy="fedavg")
    from simulation import run_simulation
    with pytest.raises(ValueError, match="invalid split point"):
        run_simulation(_cfg(tmp_path, profile_splits={"s2fl-low-low": 9}), device="cpu")


def test_joined_forward_equals_each_agents_rows_run_separately():
    """FedFC's one-pass join (docs/methods/fedfc.md): three agents cut after blocks 1, 2 and 3. The server update
    and each agent's gradient equal those of running every agent's rows through the model on
    its own and combining the per-agent mean losses with weights b_i / N."""
    import copy

    import torch
    import torch.nn.functional as F

    from coordinator.server_trainer import ServerTrainer
    from sfl_core.model.zoo import build_model

    torch.manual_seed(0)
    model = build_model("small_cnn", (1, 8, 8), 10)
    splits = {"a": 1, "b": 2, "c": 3}
    g = torch.Generator().manual_seed(1)
    xs = {a: torch.randn(n, 1, 8, 8, generator=g) for a, n in zip(splits, (3, 5, 4))}
    ys = {a: torch.randint(0, 10, (len(x),), generator=g) for a, x in xs.items()}
    acts = {a: model.client(s)(xs[a]).detach() for a, s in splits.items()}
    trainer = ServerTrainer(model, lr=0.1)
    trainer.begin_round([list(splits)], splits)
    grads, _ = trainer.step({a: (acts[a], ys[a]) for a in splits})

    n = sum(len(x) for x in xs.values())
    ref = copy.deepcopy(model)
    for a, s in splits.items():            # each agent's rows on their own
        h = acts[a].clone().requires_grad_(True)
        out = h
        for blk in ref.blocks[s:]:
            out = blk(out)
        (F.cross_entropy(out, ys[a]) * len(xs[a]) / n).backward()
        torch.testing.assert_close(grads[a], h.grad * n / len(xs[a]))   # gradient of its own mean loss
    new = trainer.member_state("a", 1)
    for name, p in ref.named_parameters():
        if name in new and p.grad is not None:
            torch.testing.assert_close(new[name], (p - 0.1 * p.grad).detach())
