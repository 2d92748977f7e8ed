"""Wire codec benchmark: bytes and speed of ``sfl_core.wire.codec`` on real activations/gradients.

Command (full run, well under a minute on 2 CPU cores with ``--threads 1``)::

    /tmp/venv/bin/python bench/codec.py            # writes bench/results/codec.json
    /tmp/venv/bin/python bench/codec.py --quick    # smoke-test size, numbers not meaningful
    /tmp/venv/bin/python bench/codec.py --codecs int8 topk10   # a subset

What is measured: a batch of ``--batch`` real images (Fashion-MNIST by default) goes
through the client portion ``blocks[:s]`` of a freshly initialised model in train mode;
the activations are the tensor an agent uploads. Their gradient comes from the server
portion ``blocks[s:]`` + cross-entropy (mean over the batch), i.e. the tensor the
coordinator sends back. Each tensor is encoded with :func:`sfl_core.wire.codec.encode_tensor`
and decoded with :func:`sfl_core.wire.codec.decode_tensor` for every codec setting
(fp32 / fp16 / bf16 / int8 / topk10 / topk1 x zstd level 0 = off, 1, 3, 9). The physical reference, timed in the same
run on the same bytes, is a plain memory copy of the raw fp32 buffer (``numpy.copy``).

Columns:

- ``act B/smp`` / ``grad B/smp``: bytes on the wire per sample (the msgpack-packed tensor
  map ``{dtype, shape, z, data}`` plus, for int8, its scales and, for top-k, its indices;
  divided by the batch size).
- ``act x`` / ``grad x``: compression ratio = raw fp32 bytes / wire bytes.
- ``enc MB/s`` / ``dec MB/s``: MB (1e6 bytes) of *raw fp32* tensor per second, activations
  and gradients together (total raw bytes / total median time); median of ``--repeats``.
  Decode includes widening fp16/bf16 back to fp32, de-quantising int8 and scattering
  top-k values into zeros, as the coordinator does.
- ``memcpy MB/s``: the reference copy of the same raw bytes; ``enc/cp`` and ``dec/cp`` are
  codec speed divided by it (1.0 would mean encoding is as cheap as one memcpy).
- ``err act`` / ``err grad``: max |decoded - original| / max |original| (0 for lossless
  settings). Element-wise relative error is not used: ReLU zeros and tiny gradients make
  it infinite without saying anything about training.
- ``l2 act`` / ``l2 grad``: ||decoded - original||_2 / ||original||_2, the error that says
  how much of a sparse (top-k) tensor survives; max-error alone is 1.0-ish for any top-k.

The JSON (``bench/results/codec.json``) holds per-tensor detail (separate encode/decode
times for activations and gradients, shapes, raw bytes, fp16 underflow counts).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (bench helper; also puts the repo root on sys.path)
import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sfl_core.model.zoo import build_model  # noqa: E402
from sfl_core.wire.codec import CODECS, decode_tensor, encode_tensor, encoded_nbytes, is_codec  # noqa: E402

ZSTD_LEVELS = (0, 1, 3, 9)
BENCH_CODECS = (*CODECS, "topk10", "topk1")
DEFAULT_SPLITS = {"small_cnn": (1, 2, 3), "resnet8": (1, 2, 3)}
MB = 1e6


def capture(model_name: str, x: torch.Tensor, y: torch.Tensor, split: int, num_classes: int,
            seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations at ``split`` (client portion, train mode) and their gradient from the server portion."""
    torch.manual_seed(seed)
    model = build_model(model_name, tuple(x.shape[1:]), num_classes).train()
    with torch.no_grad():
        acts = model.client(split)(x)
    a = acts.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(model.server(split)(a), y)
    loss.backward()
    assert a.grad is not None
    return acts.detach().contiguous(), a.grad.detach().contiguous()


def measure_tensor(t: torch.Tensor, codec: str, level: int, repeats: int) -> dict[str, Any]:
    """Wire size, encode/decode medians and reconstruction error of one tensor at one setting."""
    obj = encode_tensor(t, codec, level)
    wire = len(msgpack.packb(obj, use_bin_type=True))
    enc_s = common.median_seconds(lambda: encode_tensor(t, codec, level), repeats)
    dec_s = common.median_seconds(lambda: decode_tensor(obj), repeats)
    back = decode_tensor(obj)
    if back.shape != t.shape:
        raise RuntimeError(f"round trip changed shape {tuple(t.shape)} -> {tuple(back.shape)}")
    scale = float(t.abs().max())
    err = float((back - t).abs().max()) / scale if scale > 0 else 0.0
    norm = float(t.norm())
    l2 = float((back - t).norm()) / norm if norm > 0 else 0.0
    underflow = int(((back == 0) & (t != 0)).sum())  # for top-k: also every dropped entry
    return {
        "codec": codec,
        "zstd_level": level,
        "wire_bytes": wire,
        "payload_bytes": encoded_nbytes(obj),
        "encode_s": enc_s,
        "decode_s": dec_s,
        "max_rel_err": err,
        "l2_rel_err": l2,
        "flushed_to_zero": underflow,
    }


def memcpy_seconds(t: torch.Tensor, repeats: int) -> float:
    arr = np.ascontiguousarray(t.numpy(), dtype=np.float32)
    return common.median_seconds(arr.copy, repeats)


def run(args: Any) -> dict[str, Any]:
    ds = common.load_data(args.data)
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.randperm(len(ds.x_train), generator=gen)[: args.batch]
    x, y = ds.x_train[idx].contiguous(), ds.y_train[idx].contiguous()
    splits = {"small_cnn": (2,)} if args.quick else DEFAULT_SPLITS
    if args.models:
        splits = {m: DEFAULT_SPLITS.get(m, (1, 2)) for m in args.models}
    levels = (0, 1) if args.quick else ZSTD_LEVELS
    entries = []
    for model_name, model_splits in splits.items():
        for split in model_splits:
            acts, grads = capture(model_name, x, y, split, ds.num_classes, args.seed)
            raw = {"act": acts.numel() * 4, "grad": grads.numel() * 4}
            cp = {"act": memcpy_seconds(acts, args.repeats), "grad": memcpy_seconds(grads, args.repeats)}
            for codec in args.codecs:
                for level in levels:
                    per = {"act": measure_tensor(acts, codec, level, args.repeats),
                           "grad": measure_tensor(grads, codec, level, args.repeats)}
                    raw_total = raw["act"] + raw["grad"]
                    enc_s = per["act"]["encode_s"] + per["grad"]["encode_s"]
                    dec_s = per["act"]["decode_s"] + per["grad"]["decode_s"]
                    cp_s = cp["act"] + cp["grad"]
                    entries.append({
                        "model": model_name,
                        "split": split,
                        "batch": args.batch,
                        "activation_shape": list(acts.shape[1:]),
                        "codec": codec,
                        "zstd_level": level,
                        "act_bytes_per_sample": per["act"]["wire_bytes"] / args.batch,
                        "grad_bytes_per_sample": per["grad"]["wire_bytes"] / args.batch,
                        "raw_fp32_bytes_per_sample": raw["act"] / args.batch,
                        "act_ratio": raw["act"] / per["act"]["wire_bytes"],
                        "grad_ratio": raw["grad"] / per["grad"]["wire_bytes"],
                        "encode_MBps": raw_total / enc_s / MB,
                        "decode_MBps": raw_total / dec_s / MB,
                        "memcpy_MBps": raw_total / cp_s / MB,
                        "encode_vs_memcpy": cp_s / enc_s,
                        "decode_vs_memcpy": cp_s / dec_s,
                        "act_max_rel_err": per["act"]["max_rel_err"],
                        "grad_max_rel_err": per["grad"]["max_rel_err"],
                        "act_l2_rel_err": per["act"]["l2_rel_err"],
                        "grad_l2_rel_err": per["grad"]["l2_rel_err"],
                        "detail": {k: {**v, "raw_bytes": raw[k], "memcpy_s": cp[k],
                                       "encode_MBps": raw[k] / v["encode_s"] / MB,
                                       "decode_MBps": raw[k] / v["decode_s"] / MB}
                                   for k, v in per.items()},
                    })
    return {
        "config": {"data": ds.name, "data_arg": args.data, "batch": args.batch, "repeats": args.repeats,
                   "seed": args.seed, "quick": args.quick, "zstd_levels": list(levels), "codecs": list(args.codecs),
                   "weights": "fresh initialisation (torch.manual_seed(seed)), client portion in train mode"},
        "reference": "numpy copy of the raw fp32 bytes (memcpy)",
        "results": entries,
    }


def print_results(doc: dict[str, Any]) -> None:
    cols = ["model", "split", "act shape", "codec", "zstd", "act B/smp", "act x", "grad B/smp", "grad x",
            "enc MB/s", "dec MB/s", "memcpy MB/s", "enc/cp", "dec/cp", "err act", "err grad", "l2 act", "l2 grad"]
    rows = [[e["model"], e["split"], "x".join(map(str, e["activation_shape"])), e["codec"], e["zstd_level"],
             round(e["act_bytes_per_sample"]), e["act_ratio"], round(e["grad_bytes_per_sample"]), e["grad_ratio"],
             e["encode_MBps"], e["decode_MBps"], e["memcpy_MBps"], e["encode_vs_memcpy"], e["decode_vs_memcpy"],
             e["act_max_rel_err"], e["grad_max_rel_err"], e["act_l2_rel_err"], e["grad_l2_rel_err"]]
            for e in doc["results"]]
    cfg = doc["config"]
    common.print_table(f"wire codec on {cfg['data']} (batch {cfg['batch']}, median of {cfg['repeats']})",
                       cols, rows, caption="x = raw fp32 / wire bytes; MB/s of raw fp32; */cp = speed / memcpy speed; "
                                           "err = max abs err / max abs; l2 = relative L2 error")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--batch", type=int, default=64, help="samples per captured batch (default 64)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per measurement (median; default 7)")
    p.add_argument("--models", nargs="*", default=None,
                   help="models to measure (default small_cnn and resnet8 at splits 1, 2, 3)")
    p.add_argument("--codecs", nargs="+", default=list(BENCH_CODECS),
                   help=f"codecs to measure (default {' '.join(BENCH_CODECS)}; any of {', '.join(CODECS)}, topk1..topk99)")
    args = p.parse_args(argv)
    common.apply_threads(args)
    if args.quick:
        args.batch, args.repeats = min(args.batch, 16), min(args.repeats, 2)
    bad = [c for c in args.codecs if not is_codec(c)]
    if bad:
        p.error(f"unknown codec(s) {', '.join(bad)}; expected {', '.join(CODECS)} or topk1..topk99")
    if args.batch < 2:
        p.error("--batch must be >= 2 (BatchNorm in train mode needs more than one sample)")
    doc = run(args)
    print_results(doc)
    path = common.write_result(args.out, "codec", doc)
    print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    main()
