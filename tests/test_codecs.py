"""Activation/gradient codecs beyond fp32/fp16: bf16, int8 (per channel) and top-k.

The tensors are real: ReLU activations of ``small_cnn``'s client portion at split 2 on MNIST
(random images when this machine lacks the data set) and the gradient the server portion
sends back. Error bounds are the ones each codec promises, so a codec that silently loses
precision fails here. Every decoder input is untrusted: the rejection tests tamper with one
field at a time and expect :class:`WireError` before anything is allocated.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgpack
import pytest
import torch
import torch.nn.functional as F

from sfl_core.wire import codec as wire
from sfl_core.model.zoo import build_model
from sfl_core.wire.codec import WireError
from helpers import DATASETS

MNIST = DATASETS / "mnist"
FLOAT = ("float32", "float16")  # what the engine and agent pass: "a float tensor"
LOSSY = ("bf16", "int8", "topk10", "topk1")


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    """ReLU activations (64, 32, 14, 14) at split 2 and their gradient from the server portion."""
    torch.manual_seed(0)
    if MNIST.is_dir():
        from sfl_core.data.builtin import load_dataset

        ds = load_dataset("mnist", MNIST)
        x, y = ds.x_train[:64], ds.y_train[:64]
    else:
        x, y = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
    model = build_model("small_cnn", (1, 28, 28), 10).train()
    with torch.no_grad():
        act = model.client(2)(x)
    a = act.clone().requires_grad_(True)
    F.cross_entropy(model.server(2)(a), y).backward()
    assert a.grad is not None
    return {"act": act.contiguous(), "grad": a.grad.contiguous()}


def _via_msgpack(obj: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False)


# ------------------------------------------------------------------ names


def test_codec_names() -> None:
    assert set(wire.CODECS) >= {"fp32", "fp16", "bf16", "int8"}
    for ok in ("fp32", "fp16", "bf16", "int8", "topk1", "topk10", "topk99"):
        assert wire.is_codec(ok)
        wire.check_codec(ok)
    for bad in ("topk0", "topk100", "topk05", "topk", "topk10%", "int4", "FP16", "", None, 10):
        assert not wire.is_codec(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fp32, fp16, bf16, int8 or topk<P> \(P = 1..99\)"):
        wire.check_codec("topk0")
    with pytest.raises(ValueError, match="unknown codec"):
        wire.encode_tensor(torch.zeros(2), "topk100")


def test_topk_count_is_ceiling() -> None:
    assert wire.topk_count(6272, 10) == 628  # 627.2 -> 628
    assert wire.topk_count(100, 10) == 10
    assert wire.topk_count(5, 1) == 1  # never 0 for a non-empty sample
    assert wire.topk_count(0, 50) == 0


# ------------------------------------------------------------------ round trips on real tensors


@pytest.mark.parametrize("kind", ["act", "grad"])
@pytest.mark.parametrize("level", [0, 3])
def test_bf16_relative_error(tensors, kind, level) -> None:
    t = tensors[kind]
    enc = wire.encode_tensor(t, "bf16", level)
    assert enc["dtype"] == "bfloat16" and "codec" not in enc
    if level == 0:
        assert len(enc["data"]) == t.numel() * 2
    out = wire.decode_tensor(_via_msgpack(enc), shape=(None, *t.shape[1:]), dtypes=FLOAT)
    assert out.dtype == torch.float32 and out.shape == t.shape
    nz = t != 0
    rel = ((out - t).abs()[nz] / t.abs()[nz]).max().item()
    assert 0 < rel < 1e-2  # really rounded to 8 mantissa bits, and no worse than that
    assert torch.equal(out[~nz], t[~nz])  # zeros (ReLU) stay exact
    # the bits on the wire are bf16 as torch rounds it
    assert torch.equal(out, t.to(torch.bfloat16).float())
    assert wire.decode_tensor(enc, as_float32=False).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["act", "grad"])
@pytest.mark.parametrize("level", [0, 3])
def test_int8_error_at_most_half_a_step_per_channel(tensors, kind, level) -> None:
    t = tensors[kind]
    enc = _via_msgpack(wire.encode_tensor(t, "int8", level))
    assert enc["codec"] == "int8" and enc["dtype"] == "int8"
    scale = wire.decode_tensor(enc["scale"], shape=(t.shape[1],), dtypes=("float32",))
    ref = t.transpose(0, 1).reshape(t.shape[1], -1).abs().amax(dim=1) / 127
    assert torch.allclose(scale, ref)
    out = wire.decode_tensor(enc, shape=(None, *t.shape[1:]), dtypes=FLOAT)
    assert out.dtype == torch.float32 and out.shape == t.shape
    err = (out - t).abs().transpose(0, 1).reshape(t.shape[1], -1).amax(dim=1)
    assert (err <= scale / 2 * (1 + 1e-5) + 1e-12).all()
    assert (err > 0).any()  # it is lossy
    # the channel maximum is representable exactly up to float rounding: q = ±127
    assert torch.allclose(out.abs().transpose(0, 1).reshape(t.shape[1], -1).amax(dim=1), ref * 127, rtol=1e-6)


def test_int8_two_and_one_dimensional() -> None:
    x = torch.tensor([[1.0, -100.0, 0.0], [-0.5, 50.0, 0.0]])  # (batch, features): a scale per column
    enc = wire.encode_tensor(x, "int8", 3)
    scale = wire.decode_tensor(enc["scale"])
    assert torch.allclose(scale, torch.tensor([1 / 127, 100 / 127, 0.0]))
    out = wire.decode_tensor(enc, shape=(2, 3), dtypes=FLOAT)
    assert torch.allclose(out, x, atol=100 / 127 / 2)
    assert out[0, 0] == pytest.approx(1.0) and out[:, 2].eq(0).all()  # column 0 kept its own scale
    v = torch.tensor([0.25, -2.0, 1.0])  # 1-D: one scale for the tensor
    enc = wire.encode_tensor(v, "int8", 0)
    assert enc["scale"]["shape"] == [1]
    assert (wire.decode_tensor(enc) - v).abs().max() <= 2 / 127 / 2 + 1e-7


@pytest.mark.parametrize("kind", ["act", "grad"])
@pytest.mark.parametrize("p", [1, 10, 50])
def test_topk_keeps_exactly_the_k_largest_per_sample(tensors, kind, p) -> None:
    t = tensors[kind]
    b, n = t.shape[0], t[0].numel()
    k = wire.topk_count(n, p)
    enc = _via_msgpack(wire.encode_tensor(t, f"topk{p}", 3))
    assert enc["codec"] == "topk" and enc["p"] == p and enc["dtype"] == "float16"
    assert enc["idx"]["dtype"] == "int32" and enc["idx"]["shape"] == [b, k]
    out = wire.decode_tensor(enc, shape=(None, *t.shape[1:]), dtypes=FLOAT)
    assert out.dtype == torch.float32 and out.shape == t.shape
    flat_t, flat_o = t.reshape(b, n), out.reshape(b, n)
    idx = wire.decode_tensor(enc["idx"]).long()
    assert (idx[:, 1:] > idx[:, :-1]).all()  # sorted, no duplicates
    kept = torch.zeros(b, n, dtype=torch.bool).scatter_(1, idx, True)
    assert int(kept.sum(dim=1).min()) == int(kept.sum(dim=1).max()) == k
    # zeros everywhere else; kept values equal the originals up to float16 rounding
    assert flat_o[~kept].eq(0).all()
    assert torch.allclose(flat_o[kept], flat_t[kept].half().float())
    # the k largest: no dropped magnitude exceeds the smallest kept one in the same sample
    min_kept = flat_t.abs().masked_fill(~kept, math.inf).amin(dim=1)
    max_dropped = flat_t.abs().masked_fill(kept, -math.inf).amax(dim=1)
    assert (max_dropped <= min_kept).all()


def test_topk_one_dimensional_is_one_sample() -> None:
    v = torch.tensor([0.1, -5.0, 0.2, 3.0, 0.0, -0.3, 0.05, 1.0, 0.0, 0.0])
    out = wire.decode_tensor(wire.encode_tensor(v, "topk20", 0), shape=(10,))
    assert torch.equal(out.nonzero().flatten(), torch.tensor([1, 3]))
    assert out[1] == -5.0 and out[3] == 3.0


@pytest.mark.parametrize("codec", ["fp32", "fp16", *LOSSY])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (0, 4, 2, 2), (1, 1)])
def test_edge_shapes_round_trip(codec, shape) -> None:
    t = torch.randn(shape)
    out = wire.decode_tensor(_via_msgpack(wire.encode_tensor(t, codec, 3)), shape=shape, dtypes=FLOAT)
    assert out.shape == t.shape and out.dtype == torch.float32
    if codec.startswith("topk") and t.numel():
        assert out.ne(0).sum() >= 1


@pytest.mark.parametrize("codec", LOSSY)
def test_integer_tensors_ignore_the_codec(codec) -> None:
    y = torch.tensor([3, 0, 9, 1], dtype=torch.int64)  # labels travel with the assignment's codec too
    enc = wire.encode_tensor(y, codec, 3)
    assert "codec" not in enc and enc["dtype"] == "int64"
    assert torch.equal(wire.decode_tensor(enc, shape=(4,), dtypes=("int64",)), y)


def test_bytes_shrink_in_the_expected_order(tensors) -> None:
    for kind, t in tensors.items():
        size = {c: wire.encoded_nbytes(wire.encode_tensor(t, c, 3)) for c in ("fp32", "fp16", "bf16", "int8", "topk10")}
        raw16 = {c: wire.encoded_nbytes(wire.encode_tensor(t, c, 0)) for c in ("fp16", "bf16")}
        assert raw16["fp16"] == raw16["bf16"] == t.numel() * 2, kind
        assert size["fp32"] > size["fp16"] and size["fp32"] > size["bf16"], (kind, size)
        assert 0.6 < size["bf16"] / size["fp16"] < 1.4, (kind, size)  # about the same
        assert size["int8"] < min(size["fp16"], size["bf16"]), (kind, size)
        assert size["topk10"] < size["int8"] and size["topk10"] < size["fp32"] / 4, (kind, size)
        enc = wire.encode_tensor(t, "int8", 3)
        assert wire.encoded_nbytes(enc) == len(enc["data"]) + len(enc["scale"]["data"])
        enc = wire.encode_tensor(t, "topk10", 3)
        assert wire.encoded_nbytes(enc) == len(enc["data"]) + len(enc["idx"]["data"])


# ------------------------------------------------------------------ acceptance rules


@pytest.mark.parametrize("codec", LOSSY)
def test_lossy_floats_count_as_float32(codec) -> None:
    t = torch.randn(4, 3, 2, 2)
    enc = wire.encode_tensor(t, codec, 3)
    assert wire.decode_tensor(enc, shape=(4, 3, 2, 2), dtypes=("float32",)).dtype == torch.float32
    with pytest.raises(WireError, match="not allowed here"):
        wire.decode_tensor(enc, dtypes=("float16",))  # only "float32" admits them
    with pytest.raises(WireError, match="not allowed here"):
        wire.decode_tensor(enc, dtypes=("int64",))
    with pytest.raises(WireError, match="not allowed here"):
        wire.decode_tensor(enc, dtypes=FLOAT, float_codecs=False)


def test_weights_refuse_lossy_encodings() -> None:
    ref = {"w": torch.randn(4, 3)}
    for codec in LOSSY:
        with pytest.raises(WireError, match="not allowed here"):
            wire.decode_state({"w": wire.encode_tensor(ref["w"], codec)}, ref)
    assert torch.equal(wire.decode_state(wire.encode_state(ref), ref)["w"], ref["w"])


# ------------------------------------------------------------------ rejections


def _int8() -> dict:
    return wire.encode_tensor(torch.randn(2, 3, 4), "int8", 3)


def _topk() -> dict:
    return wire.encode_tensor(torch.randn(2, 3, 4), "topk25", 3)  # n=12, k=3


@pytest.mark.parametrize("tamper, reason", [
    (lambda e: {**e, "codec": "int4"}, "codec 'int4' not allowed"),
    (lambda e: {**e, "codec": 8}, "codec 8 not allowed"),
    (lambda e: {**e, "dtype": "float32"}, "must carry dtype int8"),
    (lambda e: {**e, "shape": [2, 3, -4]}, "bad shape"),
    (lambda e: {k: v for k, v in e.items() if k != "scale"}, "needs 'scale'"),
    (lambda e: {**e, "scale": wire.encode_tensor(torch.ones(4))}, r"int8 scale: .*shape \(4,\).*3 expected"),
    (lambda e: {**e, "scale": wire.encode_tensor(torch.ones(3), "fp16")}, "int8 scale: .*dtype float16"),
    (lambda e: {**e, "scale": wire.encode_tensor(torch.ones(3), "int8")}, "plain float32 tensor map"),
    (lambda e: {**e, "scale": wire.encode_tensor(torch.tensor([1.0, math.nan, 1.0]))}, "finite"),
    (lambda e: {**e, "scale": wire.encode_tensor(torch.tensor([1.0, math.inf, 1.0]))}, "finite"),
    (lambda e: {**e, "scale": wire.encode_tensor(torch.tensor([1.0, -1.0, 1.0]))}, ">= 0"),
    (lambda e: {**e, "z": False, "data": bytes(23)}, "23 bytes of data"),
    (lambda e: {**e, "z": False, "data": bytes([0x80]) + bytes(23)}, "-128"),
    (lambda e: {**e, "data": "x"}, "'data' must be bytes"),
])
def test_int8_rejections(tamper, reason) -> None:
    with pytest.raises(WireError, match=reason):
        wire.decode_tensor(tamper(_int8()), dtypes=FLOAT)


def _idx(rows) -> dict:
    return wire.encode_tensor(torch.tensor(rows, dtype=torch.int32), "fp32", 0)


@pytest.mark.parametrize("tamper, reason", [
    (lambda e: {**e, "p": 0}, "p=0 must be an integer in 1..99"),
    (lambda e: {**e, "p": 100}, "1..99"),
    (lambda e: {**e, "p": True}, "1..99"),
    (lambda e: {**e, "p": "25"}, "1..99"),
    (lambda e: {k: v for k, v in e.items() if k != "p"}, "1..99"),
    (lambda e: {**e, "p": 50}, r"top-k idx: .*k=6 of 12 per sample for p=50"),
    (lambda e: {**e, "dtype": "float32"}, "must carry dtype float16"),
    (lambda e: {k: v for k, v in e.items() if k != "idx"}, "needs 'idx'"),
    (lambda e: {**e, "idx": wire.encode_tensor(torch.zeros(2, 3, dtype=torch.int64))}, "dtype int64 not allowed"),
    (lambda e: {**e, "idx": _idx([[0, 1, 2, 3], [0, 1, 2, 3]])}, r"shape \(2, 4\)"),
    (lambda e: {**e, "idx": _idx([[0, 1, 12], [0, 1, 2]])}, "out of range"),
    (lambda e: {**e, "idx": _idx([[-1, 1, 2], [0, 1, 2]])}, "out of range"),
    (lambda e: {**e, "idx": _idx([[0, 2, 1], [0, 1, 2]])}, "strictly increasing"),
    (lambda e: {**e, "idx": _idx([[0, 1, 1], [0, 1, 2]])}, "strictly increasing"),
    (lambda e: {**e, "z": False, "data": bytes(14)}, r"top-k values \(2x3 float16\).*14 bytes"),
    (lambda e: {**e, "idx": {**_idx([[0, 1, 2], [0, 1, 2]]), "data": bytes(20)}}, "top-k idx: .*20 bytes"),
])
def test_topk_rejections(tamper, reason) -> None:
    with pytest.raises(WireError, match=reason):
        wire.decode_tensor(tamper(_topk()), dtypes=FLOAT)


def test_topk_valid_hand_made_payload_decodes() -> None:
    """The rejection fixture is valid before tampering: the hand-made idx path works too."""
    enc = {**_topk(), "idx": _idx([[0, 5, 11], [1, 2, 3]]), "z": False,
           "data": torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.float16).numpy().tobytes()}
    out = wire.decode_tensor(enc, shape=(2, 3, 4), dtypes=FLOAT).reshape(2, 12)
    assert out[0, [0, 5, 11]].tolist() == [1, 2, 3] and out[1, [1, 2, 3]].tolist() == [4, 5, 6]
    assert out.ne(0).sum() == 6


def test_bf16_rejections() -> None:
    enc = wire.encode_tensor(torch.randn(2, 3), "bf16", 0)
    with pytest.raises(WireError, match="6 bytes of data"):
        wire.decode_tensor({**enc, "data": enc["data"][:6]})
    with pytest.raises(WireError, match="shape"):
        wire.decode_tensor(enc, shape=(3, 2), dtypes=FLOAT)


@pytest.mark.parametrize("codec", ["int8", "topk1"])
def test_dense_size_bounded_before_allocation(codec) -> None:
    """A few bytes may not claim a huge dense tensor: the float32 result counts against max_bytes."""
    enc = wire.encode_tensor(torch.randn(4, 100), codec, 3)
    assert wire.decode_tensor(enc, max_bytes=1600).shape == (4, 100)
    with pytest.raises(WireError, match="1600 bytes once decoded exceeds the limit of 1599"):
        wire.decode_tensor(enc, max_bytes=1599)
    huge = {**enc, "shape": [1 << 20, 1 << 20]}
    with pytest.raises(WireError, match="exceeds the limit"):
        wire.decode_tensor(huge)


def test_gradients_travel_back_with_every_codec(tensors) -> None:
    """The coordinator encodes g with the run's codec; the agent decodes with its own shape."""
    g = tensors["grad"]
    for codec in ("fp32", "fp16", *LOSSY):
        out = wire.decode_tensor(_via_msgpack(wire.encode_tensor(g, codec, 3)), shape=tuple(g.shape), dtypes=FLOAT)
        assert torch.isfinite(out).all()
        # a descent direction survives: cosine with the true gradient (top-k keeps only part of it)
        cos = F.cosine_similarity(out.flatten(), g.flatten(), dim=0).item()
        assert cos > {"topk10": 0.5, "topk1": 0.15}.get(codec, 0.99), (codec, cos)


def test_int8_of_non_finite_input_is_refused_by_the_receiver() -> None:
    """A NaN/Inf activation cannot hide inside integers: its channel scale is non-finite."""
    for bad in (math.inf, math.nan):
        t = torch.ones(2, 3, 2)
        t[1, 2, 0] = bad
        with pytest.raises(WireError, match="finite"):
            wire.decode_tensor(wire.encode_tensor(t, "int8", 3), dtypes=FLOAT)
