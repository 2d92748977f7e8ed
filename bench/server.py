"""Server-side training throughput: ``ServerTrainer`` next to a plain PyTorch loop.

Command (full run on CPU ~2-3 minutes on 2 cores; on a GPU use ``--device cuda``)::

    /tmp/venv/bin/python bench/server.py                    # writes bench/results/server-cpu.json
    /tmp/venv/bin/python bench/server.py --device cuda      # writes bench/results/server-cuda.json
    /tmp/venv/bin/python bench/server.py --input-shape 3,32,32   # random CIFAR-shaped data, throughput
                                                  # only; writes bench/results/server-cpu-3x32x32.json
    /tmp/venv/bin/python bench/server.py --quick            # smoke-test size, numbers not meaningful

What is measured: one *step* = one local iteration of all ``--agents`` agents, each with a
batch of ``--batch`` samples. The agents' activations are precomputed once (client portion
``blocks[:s]`` in train mode on real Fashion-MNIST images, kept on the CPU as the wire
decoder delivers them), so only the server side is timed. Variants, all on deep copies of
the same server-portion weights, same batches, SGD lr 0.05:

- ``merged``: ``ServerTrainer`` with one group of all agents, ``.step(batches)`` (concatenate, ONE fwd/bwd/step,
  gradient split back per agent, scaled, copied to the CPU; ``loss.item()`` each step).
- ``per_agent``: ``ServerTrainer`` with one group per agent (SplitFed v1: one server copy per agent,
  N small fwd/bwd/steps per step).
- ``plain``: the physical reference: a textbook loop (``zero_grad``, ``cross_entropy``,
  ``backward``, ``SGD.step``) over the same concatenated batches already resident on the
  device, no input gradient, no host copies, no per-step sync.
- ``plain+io``: ``plain`` plus the work split learning cannot avoid: concatenating the
  CPU batches, copying them to the device, the gradient w.r.t. the input, and copying it
  back to the host. ``merged`` / ``plain+io`` isolates ServerTrainer's own overhead.
- ``plain+decode`` and ``merged+decode``: each step starts from the agents' wire messages
  (``--codec``, zstd ``--zstd-level``) instead of decoded tensors. ``plain+decode`` decodes them
  all with the product's decoder (``coordinator.uploads.decode_activations``: every check the
  protocol promises), then runs ``plain+io``; ``merged+decode`` does what the engine does:
  decode an agent, stage it (``ServerTrainer.stage``: pinned memory, a queued copy to the GPU
  while the next agent decodes), then ``.step``.

Columns: ``steps/s`` (higher is better), ``samples/s`` = steps/s x agents x batch,
``ms/step``, ``vs plain`` = variant steps/s / plain steps/s (1.0 = as fast as the
reference). Variants are timed in interleaved rounds (see ``time_interleaved``) so drifting
background load hits all of them alike; timers are read after ``torch.cuda.synchronize()``
on CUDA; each variant gets ``--warmup`` untimed steps first. The device name is printed and stored in the JSON.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (bench helper; also puts the repo root on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from coordinator.server_trainer import ServerTrainer, pick_device  # noqa: E402
from coordinator.uploads import decode_activations  # noqa: E402
from sfl_core.wire import codec as wire  # noqa: E402
from sfl_core.wire.assignment import SPLIT_TRAINING, Assignment  # noqa: E402
from sfl_core.model.zoo import build_model  # noqa: E402

LR = 0.05
NUM_CLASSES = 10
Batches = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_inputs(args: Any) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(x, y, description)`` for the client portion: real images, or random ones for ``--input-shape``."""
    need = max(args.agents * args.batch * args.distinct, args.batch)
    gen = torch.Generator().manual_seed(args.seed)
    if args.input_shape is not None:
        x = torch.randn(need, *args.input_shape, generator=gen)
        y = torch.randint(0, NUM_CLASSES, (need,), generator=gen)
        return x, y, f"random {tuple(args.input_shape)} (throughput only)"
    ds = common.load_data(args.data)
    if need > len(ds.x_train):
        raise SystemExit(f"{need} samples needed but {ds.name} has {len(ds.x_train)}; lower --agents/--batch")
    idx = torch.randperm(len(ds.x_train), generator=gen)[:need]
    return ds.x_train[idx], ds.y_train[idx], f"{ds.name} {tuple(ds.input_shape)} (real)"


def make_batches(client: nn.Module, x: torch.Tensor, y: torch.Tensor, agents: int, batch: int,
                 distinct: int) -> list[Batches]:
    """``distinct`` step-sets of ``{agent: (activations, labels)}`` on the CPU, computed once."""
    sets: list[Batches] = []
    k = 0
    with torch.no_grad():
        for _ in range(distinct):
            step: Batches = {}
            for a in range(agents):
                xs, ys = x[k:k + batch], y[k:k + batch]
                k += batch
                step[f"agent{a:03d}"] = (client(xs).detach().contiguous(), ys.contiguous())
            sets.append(step)
    return sets


def encode_sets(sets: list[Batches], codec: str, zstd_level: int) -> list[dict[str, dict[str, Any]]]:
    """Each step's batches as the agents' wire bodies (``{"x": tensor map, "y": tensor map}``)."""
    return [{a: {"x": wire.encode_tensor(x, codec, zstd_level), "y": wire.encode_tensor(y, codec, zstd_level)}
             for a, (x, y) in s.items()} for s in sets]


def time_interleaved(fns: dict[str, Callable[[int], Any]], device: torch.device, warmup: int,
                     steps: int) -> dict[str, float]:
    """Seconds each variant needs for ``steps`` calls, timed in interleaved rounds.

    Why interleave: on a shared machine the background load drifts over a minute; timing
    variants one after the other would turn that drift into a fake speed difference.
    Each round runs a chunk of consecutive steps per variant (so CUDA launches of one step
    still overlap the previous step, as in a real loop), synchronising only at the chunk
    ends; the variant order rotates between rounds.
    """
    for fn in fns.values():
        for i in range(warmup):
            fn(i)
    _sync(device)
    rounds = min(steps, 5)
    chunks = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
    names = list(fns)
    total = {n: 0.0 for n in names}
    done = {n: warmup for n in names}
    for r, chunk in enumerate(chunks):
        for n in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[n]
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(chunk):
                fn(done[n])
                done[n] += 1
            _sync(device)
            total[n] += time.perf_counter() - t0
    return total


def bench_model(model_name: str, args: Any, device: torch.device) -> dict[str, Any]:
    x, y, data_desc = make_inputs(args)
    torch.manual_seed(args.seed)
    model = build_model(model_name, tuple(x.shape[1:]), NUM_CLASSES).train()
    split = args.split if args.split is not None else model.default_split
    model.check_split(split)
    sets = make_batches(model.client(split), x, y, args.agents, args.batch, args.distinct)
    server0 = copy.deepcopy(model.server(split)).cpu()
    agent_ids = list(sets[0])

    def trainer_step(mode: str) -> Callable[[int], Any]:
        tr = ServerTrainer(copy.deepcopy(model).to(device), lr=LR, device=device)
        groups = [agent_ids] if mode == "merged" else [[a] for a in agent_ids]
        tr.begin_round(groups, {a: split for a in agent_ids})
        return lambda i: tr.step(sets[i % len(sets)])

    bodies = encode_sets(sets, args.codec, args.zstd_level)
    assignment = Assignment(model=model_name, mode=SPLIT_TRAINING, split=split, width=0, batch_size=args.batch,
                            lr=LR, momentum=0.0, tau=1, codec=args.codec, zstd_level=args.zstd_level,
                            activation_shape=tuple(sets[0][agent_ids[0]][0].shape[1:]))

    def decoded(i: int) -> Batches:
        return {a: decode_activations(body, assignment, NUM_CLASSES) for a, body in bodies[i % len(bodies)].items()}

    def engine_step() -> Callable[[int], Any]:
        tr = ServerTrainer(copy.deepcopy(model).to(device), lr=LR, device=device)
        tr.begin_round([agent_ids], {a: split for a in agent_ids})
        return lambda i: tr.step({a: tr.stage(decode_activations(body, assignment, NUM_CLASSES))
                                  for a, body in bodies[i % len(bodies)].items()})

    def plain_step(with_io: bool, decode: bool = False) -> Callable[[int], Any]:
        net = copy.deepcopy(server0).to(device).train()
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        resident = [(torch.cat([s[a][0] for a in agent_ids]).to(device),
                     torch.cat([s[a][1] for a in agent_ids]).to(device)) for s in sets]
        sizes = [args.batch] * len(agent_ids)

        def step(i: int) -> None:
            if with_io:
                s = decoded(i) if decode else sets[i % len(sets)]
                xb = torch.cat([s[a][0] for a in agent_ids]).to(device).requires_grad_(True)
                yb = torch.cat([s[a][1] for a in agent_ids]).to(device)
            else:
                xb, yb = resident[i % len(resident)]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
            if with_io:
                assert xb.grad is not None
                [g.cpu() for g in torch.split(xb.grad, sizes)]
        return step

    variants: dict[str, Callable[[], Callable[[int], Any]]] = {
        "plain": lambda: plain_step(False),
        "plain+io": lambda: plain_step(True),
        "merged": lambda: trainer_step("merged"),
        "per_agent": lambda: trainer_step("per_agent"),
        "plain+decode": lambda: plain_step(True, decode=True),
        "merged+decode": engine_step,
    }
    samples = args.agents * args.batch
    rows = {}
    timed = time_interleaved({name: factory() for name, factory in variants.items()}, device, args.warmup, args.steps)
    for name, secs in timed.items():
        rows[name] = {"seconds": secs, "steps_per_s": args.steps / secs,
                      "samples_per_s": args.steps * samples / secs, "ms_per_step": 1e3 * secs / args.steps}
    for r in rows.values():
        r["vs_plain"] = r["steps_per_s"] / rows["plain"]["steps_per_s"]
    act_shape = list(sets[0][agent_ids[0]][0].shape[1:])
    return {"model": model_name, "split": split, "data": data_desc, "activation_shape": act_shape,
            "server_params": sum(p.numel() for p in server0.parameters()),
            "samples_per_step": samples, "variants": rows,
            "merged_vs_plain": rows["merged"]["vs_plain"],
            "merged_vs_plain_io": rows["merged"]["steps_per_s"] / rows["plain+io"]["steps_per_s"],
            "merged_vs_per_agent": rows["merged"]["steps_per_s"] / rows["per_agent"]["steps_per_s"],
            "merged_decode_vs_plain_decode":
                rows["merged+decode"]["steps_per_s"] / rows["plain+decode"]["steps_per_s"],
            "wire_bytes_per_agent": sum(wire.encoded_nbytes(b["x"]) for b in bodies[0].values()) // len(agent_ids)}


def print_results(doc: dict[str, Any]) -> None:
    cfg = doc["config"]
    rows = []
    for r in doc["results"]:
        for name, v in r["variants"].items():
            rows.append([r["model"], r["split"], "x".join(map(str, r["activation_shape"])), name,
                         v["steps_per_s"], v["samples_per_s"], v["ms_per_step"], v["vs_plain"]])
    common.print_table(
        f"server training on {doc['machine']['device_name']} ({cfg['device']}): {cfg['agents']} agents x "
        f"batch {cfg['batch']}, {cfg['steps']} timed steps",
        ["model", "split", "act shape", "variant", "steps/s", "samples/s", "ms/step", "vs plain"], rows,
        caption=f"data: {doc['results'][0]['data'] if doc['results'] else '-'}; vs plain = steps/s / plain steps/s")
    for r in doc["results"]:
        print(f"{r['model']}: merged / plain+io = {r['merged_vs_plain_io']:.2f}, merged+decode / plain+decode = "
              f"{r['merged_decode_vs_plain_decode']:.2f} ({cfg['codec']}, zstd {cfg['zstd_level']}, "
              f"{r['wire_bytes_per_agent'] / 1e3:.0f} kB per agent)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the server portion runs (auto: cuda if available)")
    p.add_argument("--model", nargs="+", default=None,
                   help="models (default resnet8 vgg11; resnet8 with --quick)")
    p.add_argument("--split", type=int, default=None, help="split point (default: each model's default split)")
    p.add_argument("--agents", type=int, default=10, help="agents per step (default 10)")
    p.add_argument("--batch", type=int, default=32, help="samples per agent per step (default 32)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 5 on CPU, 50 on CUDA)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per variant first (default 1 on CPU, 5 on CUDA)")
    p.add_argument("--distinct", type=int, default=4, help="distinct step batches cycled through (default 4)")
    p.add_argument("--codec", default="fp16", help="wire codec of the *+decode variants' messages (default fp16)")
    p.add_argument("--zstd-level", type=int, default=1, help="their zstd level (default 1)")
    p.add_argument("--input-shape", type=common.parse_shape, default=None,
                   help="e.g. 3,32,32: random inputs of this shape instead of --data (throughput only)")
    args = p.parse_args(argv)
    common.apply_threads(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine "
                f"(torch {torch.__version__})")
    device = pick_device(args.device)
    if args.quick:
        args.agents, args.batch, args.distinct, args.warmup = min(args.agents, 3), min(args.batch, 8), 2, 1
        args.steps = args.steps or 2
    if args.model is None:
        args.model = ["resnet8"] if args.quick else ["resnet8", "vgg11"]
    if args.steps is None:
        args.steps = 50 if device.type == "cuda" else 5
    if args.warmup is None:
        args.warmup = 5 if device.type == "cuda" else 1
    for opt in ("agents", "batch", "steps", "distinct"):
        if getattr(args, opt) < 1:
            p.error(f"--{opt} must be >= 1")
    if args.batch < 2:
        p.error("--batch must be >= 2 (BatchNorm in train mode needs more than one sample)")
    if not wire.is_codec(args.codec):
        p.error(f"--codec {args.codec!r}: expected one of fp32, fp16, bf16, int8, topk<P>")
    results = [bench_model(m, args, device) for m in args.model]
    doc = {
        "config": {"device": str(device), "agents": args.agents, "batch": args.batch, "steps": args.steps,
                   "warmup": args.warmup, "distinct_batches": args.distinct, "lr": LR, "seed": args.seed,
                   "codec": args.codec, "zstd_level": args.zstd_level,
                   "quick": args.quick, "data_arg": args.data if args.input_shape is None else None,
                   "input_shape": list(args.input_shape) if args.input_shape else None},
        "reference": "plain PyTorch SGD loop on the same server portion and concatenated batches, data on device",
        "results": results,
    }
    doc["machine"] = common.machine_info(device)
    print_results(doc)
    # random-input runs get their own file so they never overwrite a real-data result
    name = f"server-{device.type}" + ("-" + "x".join(map(str, args.input_shape)) if args.input_shape else "")
    path = common.write_result(args.out, name, {k: v for k, v in doc.items() if k != "machine"},
                               device)
    print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    main()
