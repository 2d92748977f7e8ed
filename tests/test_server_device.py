"""The server step on a GPU (coordinator/host_copies.py): staged, non-blocking copies and one wait
per step give the same gradients, losses and models as the CPU, and the gradients handed out stay
valid while the caller holds them. The GPU tests skip on machines without one; the CPU ones
pin the contract the GPU path keeps."""

from __future__ import annotations

import pytest

import torch

from coordinator import host_copies
from coordinator.server_trainer import ServerTrainer
from sfl_core.model.zoo import build_model
from helpers import withheld_answers

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
AGENTS = {"a": 1, "b": 1, "c": 2}    # agent -> split: two cut after block 1, one after block 2


def _model():
    torch.manual_seed(0)
    return build_model("small_cnn", (1, 8, 8), 10)


def _batches(model, step: int, withheld: str | None = None):
    g = torch.Generator().manual_seed(100 + step)
    out = {}
    for a, split in AGENTS.items():
        x = torch.randn(4, 1, 8, 8, generator=g)
        with torch.no_grad():
            z = model.client(split)(x)
        y = torch.randint(0, 10, (4,), generator=g)
        out[a] = (z.contiguous(), None if a == withheld else y)
    return out


def _run(device: str, groups, *, sequential=False, withheld=None, steps=3, stage=False):
    """Three steps of a trainer on ``device``; every step's gradients and loss, and the final server state."""
    model = _model()
    trainer = ServerTrainer(_model().to(device), lr=0.1, momentum=0.9, device=device)
    trainer.begin_round(groups, AGENTS, sequential=sequential)
    labels = {}

    def exchange(logits):   # the agent's side of MergeSFL's logit exchange, on the host
        return withheld_answers(logits, labels)

    history = []
    for k in range(steps):
        batches = _batches(model, k)
        labels = {a: b[1] for a, b in batches.items()}
        if withheld:
            batches[withheld] = (batches[withheld][0], None)
        if stage:
            batches = {a: trainer.stage(b) for a, b in batches.items()}
        grads, loss = trainer.step(batches, exchange if withheld else None)
        history.append((grads, loss))
    return history, {a: trainer.member_state(a, AGENTS[a]) for a in AGENTS}


CASES = {
    "merged": dict(groups=[list(AGENTS)]),
    "per_agent": dict(groups=[[a] for a in AGENTS]),
    "sequential": dict(groups=[list(AGENTS)], sequential=True),
    "withheld labels": dict(groups=[list(AGENTS)], withheld="b"),
}


def test_the_cases_the_gpu_test_compares_run_on_the_cpu():
    # the reference side of the GPU comparison: withholding labels changes nothing (the agent
    # scores its own logits), per-agent copies and SplitFed v2 do change the models
    merged, merged_state = _run("cpu", **CASES["merged"])
    withheld, withheld_state = _run("cpu", **CASES["withheld labels"])
    for (g1, l1), (g2, l2) in zip(merged, withheld):
        assert abs(l1 - l2) < 1e-5 and all(torch.allclose(g1[a], g2[a], atol=1e-6) for a in AGENTS)
        assert all(g.device.type == "cpu" and g.shape[0] == 4 for g in g1.values())
    for case in ("per_agent", "sequential"):
        other, _ = _run("cpu", **CASES[case])
        assert not torch.allclose(other[-1][0]["a"], merged[-1][0]["a"])


def test_host_copies_are_the_plain_operations_on_the_cpu():
    t = torch.arange(6.0)
    assert host_copies.to_device(t, torch.device("cpu")) is t
    assert torch.equal(host_copies.to_host(t), t)
    host_copies.wait(torch.device("cpu"))


@GPU
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", [False, True])
def test_the_gpu_step_matches_the_cpu_step(case, stage):
    cpu, cpu_state = _run("cpu", **CASES[case])
    gpu, gpu_state = _run("cuda", stage=stage, **CASES[case])
    for (g_cpu, l_cpu), (g_gpu, l_gpu) in zip(cpu, gpu):
        assert abs(l_cpu - l_gpu) < 1e-4
        assert set(g_cpu) == set(g_gpu)
        for a in g_cpu:
            assert g_gpu[a].device.type == "cpu" and g_gpu[a].is_pinned()
            torch.testing.assert_close(g_gpu[a], g_cpu[a], rtol=1e-4, atol=1e-5)
    for a in cpu_state:
        for k in cpu_state[a]:
            torch.testing.assert_close(gpu_state[a][k], cpu_state[a][k], rtol=1e-4, atol=1e-5)


@GPU
def test_gpu_gradients_held_by_the_caller_are_not_overwritten():
    # the pinned blocks are recycled by PyTorch's caching host allocator: a held one must not be
    history, _ = _run("cuda", steps=6, **CASES["merged"])
    reference, _ = _run("cpu", steps=6, **CASES["merged"])
    for (g_gpu, _), (g_cpu, _) in zip(history, reference):
        for a in g_cpu:
            torch.testing.assert_close(g_gpu[a], g_cpu[a], rtol=1e-4, atol=1e-5)


@GPU
def test_staged_batches_are_on_the_gpu():
    trainer = ServerTrainer(_model().cuda(), lr=0.1, device="cuda")
    x, y = trainer.stage((torch.randn(2, 3), torch.tensor([1, 2])))
    assert x.device.type == "cuda" and y.device.type == "cuda"
    assert trainer.stage((x, None))[1] is None

