"""Wire codec: msgpack envelopes carrying zstd-compressed raw tensor bytes.

Why not pickle or ``torch.save``: a coordinator accepts bytes from devices it does not
control, so nothing on the wire may be able to run code when decoded. msgpack only builds
maps, lists, numbers, strings and bytes; tensors travel as ``dtype + shape + raw bytes``
and are rebuilt with ``numpy.frombuffer`` after their size has been checked.

Every decode function validates before it allocates: dtype in an allow-list, shape
non-negative and matching what the caller expects, byte length equal to
``prod(shape) * itemsize``, and decompressed size bounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgpack
import numpy as np
import torch
import zstandard

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 2**20
"""Upper bound for one decoded message (and for one decompressed tensor)."""

CODECS = ("fp32", "fp16")
"""Activation/gradient precisions on the wire (bf16/int8/top-k come with the codec issue)."""

# dtypes a peer may send; anything else is rejected before any buffer is touched.
_DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "float32": (np.dtype("<f4"), torch.float32),
    "float16": (np.dtype("<f2"), torch.float16),
    "int64": (np.dtype("<i8"), torch.int64),
    "int32": (np.dtype("<i4"), torch.int32),
    "uint8": (np.dtype("u1"), torch.uint8),
}
_TORCH_TO_NAME = {t: name for name, (_, t) in _DTYPES.items()}


class WireError(ValueError):
    """A received payload is malformed, oversized or does not match what was expected."""


# --------------------------------------------------------------------------- tensors


def encode_tensor(t: torch.Tensor, codec: str = "fp32", zstd_level: int = 3) -> dict[str, Any]:
    """Pack a tensor as ``{dtype, shape, z, data}``; ``codec='fp16'`` halves float payloads."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    t = t.detach()
    if t.is_floating_point() and codec == "fp16":
        t = t.to(torch.float16)
    elif t.is_floating_point() and t.dtype != torch.float32:
        t = t.to(torch.float32)
    name = _TORCH_TO_NAME.get(t.dtype)
    if name is None:
        raise ValueError(f"dtype {t.dtype} cannot be sent; allowed: {sorted(_DTYPES)}")
    raw = t.cpu().contiguous().numpy().astype(_DTYPES[name][0], copy=False).tobytes()
    z = zstd_level > 0
    data = zstandard.ZstdCompressor(level=zstd_level).compress(raw) if z else raw
    return {"dtype": name, "shape": list(t.shape), "z": z, "data": data}


def decode_tensor(
    obj: Any,
    *,
    shape: tuple[int | None, ...] | None = None,
    dtypes: tuple[str, ...] | None = None,
    max_bytes: int = MAX_MESSAGE_BYTES,
    as_float32: bool = True,
) -> torch.Tensor:
    """Rebuild a tensor sent by :func:`encode_tensor`, validating it against ``shape``.

    ``shape`` may contain ``None`` for a free dimension (e.g. the batch). Half-precision
    payloads are widened to float32 unless ``as_float32`` is false, so the training code
    never sees the wire precision.
    """
    if not isinstance(obj, Mapping):
        raise WireError("tensor: expected a map with dtype/shape/z/data")
    name, dims, z, data = obj.get("dtype"), obj.get("shape"), obj.get("z"), obj.get("data")
    if name not in _DTYPES:
        raise WireError(f"tensor: dtype {name!r} not allowed; expected one of {sorted(_DTYPES)}")
    if dtypes is not None and name not in dtypes:
        raise WireError(f"tensor: dtype {name} not allowed here; expected one of {list(dtypes)}")
    if not isinstance(dims, list) or len(dims) > 8 or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise WireError(f"tensor: bad shape {dims!r}")
    if shape is not None:
        if len(shape) != len(dims) or any(e is not None and e != d for e, d in zip(shape, dims)):
            want = "(" + ", ".join("*" if e is None else str(e) for e in shape) + ("," if len(shape) == 1 else "") + ")"
            raise WireError(f"tensor: shape {tuple(dims)} does not match expected {want}")
    if not isinstance(data, bytes) or not isinstance(z, bool):
        raise WireError("tensor: 'data' must be bytes and 'z' a bool")
    np_dtype, _ = _DTYPES[name]
    nbytes = math.prod(dims) * np_dtype.itemsize
    if nbytes > max_bytes:
        raise WireError(f"tensor: {nbytes} bytes exceeds the limit of {max_bytes}")
    raw = _decompress(data, nbytes) if z else data
    if len(raw) != nbytes:
        raise WireError(f"tensor: {len(raw)} bytes of data for shape {tuple(dims)} {name} (expected {nbytes})")
    arr = np.frombuffer(raw, dtype=np_dtype).reshape(dims)
    out = torch.from_numpy(arr.copy())
    if as_float32 and out.dtype == torch.float16:
        out = out.float()
    return out


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
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=nbytes)
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
        t = decode_tensor(obj[key], shape=tuple(ref.shape), dtypes=allowed)
        if not torch.isfinite(t.float()).all():
            raise WireError(f"weights: {key} contains NaN or Inf")
        out[key] = t.to(ref.dtype)
    return out


def tensor_nbytes(obj: Mapping[str, Any]) -> int:
    """Bytes an encoded tensor occupies on the wire (compressed payload)."""
    return len(obj["data"])


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
    """Serialise an envelope (see :mod:`sfl_core.protocol` for how one is built)."""
    return msgpack.packb(dict(envelope), use_bin_type=True)


def unpack(payload: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Parse and validate the envelope structure; the body is validated by the protocol layer."""
    if not isinstance(payload, (bytes, bytearray)):
        raise WireError("payload is not bytes")
    if len(payload) > max_bytes:
        raise WireError(f"message of {len(payload)} bytes exceeds the limit of {max_bytes}")
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
            raise WireError(f"field {key!r} has type {type(env[key]).__name__}, expected {typ.__name__}")
    if env["v"] != PROTOCOL_VERSION:
        raise WireError(f"protocol version {env['v']} not supported (this build speaks {PROTOCOL_VERSION})")
    return env


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
    ``max_bytes``; the oldest partial message is dropped when the bound is hit.
    """

    def __init__(self, max_bytes: int = MAX_MESSAGE_BYTES, max_pending: int = 64):
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        self._pending: dict[tuple[str, str], _Partial] = {}

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
                self._pending.pop(next(iter(self._pending)))
            part = self._pending[key] = _Partial(n=n, total=total)
        if part.n != n or part.total != total:
            self._pending.pop(key, None)
            raise WireError("chunk header disagrees with earlier chunks of the same message")
        if i not in part.parts:
            part.parts[i] = data
            part.size += len(data)
        if part.size > total:
            self._pending.pop(key, None)
            raise WireError("chunks exceed the announced total size")
        if len(part.parts) < n:
            return None
        self._pending.pop(key, None)
        whole = b"".join(part.parts[k] for k in range(n))
        if len(whole) != total:
            raise WireError("reassembled message has the wrong size")
        return whole


def _looks_like_chunk(payload: bytes) -> bool:
    # A chunk is a msgpack map whose first key is "chunk"; envelopes start with "v".
    return payload[:7] in (b"\x85\xa5chunk",)
