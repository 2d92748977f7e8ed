"""Wire codec: msgpack envelopes carrying zstd-compressed raw tensor bytes.

Why not pickle or ``torch.save``: a coordinator accepts bytes from devices it does not
control, so nothing on the wire may be able to run code when decoded. msgpack only builds
maps, lists, numbers, strings and bytes; tensors travel as ``dtype + shape + raw bytes``
and are rebuilt with ``numpy.frombuffer`` after their size has been checked.

Every decode function validates before it allocates: dtype in an allow-list, shape
non-negative and matching what the caller expects, byte length equal to
``prod(shape) * itemsize``, and decompressed size bounded.

Activation/gradient codecs (why several: HeteroSFL's precision and Top-k baselines, and
each layer of reduction must be measurable on its own): ``fp32``, ``fp16``, ``bf16``
(upper 16 bits of float32), ``int8`` (symmetric per-channel quantisation) and ``topk<P>``
(the P % largest-magnitude entries per sample). Every codec is followed by zstd.
"""

from __future__ import annotations

import math
import re
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgpack
import numpy as np
import torch
import zstandard

PROTOCOL_VERSION = 2
"""Bumped whenever a peer of the previous version would reject or misread what this one sends
(docs/protocol.md §3, compatibility). 2: ``status.instance``, signed ``run_info``/``assign``/``shutdown``."""
MAX_MESSAGE_BYTES = 64 * 2**20
"""Upper bound for one decoded message (and for one decompressed tensor)."""

CODECS = ("fp32", "fp16", "bf16", "int8")
"""Fixed-name activation/gradient codecs; ``topk<P>`` (P = 1..99) is valid too, see :func:`is_codec`."""

TOPK_PATTERN = "topk<P> (P = 1..99)"
_TOPK_RE = re.compile(r"topk([1-9][0-9]?)")
FLOAT_CODEC_FORMS = ("bfloat16", "int8", "topk")
"""Lossy float encodings a decoder accepts wherever ``float32`` is accepted (see :func:`decode_tensor`)."""

# dtypes a peer may send; anything else is rejected before any buffer is touched.
_DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "float32": (np.dtype("<f4"), torch.float32),
    "float16": (np.dtype("<f2"), torch.float16),
    "int64": (np.dtype("<i8"), torch.int64),
    "int32": (np.dtype("<i4"), torch.int32),
    "uint8": (np.dtype("u1"), torch.uint8),
    # bfloat16 has no numpy dtype: its bits travel as little-endian uint16 (upper half of a float32)
    "bfloat16": (np.dtype("<u2"), torch.bfloat16),
}
_TORCH_TO_NAME = {t: name for name, (_, t) in _DTYPES.items()}


class WireError(ValueError):
    """A received payload is malformed, oversized or does not match what was expected.

    ``reason`` is the short key under which a receiver counts the rejection
    (:class:`sfl_core.wire.protocol.Rejections`): ``malformed`` unless the raiser knows better.
    """

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


# --------------------------------------------------------------------------- tensors

_zstd = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """One compressor per thread and level: a zstd context is not thread-safe, and building one
    per message (its tables and buffers) costs as much as compressing a small tensor."""
    cache = _zstd.__dict__.setdefault("compressors", {})
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_zstd, "decompressor", None)
    if d is None:
        d = _zstd.decompressor = zstandard.ZstdDecompressor()
    return d


def all_finite(t: torch.Tensor) -> bool:
    """True when no element of ``t`` is NaN or ±Inf.

    Why a sum first: NaN and ±Inf propagate through a sum, so a finite sum proves every
    element finite, and summing is a fraction of the cost of ``torch.isfinite(t).all()``
    (which builds a mask) on a CPU. Only a sum that overflowed from finite but huge values
    takes the exact, slower test.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if math.isfinite(float(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32))):
        return True
    return bool(torch.isfinite(t).all())



def is_codec(name: str) -> bool:
    """True for a codec name :func:`encode_tensor` accepts: one of :data:`CODECS` or ``topk1`` … ``topk99``."""
    return isinstance(name, str) and (name in CODECS or _TOPK_RE.fullmatch(name) is not None)


def nominal_ratio(codec: str) -> float:
    """Bytes on the wire over fp32 bytes for an activation tensor, before zstd: what a planner
    assumes for a codec until the run has measured it (int8 adds a scale per channel, top-k
    sends fp16 values and int32 indices for P % of the entries)."""
    check_codec(codec)
    m = _TOPK_RE.fullmatch(codec)
    if m:
        return int(m.group(1)) / 100 * (2 + 4) / 4
    return {"fp32": 1.0, "fp16": 0.5, "bf16": 0.5, "int8": 0.25}[codec]


def check_codec(name: str) -> None:
    """Raise ValueError naming the valid codecs unless :func:`is_codec` accepts ``name``."""
    if not is_codec(name):
        raise ValueError(f"unknown codec {name!r}; expected one of {', '.join(CODECS)} or {TOPK_PATTERN}")


def topk_count(n: int, percent: int) -> int:
    """Entries kept per sample by ``topk<percent>`` out of ``n``: ceil(n·P/100), so never 0 unless n is.

    Integer arithmetic on purpose: sender and receiver must agree on k exactly.
    """
    return (n * percent + 99) // 100


def _samples(dims: list[int] | tuple[int, ...]) -> tuple[int, int]:
    """(samples, entries per sample) for top-k: dim 0 is the batch; 0-D/1-D tensors are one sample."""
    if len(dims) >= 2:
        return dims[0], math.prod(dims[1:])
    return 1, math.prod(dims)


def _channels(dims: list[int] | tuple[int, ...]) -> int:
    """Scales per int8 tensor: one per channel (dim 1) for 2-D and up, one per tensor below that."""
    return dims[1] if len(dims) >= 2 else 1


def encode_tensor(t: torch.Tensor, codec: str = "fp32", zstd_level: int = 3) -> dict[str, Any]:
    """Pack a tensor as ``{dtype, shape, z, data}`` (plus codec fields for ``int8``/``topk<P>``).

    The codec only changes floating tensors; integer tensors (labels) always travel as they are.
    ``fp16``/``bf16`` halve float payloads; ``int8`` adds ``codec``/``scale``; ``topk<P>`` adds
    ``codec``/``p``/``idx`` and puts the kept values (float16) in ``data``. Protocol: §4 of
    docs/protocol.md.
    """
    check_codec(codec)
    t = t.detach()
    if t.is_floating_point():
        if codec == "fp16":
            t = t.to(torch.float16)
        elif codec == "bf16":
            t = t.to(torch.bfloat16)  # round-to-nearest-even to the upper 16 bits
        else:
            t = t.to(torch.float32)
            if codec == "int8":
                return _encode_int8(t, zstd_level)
            if codec.startswith("topk"):
                return _encode_topk(t, int(codec[4:]), zstd_level)
    name = _TORCH_TO_NAME.get(t.dtype)
    if name is None:
        raise ValueError(f"dtype {t.dtype} cannot be sent; allowed: {sorted(_DTYPES)}")
    t = t.cpu().contiguous()
    arr = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
    return _plain_map(name, list(t.shape), arr.astype(_DTYPES[name][0], copy=False), zstd_level)


def _plain_map(name: str, dims: list[int], raw: np.ndarray, zstd_level: int) -> dict[str, Any]:
    """``raw``: the little-endian values, contiguous; compressed straight from their buffer."""
    z = zstd_level > 0
    data = _compressor(zstd_level).compress(raw) if z else raw.tobytes()  # type: ignore[arg-type]  # a buffer
    return {"dtype": name, "shape": dims, "z": z, "data": data}


def _encode_int8(t: torch.Tensor, zstd_level: int) -> dict[str, Any]:
    """Symmetric per-channel int8: scale = max|x|/127 per channel, q = round(x/scale) in [-127, 127].

    Why symmetric and per channel: ReLU outputs and gradients differ by orders of magnitude
    between channels, so one scale per tensor would flush whole channels to zero; a zero
    point buys nothing for data centred on 0 and costs a second array.
    """
    dims = list(t.shape)
    c = _channels(dims)
    moved = t.cpu().contiguous()
    if moved.numel() == 0:
        amax = torch.zeros(c)
    elif len(dims) >= 2:
        amax = moved.abs().amax(dim=[d for d in range(len(dims)) if d != 1])
    else:
        amax = moved.abs().max().reshape(1)
    scale = (amax / 127.0).to(torch.float32)
    bshape = [1, c] + [1] * (len(dims) - 2) if len(dims) >= 2 else [1] * len(dims)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).reshape(bshape)
    q = torch.round(moved / safe).clamp_(-127, 127).to(torch.int8)
    out = _plain_map("int8", dims, q.numpy(), zstd_level)
    out["codec"] = "int8"
    out["scale"] = encode_tensor(scale, "fp32", zstd_level)
    return out


def _encode_topk(t: torch.Tensor, percent: int, zstd_level: int) -> dict[str, Any]:
    """Keep the ``percent`` % largest |x| per sample (HeteroSFL's Top-k baseline), values as float16.

    Indices are flat within each sample and sorted ascending, so a receiver can check them
    cheaply (strictly increasing = in range and no duplicates) and zstd sees small deltas.
    """
    dims = list(t.shape)
    s, n = _samples(dims)
    k = topk_count(n, percent)
    flat = t.cpu().reshape(s, n)
    if s * k > 0:
        idx = torch.topk(flat.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
        vals = torch.gather(flat, 1, idx)
    else:
        idx, vals = torch.zeros(s, k, dtype=torch.int64), torch.zeros(s, k)
    out = _plain_map("float16", dims, np.ascontiguousarray(vals.to(torch.float16).numpy().astype("<f2", copy=False)), zstd_level)
    out["codec"] = "topk"
    out["p"] = percent
    out["idx"] = encode_tensor(idx.to(torch.int32), "fp32", zstd_level)
    return out


def decode_tensor(
    obj: Any,
    *,
    shape: tuple[int | None, ...] | None = None,
    dtypes: tuple[str, ...] | None = None,
    max_bytes: int = MAX_MESSAGE_BYTES,
    as_float32: bool = True,
    float_codecs: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rebuild a tensor sent by :func:`encode_tensor`, validating it against ``shape``.

    ``shape`` may contain ``None`` for a free dimension (e.g. the batch). Half-precision
    payloads (float16, bfloat16) are widened to float32 unless ``as_float32`` is false, so
    the training code never sees the wire precision; int8 and top-k always decode to float32.

    ``dtypes`` lists the wire dtypes allowed (None: any). Lossy float encodings
    (:data:`FLOAT_CODEC_FORMS`: bfloat16, int8-quantised, top-k sparse) count as float32:
    they are accepted wherever ``"float32"`` is in ``dtypes``, unless ``float_codecs`` is
    false (weights use that: they must arrive as float32/float16). ``"bfloat16"`` may also be
    listed by name. A quantised or sparse tensor never passes a list without ``"float32"``.

    ``out``: a float32 tensor to decode a float tensor into, and return (a caller gathering
    many tensors into one batch has each written straight into its place, not copied there
    after). A half-precision payload is widened as it is written. The tensor must be
    contiguous; a payload of another dtype or shape than ``out``'s raises :class:`WireError`
    before anything is written.
    """
    if not isinstance(obj, Mapping):
        raise WireError("tensor: expected a map with dtype/shape/z/data")
    if out is not None and (out.dtype != torch.float32 or not out.is_contiguous() or not as_float32):
        raise ValueError("decode_tensor: out must be a contiguous float32 tensor, and as_float32 true")
    codec = obj.get("codec")
    if codec is None:
        return _decode_plain(obj, shape, dtypes, max_bytes, as_float32, float_codecs, out)
    if codec not in ("int8", "topk"):
        raise WireError(f"tensor: codec {codec!r} not allowed; expected 'int8', 'topk' or no codec field")
    if dtypes is not None and not (float_codecs and "float32" in dtypes):
        raise WireError(f"tensor: {codec} encoding not allowed here; expected one of {list(dtypes)}")
    want = "int8" if codec == "int8" else "float16"
    if obj.get("dtype") != want:
        raise WireError(f"tensor: a {codec} tensor must carry dtype {want}, got {obj.get('dtype')!r}")
    dims = _check_shape(obj.get("shape"), shape)
    dense = math.prod(dims) * 4
    if dense > max_bytes:
        raise WireError(f"tensor: {dense} bytes once decoded exceeds the limit of {max_bytes}", reason="too_large")
    decoded = _decode_int8(obj, dims, max_bytes) if codec == "int8" else _decode_topk(obj, dims, max_bytes)
    return decoded if out is None else _into(out, decoded)


def _into(out: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """``decoded`` written into ``out`` (see :func:`decode_tensor`), which is returned."""
    if tuple(out.shape) != tuple(decoded.shape) or not decoded.is_floating_point():
        raise WireError(f"tensor: {decoded.dtype} {tuple(decoded.shape)} does not fit the place for it, "
                        f"float32 {tuple(out.shape)}")
    return out.copy_(decoded)


def _read_only(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the bytes of ``raw``, not copied, to be read only (copied from). PyTorch
    warns, once a process, that the buffer is not writable: nothing writes to it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)


def _check_shape(dims: Any, shape: tuple[int | None, ...] | None) -> list[int]:
    if not isinstance(dims, list) or len(dims) > 8 or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise WireError(f"tensor: bad shape {dims!r}")
    if shape is not None:
        if len(shape) != len(dims) or any(e is not None and e != d for e, d in zip(shape, dims)):
            want = "(" + ", ".join("*" if e is None else str(e) for e in shape) + ("," if len(shape) == 1 else "") + ")"
            raise WireError(f"tensor: shape {tuple(dims)} does not match expected {want}")
    return dims


def _raw_bytes(obj: Mapping[str, Any], nbytes: int, what: str) -> bytes:
    """The (decompressed) ``data`` of a tensor map, exactly ``nbytes`` long."""
    data, z = obj.get("data"), obj.get("z")
    if not isinstance(data, bytes) or not isinstance(z, bool):
        raise WireError(f"{what}: 'data' must be bytes and 'z' a bool")
    raw = _decompress(data, nbytes) if z else data
    if len(raw) != nbytes:
        raise WireError(f"{what}: {len(raw)} bytes of data (expected {nbytes})")
    return raw


def _decode_plain(obj: Mapping[str, Any], shape: tuple[int | None, ...] | None, dtypes: tuple[str, ...] | None,
                  max_bytes: int, as_float32: bool, float_codecs: bool,
                  into: torch.Tensor | None = None) -> torch.Tensor:
    name, dims = obj.get("dtype"), obj.get("shape")
    if name not in _DTYPES:
        raise WireError(f"tensor: dtype {name!r} not allowed; expected one of {sorted(_DTYPES)}")
    if dtypes is not None and name not in dtypes and not (
            name == "bfloat16" and float_codecs and "float32" in dtypes):
        raise WireError(f"tensor: dtype {name} not allowed here; expected one of {list(dtypes)}")
    dims = _check_shape(dims, shape)
    data, z = obj.get("data"), obj.get("z")
    if not isinstance(data, bytes) or not isinstance(z, bool):
        raise WireError("tensor: 'data' must be bytes and 'z' a bool")
    np_dtype, _ = _DTYPES[name]
    nbytes = math.prod(dims) * np_dtype.itemsize
    if nbytes > max_bytes:
        raise WireError(f"tensor: {nbytes} bytes exceeds the limit of {max_bytes}", reason="too_large")
    raw = _decompress(data, nbytes) if z else data
    if len(raw) != nbytes:
        raise WireError(f"tensor: {len(raw)} bytes of data for shape {tuple(dims)} {name} (expected {nbytes})")
    if into is not None and name in ("float32", "float16") and sys.byteorder == "little":   # widened as written
        return _into(into, _read_only(raw, _DTYPES[name][1]).view(dims))
    arr = np.frombuffer(raw, dtype=np_dtype).reshape(dims)
    if name == "bfloat16":
        if as_float32:  # bf16 is the upper half of a float32: shifting the bits back is exact
            wide = arr.astype("<u4")
            wide <<= 16  # in place: keeps a 0-D array an array
            out = torch.from_numpy(wide.view("<f4").astype(np.float32, copy=False))
        else:
            out = torch.from_numpy(arr.view("<i2").astype(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(arr.copy())
        if as_float32 and out.dtype == torch.float16:
            out = out.float()
    return out if into is None else _into(into, out)


def _decode_int8(obj: Mapping[str, Any], dims: list[int], max_bytes: int) -> torch.Tensor:
    c = _channels(dims)
    if not isinstance(obj.get("scale"), Mapping) or obj["scale"].get("codec") is not None:
        raise WireError("tensor: an int8 tensor needs 'scale', a plain float32 tensor map")
    try:
        scale = _decode_plain(obj["scale"], (c,), ("float32",), max_bytes, True, False)
    except WireError as exc:
        raise WireError(f"tensor: int8 scale: {exc} (one scale per channel, {c} expected)") from None
    if not all_finite(scale) or (scale < 0).any():
        raise WireError("tensor: int8 scales must be finite and >= 0")
    raw = _raw_bytes(obj, math.prod(dims), "tensor: int8 data")
    q = np.frombuffer(raw, dtype=np.int8)
    if q.size and q.min() < -127:
        raise WireError("tensor: int8 value -128 outside the symmetric range [-127, 127]")
    out = torch.from_numpy(q.astype(np.float32)).reshape(dims)
    if len(dims) >= 2:
        return out.mul_(scale.reshape([1, c] + [1] * (len(dims) - 2)))
    return out.mul_(scale[0])


def _decode_topk(obj: Mapping[str, Any], dims: list[int], max_bytes: int) -> torch.Tensor:
    p = obj.get("p")
    if not isinstance(p, int) or isinstance(p, bool) or not 1 <= p <= 99:
        raise WireError(f"tensor: top-k percentage p={p!r} must be an integer in 1..99")
    s, n = _samples(dims)
    k = topk_count(n, p)
    if not isinstance(obj.get("idx"), Mapping) or obj["idx"].get("codec") is not None:
        raise WireError("tensor: a top-k tensor needs 'idx', a plain int32 tensor map")
    try:
        idx = _decode_plain(obj["idx"], (s, k), ("int32",), max_bytes, True, False)
    except WireError as exc:
        raise WireError(f"tensor: top-k idx: {exc} (k={k} of {n} per sample for p={p})") from None
    raw = _raw_bytes(obj, s * k * 2, f"tensor: top-k values ({s}x{k} float16)")
    if idx.numel():
        if idx.min() < 0 or idx.max() >= n:
            raise WireError(f"tensor: top-k index out of range 0..{n - 1}")
        if k > 1 and not (idx[:, 1:] > idx[:, :-1]).all():
            raise WireError("tensor: top-k indices must be strictly increasing within each sample")
    vals = torch.from_numpy(np.frombuffer(raw, dtype="<f2").astype(np.float32)).reshape(s, k)
    out = torch.zeros(s, n, dtype=torch.float32)
    out.scatter_(1, idx.long(), vals)
    return out.reshape(dims)


def _decompress(data: bytes, nbytes: int) -> bytes:
    """Decompress at most ``nbytes``.

    Why the header check: when a frame declares its content size, ``zstandard`` allocates
    that size and ignores ``max_output_size``, so a few KiB of crafted zeros could make us
    allocate gigabytes. The declared size must equal what the shape implies.
    """
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise WireError(f"tensor: zstd data is corrupt: {exc}") from None
    if declared >= 0 and declared != nbytes:
        raise WireError(f"tensor: zstd frame declares {declared} bytes, the shape implies {nbytes}")
    if declared < 0 and nbytes == 0:
        # max_output_size=0 would mean "unbounded"; an empty tensor needs no data anyway
        raise WireError("tensor: zstd frame without content size for an empty tensor")
    try:
        return _decompressor().decompress(data, max_output_size=nbytes)
    except zstandard.ZstdError as exc:
        raise WireError(f"tensor: zstd data is corrupt or larger than its shape: {exc}") from None


def encode_state(state: Mapping[str, torch.Tensor], zstd_level: int = 3) -> dict[str, Any]:
    """Weights travel at full precision: rounding them every round would drift the model."""
    return {k: encode_tensor(v, "fp32", zstd_level) for k, v in state.items()}


def decode_state(obj: Any, reference: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Decode weights and insist on exactly the reference's keys, shapes and dtype kinds."""
    if not isinstance(obj, Mapping):
        raise WireError("weights: expected a map of tensors")
    missing = set(reference) - set(obj)
    extra = set(obj) - set(reference)
    if missing or extra:
        raise WireError(f"weights: keys differ from the assignment (missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]})")
    out = {}
    for key, ref in reference.items():
        allowed = ("float32", "float16") if ref.is_floating_point() else ("int64", "int32")
        t = decode_tensor(obj[key], shape=tuple(ref.shape), dtypes=allowed, float_codecs=False)
        if not all_finite(t):
            raise WireError(f"weights: {key} contains NaN or Inf")
        out[key] = t.to(ref.dtype)
    return out


def encoded_nbytes(obj: Mapping[str, Any]) -> int:
    """Bytes an encoded tensor occupies on the wire: every byte field, nested maps included.

    For int8 that is values + scales, for top-k values + indices; msgpack framing
    (keys, shape) is not counted.
    """
    total = 0
    for value in obj.values():
        if isinstance(value, (bytes, bytearray)):
            total += len(value)
        elif isinstance(value, Mapping):
            total += encoded_nbytes(value)
    return total


# --------------------------------------------------------------------------- envelopes

_ENVELOPE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "v": int,
    "type": str,
    "run": str,
    "sender": str,
    "seq": int,
    "round": int,
    "step": int,
    "body": dict,
}


def pack(envelope: Mapping[str, Any]) -> bytes:
    """Serialise an envelope (see :mod:`sfl_core.wire.protocol` for how one is built)."""
    return msgpack.packb(dict(envelope), use_bin_type=True)


def unpack(payload: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Parse and validate the envelope structure; the body is validated by the protocol layer."""
    if not isinstance(payload, (bytes, bytearray)):
        raise WireError("payload is not bytes")
    if len(payload) > max_bytes:
        raise WireError(f"message of {len(payload)} bytes exceeds the limit of {max_bytes}", reason="too_large")
    try:
        env = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=1 << 20,
            max_array_len=1 << 20,
            max_map_len=1 << 16,
        )
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise WireError(f"not a msgpack message: {type(exc).__name__}: {exc}") from None
    if not isinstance(env, dict):
        raise WireError("message is not a map")
    for key, typ in _ENVELOPE_FIELDS.items():
        if key not in env:
            raise WireError(f"message lacks field {key!r}")
        if not isinstance(env[key], typ) or isinstance(env[key], bool) and typ is int:
            raise WireError(f"field {key!r} has type {type(env[key]).__name__}, "
                            f"expected {getattr(typ, '__name__', typ)}")
    if env["v"] != PROTOCOL_VERSION:
        raise VersionError(env["v"], env["type"])
    return env


class VersionError(WireError):
    """An envelope of another protocol version. It carries the version and the message type,
    so a coordinator can answer an older agent's ``register`` in that agent's own version
    with one reason it can read."""

    def __init__(self, version: int, mtype: str):
        super().__init__(f"protocol version {version} not supported (this build speaks {PROTOCOL_VERSION})",
                         reason="version")
        self.version = version
        self.type = mtype


# --------------------------------------------------------------------------- chunking

CHUNK_BYTES = 1 * 2**20
"""Payloads above this travel in pieces so no single MQTT packet hits a broker's limit."""


def split_chunks(payload: bytes, message_id: str, chunk_bytes: int = CHUNK_BYTES) -> list[bytes]:
    """Split a packed message into chunk envelopes (itself if it is small)."""
    if len(payload) <= chunk_bytes:
        return [payload]
    count = math.ceil(len(payload) / chunk_bytes)
    return [
        msgpack.packb(
            {"chunk": message_id, "i": i, "n": count, "total": len(payload),
             "data": payload[i * chunk_bytes:(i + 1) * chunk_bytes]},
            use_bin_type=True,
        )
        for i in range(count)
    ]


@dataclass
class _Partial:
    n: int
    total: int
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0


class Reassembler:
    """Joins chunked payloads per (sender topic, message id); whole messages pass through.

    Memory is bounded: at most ``max_pending`` partial messages, each at most
    ``max_bytes``, together at most ``max_pending_bytes`` (default twice ``max_bytes``: one
    message in flight and the next starting); the oldest partial messages are dropped when
    a bound is hit, so a sender that starts many large messages and never finishes them
    cannot exhaust memory.
    """

    def __init__(self, max_bytes: int = MAX_MESSAGE_BYTES, max_pending: int = 64,
                 max_pending_bytes: int | None = None):
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        self.max_pending_bytes = 2 * max_bytes if max_pending_bytes is None else max_pending_bytes
        self._pending: dict[tuple[str, str], _Partial] = {}
        self._pending_bytes = 0

    def feed(self, source: str, payload: bytes) -> bytes | None:
        """Return a complete message, or None while pieces are missing. Raises WireError."""
        if not _looks_like_chunk(payload):
            return payload
        try:
            c = msgpack.unpackb(payload, raw=False, max_bin_len=self.max_bytes)
            mid, i, n, total, data = c["chunk"], c["i"], c["n"], c["total"], c["data"]
        except Exception as exc:
            raise WireError(f"bad chunk: {exc}") from None
        if not (isinstance(mid, str) and isinstance(i, int) and isinstance(n, int) and isinstance(total, int)
                and isinstance(data, bytes) and 0 <= i < n and 0 < total <= self.max_bytes and n <= total):
            raise WireError("bad chunk header")
        key = (source, mid)
        part = self._pending.get(key)
        if part is None:
            if len(self._pending) >= self.max_pending:
                self._forget(next(iter(self._pending)))
            part = self._pending[key] = _Partial(n=n, total=total)
        if part.n != n or part.total != total:
            self._forget(key)
            raise WireError("chunk header disagrees with earlier chunks of the same message")
        if i not in part.parts:
            part.parts[i] = data
            part.size += len(data)
            self._pending_bytes += len(data)
        if part.size > total:
            self._forget(key)
            raise WireError("chunks exceed the announced total size")
        while self._pending_bytes > self.max_pending_bytes and len(self._pending) > 1:
            oldest = next(iter(self._pending))
            self._forget(oldest if oldest != key else list(self._pending)[1])
        if len(part.parts) < n:
            return None
        self._forget(key)
        whole = b"".join(part.parts[k] for k in range(n))
        if len(whole) != total:
            raise WireError("reassembled message has the wrong size")
        return whole


    def _forget(self, key: tuple[str, str]) -> None:
        part = self._pending.pop(key, None)
        if part is not None:
            self._pending_bytes -= part.size

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes


def _looks_like_chunk(payload: bytes) -> bool:
    # A chunk is a msgpack map whose first key is "chunk"; envelopes start with "v".
    return payload[:7] in (b"\x85\xa5chunk",)
