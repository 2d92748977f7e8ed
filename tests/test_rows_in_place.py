"""A step's activations decoded straight into the batch the server step merges
(``ServerTrainer.place_rows``, ``decode_tensor(out=...)``): the same step, bit for bit, as rows
decoded apart and copied together."""

from __future__ import annotations

import pytest
import torch

from coordinator.server_trainer import ServerTrainer
from sfl_core.model.zoo import build_model
from sfl_core.wire import codec as wire
from sfl_core.wire.codec import WireError
from helpers import withheld_answers

SHAPE = (32, 4, 4)   # small_cnn's activations at split 2 on 8x8 inputs


def _model(bottleneck: bool = False):
    torch.manual_seed(0)
    model = build_model("small_cnn", (1, 8, 8), 10)
    if bottleneck:
        model.add_bottleneck(2, 8)
    return model


def _messages(sizes: dict[str, int], codec: str = "fp16") -> dict[str, tuple[dict, torch.Tensor]]:
    """Each agent's encoded activations (as they arrive) and labels."""
    g = torch.Generator().manual_seed(1)
    return {a: (wire.encode_tensor(torch.randn(b, *SHAPE, generator=g).relu(), codec, 3),
                torch.randint(0, 10, (b,), generator=g))
            for a, b in sizes.items()}


def _trainer(agents, sequential: bool = False, bottleneck: bool = False) -> ServerTrainer:
    trainer = ServerTrainer(_model(bottleneck), lr=0.1, momentum=0.9)
    trainer.begin_round([sorted(agents)], {a: 2 for a in agents}, sequential=sequential)
    return trainer


@pytest.mark.parametrize("codec", ["fp32", "fp16", "bf16", "int8", "topk10"])
def test_a_tensor_decoded_into_its_place_is_the_tensor_decoded_alone(codec):
    x = torch.randn(3, *SHAPE).relu()
    obj = wire.encode_tensor(x, codec, 3)
    place = torch.full((3, *SHAPE), float("nan"))
    out = wire.decode_tensor(obj, shape=(3, *SHAPE), dtypes=("float32", "float16"), out=place)
    assert out is place and torch.equal(place, wire.decode_tensor(obj, shape=(3, *SHAPE), dtypes=("float32", "float16")))


def test_a_tensor_that_does_not_fit_its_place_is_refused_before_anything_is_written():
    obj = wire.encode_tensor(torch.ones(2, *SHAPE), "fp16", 3)
    place = torch.zeros(3, *SHAPE)
    with pytest.raises(WireError, match="does not fit"):
        wire.decode_tensor(obj, out=place)
    assert not place.any()
    with pytest.raises(ValueError, match="float32"):
        wire.decode_tensor(obj, out=torch.zeros(2, *SHAPE, dtype=torch.float16))


def _step(sizes: dict[str, int], *, in_place: bool, leave_out: tuple[str, ...] = (), sequential: bool = False,
          bottleneck: bool = False, withheld: tuple[str, ...] = (), steps: int = 2):
    """Two server steps on the same messages; the agents' gradients, the losses and the copy's state."""
    messages = _messages(sizes)
    trainer = _trainer(sizes, sequential, bottleneck)
    out = []
    for _ in range(steps):
        places = trainer.place_rows({a: (b, *SHAPE) for a, b in sizes.items()}) if in_place else {}
        batches = {a: (wire.decode_tensor(obj, shape=(sizes[a], *SHAPE), out=places.get(a)), None if a in withheld else y)
                   for a, (obj, y) in messages.items()}
        labels = {a: y for a, (_, y) in messages.items()}
        grads, loss = trainer.step({a: b for a, b in batches.items() if a not in leave_out},
                                   lambda logits: withheld_answers(logits, labels))
        out.append((grads, loss))
    return out, trainer.member_state(sorted(sizes)[0], 2), places


def _same(a, b):
    (steps_a, state_a, _), (steps_b, state_b, _) = a, b
    for (grads_a, loss_a), (grads_b, loss_b) in zip(steps_a, steps_b):
        assert loss_a == loss_b and sorted(grads_a) == sorted(grads_b)
        assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


@pytest.fixture
def copied(monkeypatch) -> list[int]:
    """The rows of each activations batch a step copies together (``torch.cat`` of 4-D tensors)."""
    seen: list[int] = []
    cat = torch.cat

    def counting(tensors, *args, **kwargs):
        if tensors and tensors[0].dim() == 4:
            seen.append(sum(len(t) for t in tensors))
        return cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", counting)
    return seen


def test_a_step_on_rows_decoded_in_place_is_the_step_on_rows_copied_together(copied):
    sizes = {"a2": 8, "a0": 8, "a1": 5}
    apart = _step(sizes, in_place=False)
    assert copied == [21, 21]
    copied.clear()
    in_place = _step(sizes, in_place=True)
    assert copied == [] and sorted(in_place[2]) == ["a0", "a1", "a2"]
    _same(in_place, apart)


def test_agents_that_withhold_their_labels_get_the_same_gradients_in_place(copied):
    """MergeSFL's agents that keep their labels score their rows' logits themselves; the step
    backpropagates their answers through the same batch."""
    sizes = {"a0": 8, "a1": 6, "a2": 8}
    in_place = _step(sizes, in_place=True, withheld=("a1",))
    assert copied == []
    _same(in_place, _step(sizes, in_place=False, withheld=("a1",)))


def test_a_step_that_leaves_an_agents_rows_out_copies_the_others_together_as_before(copied):
    sizes = {"a0": 8, "a1": 8, "a2": 8}
    in_place = _step(sizes, in_place=True, leave_out=("a1",))
    assert copied == [16, 16]
    _same(in_place, _step(sizes, in_place=False, leave_out=("a1",)))


@pytest.mark.parametrize("setting", ["sequential", "bottleneck"])
def test_nothing_is_placed_where_the_step_does_not_merge_the_rows_as_they_came(setting):
    """SplitFed v2 trains on each agent's rows in turn; a bottleneck's decoder runs on the rows
    before they join. The step is the same either way."""
    sizes = {"a0": 8, "a1": 8}
    kw = {setting: True}
    trainer = _trainer(sizes, **kw)
    assert trainer.place_rows({a: (b, *SHAPE) for a, b in sizes.items()}) == {}
    if setting == "sequential":
        _same(_step(sizes, in_place=True, **kw), _step(sizes, in_place=False, **kw))
