"""Wire codec: tensors, weights, envelopes and chunking.

Everything a peer sends is untrusted, so most tests here are rejections: each must raise
:class:`WireError` (never crash, never allocate what the sender claims).
"""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
import zstandard

from sfl_core.wire import codec as wire
from sfl_core.wire.codec import WireError


def _envelope(**over):
    env = {"v": wire.PROTOCOL_VERSION, "type": "heartbeat", "run": "r1", "sender": "a1",
           "seq": 1, "round": 0, "step": 0, "body": {"state": "idle"}}
    env.update(over)
    return env


# ------------------------------------------------------------------ tensor round trips


@pytest.mark.parametrize("level", [0, 3])
def test_float32_round_trip_exact(level):
    t = torch.randn(4, 3, 5)
    enc = wire.encode_tensor(t, "fp32", level)
    assert enc["z"] is (level > 0)
    out = wire.decode_tensor(msgpack.unpackb(msgpack.packb(enc, use_bin_type=True), raw=False))
    assert out.dtype == torch.float32 and out.shape == t.shape
    assert torch.equal(out, t)


@pytest.mark.parametrize("level", [0, 3])
def test_fp16_codec_within_tolerance_and_half_size(level):
    torch.manual_seed(0)
    t = torch.randn(64, 32) * 10
    enc = wire.encode_tensor(t, "fp16", level)
    assert enc["dtype"] == "float16"
    if level == 0:
        assert len(enc["data"]) == t.numel() * 2
    out = wire.decode_tensor(enc)
    assert out.dtype == torch.float32  # widened: training code never sees wire precision
    rel = ((out - t).abs() / t.abs().clamp_min(1e-3)).max().item()
    assert rel < 1e-3
    assert not torch.equal(out, t)  # it really went through half precision
    kept = wire.decode_tensor(enc, as_float32=False)
    assert kept.dtype == torch.float16


@pytest.mark.parametrize("level", [0, 3])
def test_int64_round_trip_ignores_codec(level):
    t = torch.tensor([0, -5, 2**40, 9], dtype=torch.int64)
    enc = wire.encode_tensor(t, "fp16", level)  # codec only affects floats
    assert enc["dtype"] == "int64"
    out = wire.decode_tensor(enc, shape=(4,), dtypes=("int64",))
    assert out.dtype == torch.int64 and torch.equal(out, t)


def test_float64_is_sent_as_float32():
    t = torch.tensor([1.5, -2.25], dtype=torch.float64)
    enc = wire.encode_tensor(t)
    assert enc["dtype"] == "float32"
    assert torch.equal(wire.decode_tensor(enc), t.float())


def test_encode_rejects_unknown_codec_and_dtype():
    with pytest.raises(ValueError, match="codec"):
        wire.encode_tensor(torch.zeros(2), "int3")
    with pytest.raises(ValueError, match="cannot be sent"):
        wire.encode_tensor(torch.zeros(2, dtype=torch.bool))


def test_empty_tensor_round_trip():
    t = torch.zeros(0, 3)
    out = wire.decode_tensor(wire.encode_tensor(t), shape=(None, 3))
    assert out.shape == (0, 3)


def test_state_round_trip_exact():
    torch.manual_seed(1)
    state = {"blocks.0.weight": torch.randn(3, 2), "blocks.0.bias": torch.randn(3),
             "blocks.1.num_batches_tracked": torch.tensor(7)}
    enc = msgpack.unpackb(msgpack.packb(wire.encode_state(state), use_bin_type=True), raw=False)
    out = wire.decode_state(enc, state)
    assert set(out) == set(state)
    for k in state:
        assert out[k].dtype == state[k].dtype and torch.equal(out[k], state[k])


# ------------------------------------------------------------------ tensor rejections


def test_reject_unknown_dtype():
    enc = wire.encode_tensor(torch.zeros(2))
    enc["dtype"] = "object"
    with pytest.raises(WireError, match="dtype 'object' not allowed"):
        wire.decode_tensor(enc)


def test_reject_dtype_not_allowed_here():
    enc = wire.encode_tensor(torch.zeros(2))
    with pytest.raises(WireError, match="not allowed here"):
        wire.decode_tensor(enc, dtypes=("int64",))


def test_reject_shape_mismatch_and_wildcard():
    enc = wire.encode_tensor(torch.zeros(5, 3))
    assert wire.decode_tensor(enc, shape=(None, 3)).shape == (5, 3)  # None = free batch dim
    with pytest.raises(WireError, match=r"does not match expected \(\*, 4\)"):
        wire.decode_tensor(enc, shape=(None, 4))
    with pytest.raises(WireError, match="does not match"):
        wire.decode_tensor(enc, shape=(5, 3, 1))  # rank differs
    with pytest.raises(WireError, match="does not match"):
        wire.decode_tensor(enc, shape=(4, None))


@pytest.mark.parametrize("dims", [[-1, 3], [2, "3"], [2.0], "23", [True, 2], [1] * 9])
def test_reject_bad_dims(dims):
    enc = wire.encode_tensor(torch.zeros(2, 3))
    enc["shape"] = dims
    with pytest.raises(WireError, match="bad shape"):
        wire.decode_tensor(enc)


@pytest.mark.parametrize("level", [0, 3])
def test_reject_data_length_mismatch(level):
    enc = wire.encode_tensor(torch.zeros(2, 3), "fp32", level)
    enc["shape"] = [2, 4]
    with pytest.raises(WireError, match="bytes"):
        wire.decode_tensor(enc)
    enc["shape"] = [2, 2]
    with pytest.raises(WireError, match="bytes"):
        wire.decode_tensor(enc)


def test_reject_non_bytes_data_and_non_bool_z():
    enc = wire.encode_tensor(torch.zeros(2), "fp32", 0)
    with pytest.raises(WireError, match="'data' must be bytes"):
        wire.decode_tensor({**enc, "data": "abcdefgh"})
    with pytest.raises(WireError, match="'data' must be bytes"):
        wire.decode_tensor({**enc, "z": 1})
    with pytest.raises(WireError, match="expected a map"):
        wire.decode_tensor([1, 2])


def test_reject_corrupt_zstd():
    enc = wire.encode_tensor(torch.randn(100))
    enc["data"] = b"\x28\xb5\x2f\xfd" + b"garbage-garbage-garbage"
    with pytest.raises(WireError, match="zstd"):
        wire.decode_tensor(enc)
    enc["data"] = b"not zstd at all"
    with pytest.raises(WireError, match="zstd"):
        wire.decode_tensor(enc)


def test_reject_zstd_bomb_with_declared_content_size():
    # 256 MiB of zeros compress to a few KiB; the shape claims 4 floats. Before the fix,
    # zstandard trusted the frame's content size and allocated all of it.
    bomb = zstandard.ZstdCompressor(level=3).compress(b"\0" * (256 * 2**20))
    assert len(bomb) < 64 * 1024
    enc = {"dtype": "float32", "shape": [4], "z": True, "data": bomb}
    with pytest.raises(WireError, match="declares 268435456 bytes"):
        wire.decode_tensor(enc)


def test_reject_zstd_bomb_without_content_size():
    bomb = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(b"\0" * (16 * 2**20))
    with pytest.raises(WireError, match="zstd"):
        wire.decode_tensor({"dtype": "float32", "shape": [4], "z": True, "data": bomb})
    with pytest.raises(WireError, match="empty tensor"):
        wire.decode_tensor({"dtype": "float32", "shape": [0], "z": True, "data": bomb})


def test_frame_without_content_size_of_the_right_size_is_accepted():
    t = torch.randn(10)
    data = zstandard.ZstdCompressor(write_content_size=False).compress(t.numpy().tobytes())
    out = wire.decode_tensor({"dtype": "float32", "shape": [10], "z": True, "data": data})
    assert torch.equal(out, t)


def test_reject_declared_shape_over_limit_before_reading_data():
    enc = {"dtype": "float32", "shape": [2**20, 2**20], "z": False, "data": b""}
    with pytest.raises(WireError, match="exceeds the limit"):
        wire.decode_tensor(enc)
    small = wire.encode_tensor(torch.zeros(100))
    with pytest.raises(WireError, match="exceeds the limit"):
        wire.decode_tensor(small, max_bytes=399)


# ------------------------------------------------------------------ weights


def _ref():
    return {"w": torch.zeros(2, 2), "b": torch.zeros(2), "n": torch.tensor(0)}


def test_state_rejects_nan_and_inf():
    for bad in (float("nan"), float("inf")):
        state = {"w": torch.full((2, 2), bad), "b": torch.zeros(2), "n": torch.tensor(1)}
        with pytest.raises(WireError, match="w contains NaN or Inf"):
            wire.decode_state(wire.encode_state(state), _ref())


def test_state_rejects_missing_and_extra_keys():
    enc = wire.encode_state({"w": torch.zeros(2, 2), "b": torch.zeros(2), "n": torch.tensor(1)})
    missing = {k: v for k, v in enc.items() if k != "b"}
    with pytest.raises(WireError, match=r"missing \['b'\]"):
        wire.decode_state(missing, _ref())
    extra = {**enc, "evil": enc["b"]}
    with pytest.raises(WireError, match=r"unexpected \['evil'\]"):
        wire.decode_state(extra, _ref())
    with pytest.raises(WireError, match="map of tensors"):
        wire.decode_state([enc], _ref())


def test_state_rejects_shape_and_dtype_kind():
    enc = wire.encode_state({"w": torch.zeros(2, 3), "b": torch.zeros(2), "n": torch.tensor(1)})
    with pytest.raises(WireError, match="does not match"):
        wire.decode_state(enc, _ref())
    enc = wire.encode_state({"w": torch.zeros(2, 2), "b": torch.zeros(2), "n": torch.tensor(1.0)})
    with pytest.raises(WireError, match="not allowed here"):
        wire.decode_state(enc, _ref())  # float where the buffer is an integer counter


# ------------------------------------------------------------------ envelopes


def test_envelope_round_trip():
    env = _envelope()
    assert wire.unpack(wire.pack(env)) == env


def test_reject_oversized_message():
    payload = wire.pack(_envelope(body={"state": "x" * 2000}))
    with pytest.raises(WireError, match="exceeds the limit of 1000"):
        wire.unpack(payload, max_bytes=1000)


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x92\x01", b"\x85\xa1v", "text"])
def test_reject_non_msgpack(payload):
    with pytest.raises(WireError):
        wire.unpack(payload)


def test_reject_non_map_message():
    with pytest.raises(WireError, match="not a map"):
        wire.unpack(msgpack.packb([1, 2, 3]))


def test_reject_non_string_map_keys():
    with pytest.raises(WireError, match="msgpack"):
        wire.unpack(msgpack.packb({1: 2}))


@pytest.mark.parametrize("field", ["v", "type", "run", "sender", "seq", "round", "step", "body"])
def test_reject_missing_envelope_field(field):
    env = _envelope()
    del env[field]
    with pytest.raises(WireError, match=f"lacks field '{field}'"):
        wire.unpack(wire.pack(env))


@pytest.mark.parametrize("field,value", [("v", "1"), ("type", 3), ("run", None), ("sender", b"a1"),
                                         ("seq", 1.5), ("round", "0"), ("step", [0]), ("body", [])])
def test_reject_ill_typed_envelope_field(field, value):
    with pytest.raises(WireError, match=f"field '{field}' has type"):
        wire.unpack(wire.pack(_envelope(**{field: value})))


@pytest.mark.parametrize("field", ["v", "seq", "round", "step"])
def test_reject_bool_where_int_expected(field):
    with pytest.raises(WireError, match=f"field '{field}' has type bool"):
        wire.unpack(wire.pack(_envelope(**{field: True})))


@pytest.mark.parametrize("version", [1, 3])
def test_reject_wrong_protocol_version(version):
    with pytest.raises(wire.VersionError, match=f"protocol version {version} not supported") as err:
        wire.unpack(wire.pack(_envelope(v=version)))
    assert err.value.version == version and err.value.reason == "version"


# ------------------------------------------------------------------ chunking


def _big_payload(n: int = 10_000) -> bytes:
    return wire.pack(_envelope(body={"state": "s" * n}))


def test_small_payload_passes_through_unchanged():
    payload = _big_payload(10)
    chunks = wire.split_chunks(payload, "m1", chunk_bytes=1000)
    assert chunks == [payload]
    assert wire.Reassembler().feed("src", payload) is payload


def test_chunks_in_order():
    payload = _big_payload()
    chunks = wire.split_chunks(payload, "m1", chunk_bytes=1000)
    assert len(chunks) == math.ceil(len(payload) / 1000) > 5
    r = wire.Reassembler()
    results = [r.feed("src", c) for c in chunks]
    assert results[:-1] == [None] * (len(chunks) - 1)
    assert results[-1] == payload
    assert wire.unpack(results[-1])["body"]["state"] == "s" * 10_000
    assert r._pending == {}  # nothing left behind


def test_chunks_out_of_order_and_duplicated():
    payload = _big_payload()
    chunks = wire.split_chunks(payload, "m1", chunk_bytes=1000)
    order = list(reversed(chunks))
    order.insert(3, chunks[-2])  # a duplicate of a chunk already fed
    order.insert(1, chunks[0])   # a duplicate of a chunk still to come
    r = wire.Reassembler()
    out = [r.feed("src", c) for c in order]
    done = [o for o in out if o is not None]
    assert done == [payload]  # completes exactly once, despite the duplicates


def test_interleaved_messages_from_two_sources_with_same_id():
    pa, pb = _big_payload(9000), wire.pack(_envelope(sender="b", body={"state": "t" * 7000}))
    ca = wire.split_chunks(pa, "same", chunk_bytes=1000)
    cb = wire.split_chunks(pb, "same", chunk_bytes=1000)
    r = wire.Reassembler()
    got = {}
    for i in range(max(len(ca), len(cb))):
        for src, chunks in (("up/a", ca), ("up/b", cb)):
            if i < len(chunks):
                res = r.feed(src, chunks[i])
                if res is not None:
                    got[src] = res
    assert got == {"up/a": pa, "up/b": pb}


def test_inconsistent_headers_rejected():
    payload = _big_payload()
    chunks = wire.split_chunks(payload, "m1", chunk_bytes=1000)
    r = wire.Reassembler()
    assert r.feed("src", chunks[0]) is None
    forged = msgpack.packb({"chunk": "m1", "i": 1, "n": len(chunks) + 1, "total": len(payload),
                            "data": b"x" * 1000}, use_bin_type=True)
    with pytest.raises(WireError, match="disagrees"):
        r.feed("src", forged)
    assert r._pending == {}


@pytest.mark.parametrize("hdr", [
    {"i": 5, "n": 5}, {"i": -1, "n": 5}, {"i": 0, "n": 5, "total": 0},
    {"i": 0, "n": 50, "total": 10}, {"i": "0", "n": 5}, {"data": "text"},
])
def test_bad_chunk_header_rejected(hdr):
    c = {"chunk": "m", "i": 0, "n": 2, "total": 100, "data": b"x"}
    c.update(hdr)
    with pytest.raises(WireError, match="bad chunk"):
        wire.Reassembler().feed("src", msgpack.packb(c, use_bin_type=True))


def test_chunk_missing_fields_rejected():
    bad = msgpack.packb({"chunk": "m", "i": 0, "n": 2, "total": 10, "junk": b""}, use_bin_type=True)
    with pytest.raises(WireError, match="bad chunk"):
        wire.Reassembler().feed("src", bad)


def test_over_limit_total_rejected():
    payload = _big_payload()
    chunks = wire.split_chunks(payload, "m1", chunk_bytes=1000)
    with pytest.raises(WireError, match="bad chunk header"):
        wire.Reassembler(max_bytes=len(payload) - 1).feed("src", chunks[0])


def test_chunks_larger_than_announced_total_rejected():
    r = wire.Reassembler()
    mk = lambda i, data: msgpack.packb({"chunk": "m", "i": i, "n": 3, "total": 10, "data": data},  # noqa: E731
                                       use_bin_type=True)
    assert r.feed("src", mk(0, b"x" * 8)) is None
    with pytest.raises(WireError, match="exceed the announced total"):
        r.feed("src", mk(1, b"x" * 8))
    assert r._pending == {}


def test_reassembled_size_mismatch_rejected():
    r = wire.Reassembler()
    mk = lambda i: msgpack.packb({"chunk": "m", "i": i, "n": 2, "total": 10, "data": b"x"},  # noqa: E731
                                 use_bin_type=True)
    assert r.feed("src", mk(0)) is None
    with pytest.raises(WireError, match="wrong size"):
        r.feed("src", mk(1))


def test_pending_bound_evicts_oldest():
    r = wire.Reassembler(max_pending=2)
    msgs = {mid: wire.split_chunks(_big_payload(3000 + k), mid, chunk_bytes=1000)
            for k, mid in enumerate(["m0", "m1", "m2"])}
    for mid in ("m0", "m1", "m2"):
        assert r.feed("src", msgs[mid][0]) is None
    assert len(r._pending) == 2
    assert ("src", "m0") not in r._pending  # oldest dropped
    # the surviving ones still complete ...
    for mid in ("m1", "m2"):
        out = [r.feed("src", c) for c in msgs[mid][1:]]
        assert out[-1] is not None and wire.unpack(out[-1])["sender"] == "a1"
    assert r._pending == {}
    # ... while the evicted one can no longer complete from its remaining pieces alone
    out = [r.feed("src", c) for c in msgs["m0"][1:]]
    assert all(o is None for o in out)
