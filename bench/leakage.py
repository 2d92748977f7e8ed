"""What the activations and gradients an agent sends give away, next to the accuracy and time
of the same settings: where to cut, how narrow a bottleneck, which codec, which defense.

    python bench/leakage.py            # full: Fashion-MNIST, small_cnn, 16 settings x 2 seeds (~25 min, 2 cores)
    python bench/leakage.py --quick    # smoke test (numbers not meaningful)

For every setting (a split, a HeteroSFL bottleneck width, a codec, a defense) the bench:

1. **Trains**: a real simulated run of the product (``simulation.run_simulation``: 4
   agents, IID shards of the training set, ``--rounds`` rounds of ``--tau`` steps, the
   setting's run config) and records its final test accuracy and virtual time (device
   profile ``s2fl-mid-mid`` for every agent).
2. **Captures what an agent sends**: the trained client portion (the coordinator knows it,
   it aggregates it) is assigned to an :class:`edge_agent.agent.AgentCore` holding
   ``--victims`` samples of the first simulated agent's private shard, with the setting's
   codec, bottleneck width and defenses. Its ``activations`` messages are decoded exactly as
   the coordinator decodes them (the defense's noise and the codec's rounding included).
   Gradients sent back are zero, so the client portion stays the trained one.
3. **Attacks the inputs** (model inversion, "the standard setup": He, Zhang and Lee, "Model
   inversion attacks against collaborative inference", ACSAC 2019): the coordinator trains
   an inverse network from activations to images on ``--public`` public images (the first
   part of the test set) pushed through the same client portion, codec and defense (the
   attacker knows the mechanism; its noise is fresh), then inverts the captured
   activations. Reported: SSIM (11x11 Gaussian window, sigma 1.5) and PSNR between
   reconstructions and the true images in [0, 1] pixel units; 1.0 SSIM = perfect.
   Distance correlation between the victim's inputs and what it sent: the bias-corrected
   U-statistic (``dcor2_u``; about 0 when independent, 1 for a similarity transform) and
   the plain sample statistic NoPeek minimises (``dcor``, biased upwards in high dimension).
4. **Attacks the labels**: an agent that sends its labels gives them away (100 %). One
   that withholds them (``privacy.withhold_labels``) returns the gradient of its loss with
   respect to the logits it was sent; the label is that gradient's one negative coordinate
   (the direction attack), read off every returned row. Reported: the attack's accuracy
   (chance is 10 %).

Each setting runs ``--seeds`` times (seeds of the data partition, weights and batches); the
table gives seed means (and min-max). A CPU replica: the model is small and the fleet
short-lived, so the accuracy column says what a defense costs relative to no defense, not
what a long run reaches.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import common  # noqa: F401  (sets sys.path)
import torch
import torch.nn.functional as F

from simulation import run_simulation
from edge_agent.agent import AgentCore, LocalData
from sfl_core.wire import protocol
from sfl_core.wire import codec as wire
from sfl_core.config.run import run_config_from_dict
from sfl_core.privacy import distance_correlation, distance_correlation_u

RUN = "leakage"

# name -> (split, run-config overrides). small_cnn on Fashion-MNIST: split 1 sends 16x28x28
# after conv1, split 2 (the default) 32x14x14 after conv2+pool, split 3 the 64 features of fc1.
SETTINGS: dict[str, tuple[int, dict[str, Any]]] = {
    "split 1": (1, {}),
    "split 2": (2, {}),
    "split 3": (3, {}),
    "split 2, fp16": (2, {"codec": "fp16"}),
    "split 2, int8": (2, {"codec": "int8"}),
    "split 2, width 8/32": (2, {"hetero": {"width": 32, "groups": 1, "widths": [8]}}),
    "split 2, width 2/32": (2, {"hetero": {"width": 32, "groups": 1, "widths": [2]}}),
    "split 2, NoPeek 0.5": (2, {"privacy": {"nopeek": 0.5}}),
    "split 2, NoPeek 2": (2, {"privacy": {"nopeek": 2.0}}),
    # activation noise: clip 20 (trained activations' median norm here is 29); the noise is per value,
    # 6272 of them, so sigma x clip is to be read against the values' RMS (about 0.3), not the norm
    "split 2, noise 0.003": (2, {"privacy": {"activation_noise": {"clip": 20.0, "sigma": 0.003}}}),
    "split 2, noise 0.015": (2, {"privacy": {"activation_noise": {"clip": 20.0, "sigma": 0.015}}}),
    "split 2, noise 1": (2, {"privacy": {"activation_noise": {"clip": 20.0, "sigma": 1.0}}}),
    "split 2, DP-SGD 1,1": (2, {"privacy": {"dp_sgd": {"clip": 1.0, "sigma": 1.0}}}),
    "split 2, labels withheld": (2, {"privacy": {"withhold_labels": True}}),
    "split 2, withheld + max_norm": (2, {"privacy": {"withhold_labels": True, "label_protection": "max_norm"}}),
    "split 2, withheld + sigma 0.25": (2, {"privacy": {"withhold_labels": True, "label_protection": 0.25}}),
    "split 2, withheld + sigma 1": (2, {"privacy": {"withhold_labels": True, "label_protection": 1.0}}),
}
QUICK = ("split 1", "split 2, width 2/32", "split 2, noise 1", "split 2, withheld + max_norm")


# --------------------------------------------------------------------------- measures
def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    g = torch.exp(-((torch.arange(size, dtype=torch.float64) - size // 2) ** 2) / (2 * sigma ** 2))
    g = g / g.sum()
    return (g[:, None] * g[None, :]).view(1, 1, size, size)


def ssim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-image SSIM (Wang et al. 2004) of images in [0, 1], channel-averaged, valid windows."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    c = a.shape[1]
    w = _gaussian_window().repeat(c, 1, 1, 1)
    mu_a, mu_b = F.conv2d(a, w, groups=c), F.conv2d(b, w, groups=c)
    var_a = F.conv2d(a * a, w, groups=c) - mu_a ** 2
    var_b = F.conv2d(b * b, w, groups=c) - mu_b ** 2
    cov = F.conv2d(a * b, w, groups=c) - mu_a * mu_b
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return s.flatten(1).mean(1)


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB of images in [0, 1]."""
    mse = (a.to(torch.float64) - b.to(torch.float64)).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(1.0 / mse.clamp_min(1e-10))


def to_pixels(x: torch.Tensor, pre: dict) -> torch.Tensor:
    """Normalised inputs back to [0, 1] pixels (the data set's own mean and std)."""
    mean = torch.tensor(pre["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(pre["std"]).view(1, -1, 1, 1)
    return (x * std + mean).clamp(0, 1)


# --------------------------------------------------------------------------- attacker
class Inverter(torch.nn.Module):
    """Activations -> a 1x28x28 image in [0, 1]: a small decoder for feature maps of any
    size up to 28 (convolutions, then transposed convolutions doubling to 28) or for vectors
    (a linear layer to a 64x7x7 map first)."""

    def __init__(self, shape: tuple[int, ...], out_shape: tuple[int, ...]):
        super().__init__()
        c_out, side = out_shape[0], out_shape[-1]
        layers: list[torch.nn.Module] = []
        if len(shape) == 1:
            start = side // 4
            layers += [torch.nn.Linear(shape[0], 64 * start * start), torch.nn.ReLU(),
                       torch.nn.Unflatten(1, (64, start, start))]
            c, s = 64, start
        else:
            c, s = shape[0], shape[-1]
            width = 32 if s >= side else 64    # full-resolution maps: a narrower first layer keeps it cheap
            layers += [torch.nn.Conv2d(c, width, 3, padding=1), torch.nn.ReLU()]
            c = width
        while s < side:
            layers += [torch.nn.ConvTranspose2d(c, 32, 4, stride=2, padding=1), torch.nn.ReLU()]
            c, s = 32, s * 2
        layers += [torch.nn.Conv2d(c, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, c_out, 3, padding=1),
                   torch.nn.Sigmoid()]
        self.net = torch.nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z.float())


def train_inverter(z: torch.Tensor, target: torch.Tensor, epochs: int, seed: int) -> Inverter:
    torch.manual_seed(seed)
    inv = Inverter(tuple(z.shape[1:]), tuple(target.shape[1:]))
    opt = torch.optim.Adam(inv.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(z), generator=gen).split(128):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(inv(z[idx]), target[idx]).backward()
            opt.step()
    return inv.eval()


# --------------------------------------------------------------------------- what an agent sends
class RecordingAgent(AgentCore):
    """An agent that also keeps the inputs of every batch it sent (the bench's ground truth)."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.inputs: list[torch.Tensor] = []

    def _protect(self, x: torch.Tensor, out: torch.Tensor):
        self.inputs.append(x.detach())
        return super()._protect(x, out)


def capture(engine, cfg, split: int, width: int, x: torch.Tensor, y: torch.Tensor, num_classes: int,
            seed: int, batch: int = 64) -> dict[str, torch.Tensor]:
    """Drive an agent holding (x, y) through one assignment of the trained client portion:
    the decoded activations it sent, its inputs in the same order, and, when it withholds its
    labels, the logit gradients it returned with the labels it kept."""
    privacy = cfg.privacy.agent()
    agent = RecordingAgent("victim", RUN, LocalData(x, y, num_classes), tuple(x.shape[1:]), seed=seed,
                           privacy=privacy)
    steps = math.ceil(len(x) / batch)
    a = dataclasses.replace(engine._assignment(split, width), batch_size=batch, tau=steps, lr=1e-9, momentum=0.0)
    state = {k: v.cpu() for k, v in engine.client_state(split, width).items()}
    seq = protocol.Sequencer(start=1)

    def coord(mtype: str, body: dict, step: int = 0) -> protocol.Message:
        msg = protocol.Message(mtype, RUN, protocol.COORDINATOR_ID, body, round=1, step=step, seq=seq.next())
        return protocol.decode(msg.encode(), run=RUN)

    def through(msg: protocol.Message) -> protocol.Message:
        return protocol.decode(msg.encode(), run=RUN)

    sent, grads, kept, labels_sent = [], [], [], []
    model = engine.model.cpu().eval()
    (reply,) = agent.handle(coord("assign", a.to_body(wire.encode_state(state))))
    while reply.type == "activations":
        reply = through(reply)
        h = wire.decode_tensor(reply.body["x"], shape=(None, *a.activation_shape), dtypes=("float32", "float16"))
        sent.append(h)
        if reply.body["y"] is not None:
            labels_sent.append(wire.decode_tensor(reply.body["y"]))
        else:   # the coordinator's logits for these rows, the agent's gradient back
            with torch.no_grad():
                z = model(agent.inputs[-1])
            (lg,) = agent.handle(coord("logits", {"z": wire.encode_tensor(z)}, reply.step))
            grads.append(wire.decode_tensor(through(lg).body["g"]))
            kept.append(agent._y.clone())   # noqa: SLF001 (ground truth the agent never sends)
        (reply,) = agent.handle(coord("gradients", {"g": wire.encode_tensor(torch.zeros_like(h))}, reply.step))
    out = {"inputs": torch.cat(agent.inputs), "sent": torch.cat(sent)}
    if grads:
        out["logit_grads"], out["labels"] = torch.cat(grads), torch.cat(kept)
    else:
        out["labels_sent"] = torch.cat(labels_sent)
    return out


# --------------------------------------------------------------------------- one setting, one seed
def run_one(job: tuple[str, int, dict[str, Any]]) -> dict[str, Any]:
    name, seed, a = job
    if a.get("threads"):
        torch.set_num_threads(a["threads"])
    split, overrides = SETTINGS[name]
    t0 = time.time()
    base = {
        "run": f"leak-{seed}", "model": "small_cnn", "strategy": "sfl", "split": split,
        "data": {"dataset": a["dataset"], "root": a["root"], "partition": "iid", "seed": seed},
        "fleet": [{"profile": "s2fl-mid-mid", "count": a["agents"]}], "rounds": a["rounds"],
        "local_iters": a["tau"], "batch_size": 32, "lr": 0.05, "momentum": 0.9, "seed": seed,
        "eval_samples": a["eval_samples"], "output_dir": str(Path(a["work"]) / f"{name.replace(' ', '_')}-s{seed}"),
    }
    cfg = run_config_from_dict(_merge(base, overrides))
    history, engine = run_simulation(cfg, device="cpu", quiet=True)
    hetero = cfg.sections["hetero"]
    width = hetero.widths[0] if hetero.widths else 0   # a HeteroSFL bottleneck, one group
    data = engine_data(a)
    pre = data.preprocessing
    victim = next(iter(engine.transport.agents.values())).data
    n_vic = min(a["victims"], len(victim.x))
    facts = {"setting": name, "seed": seed, "split": split, "width": width, "codec": cfg.codec,
             "defenses": cfg.privacy.agent().describe(), "accuracy": history[-1]["accuracy"],
             "virtual_s": history[-1]["elapsed_s"],
             "bytes_up_per_round": statistics.mean(r["bytes_up"] for r in history[1:]),
             "epsilon": history[-1].get("epsilon_max")}
    try:
        priv = capture(engine, cfg, split, width, victim.x[:n_vic], victim.y[:n_vic], data.num_classes, seed + 101)
        pub = capture(engine, cfg, split, width, data.x_test[:a["public"]], data.y_test[:a["public"]],
                      data.num_classes, seed + 202)
    except wire.WireError as exc:   # training diverged (NaN weights): nothing meaningful to attack
        print(f"{name} seed {seed}: training diverged ({exc}); accuracy {history[-1]['accuracy']}", flush=True)
        nan = float("nan")
        return {**facts, "ssim": nan, "psnr_db": nan, "dcor2_u": nan, "dcor": nan, "label_attack": nan,
                "diverged": True, "wall_s": round(time.time() - t0, 1)}
    inv = train_inverter(pub["sent"], to_pixels(pub["inputs"], pre), a["epochs"], seed)
    with torch.no_grad():
        recon = inv(priv["sent"])
    truth = to_pixels(priv["inputs"], pre)
    row = {
        **facts,
        "activation_values": int(math.prod(priv["sent"].shape[1:])),
        "ssim": float(ssim(recon, truth).mean()), "psnr_db": float(psnr(recon, truth).mean()),
        "dcor2_u": distance_correlation_u(priv["inputs"], priv["sent"]),
        "dcor": float(distance_correlation(priv["inputs"][:512], priv["sent"][:512])),
        "label_attack": (float((priv["logit_grads"].argmin(1) == priv["labels"]).float().mean())
                         if "logit_grads" in priv else 1.0),
        "labels_withheld": "logit_grads" in priv,
        "wall_s": round(time.time() - t0, 1),
    }
    if a.get("examples"):
        row["examples"] = {k: v[:8].squeeze(1).mul(1000).round().div(1000).tolist()   # 3 decimals: a small JSON
                           for k, v in (("truth", truth), ("recon", recon))}
    print(f"{name} seed {seed}: acc {row['accuracy']:.3f}  SSIM {row['ssim']:.3f}  PSNR {row['psnr_db']:.1f}  "
          f"dCor2_u {row['dcor2_u']:.3f}  labels {row['label_attack']:.2f}  ({row['wall_s']:.0f} s)", flush=True)
    return row


_DATA_CACHE: dict[tuple, Any] = {}


def engine_data(a: dict[str, Any]):
    key = (a["dataset"], a["root"])
    if key not in _DATA_CACHE:
        from sfl_core.data.builtin import load_dataset
        _DATA_CACHE[key] = load_dataset(a["dataset"], a["root"])
    return _DATA_CACHE[key]


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# --------------------------------------------------------------------------- report
def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == name]
        s: dict[str, Any] = {"setting": name, "seeds": len(mine), "defenses": mine[0]["defenses"],
                             "split": mine[0]["split"], "width": mine[0]["width"], "codec": mine[0]["codec"]}
        for key in ("accuracy", "virtual_s", "bytes_up_per_round", "ssim", "psnr_db", "dcor2_u", "dcor",
                    "label_attack"):
            vals = [r[key] for r in mine]
            s[key], s[key + "_range"] = statistics.mean(vals), [min(vals), max(vals)]
        eps = [r["epsilon"] for r in mine if r["epsilon"] is not None]
        s["epsilon"] = statistics.mean(eps) if eps else None
        out.append(s)
    return out


def plot(summary: list[dict[str, Any]], rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    splits = [s for s in summary if s["setting"] in ("split 1", "split 2", "split 3")]
    ax = axes[0]
    xs = [s["split"] for s in splits]
    ax.plot(xs, [s["ssim"] for s in splits], "o-", label="reconstruction SSIM")
    ax.plot(xs, [s["dcor2_u"] for s in splits], "s-", label="distance correlation (bias-corrected)")
    ax.plot(xs, [s["accuracy"] for s in splits], "^--", label="test accuracy")
    ax.set_xticks(xs)
    ax.set_xlabel("split point (blocks on the device)")
    ax.set_ylim(0, 1.05)
    tw = ax.twinx()
    tw.plot(xs, [s["virtual_s"] for s in splits], "k:", label="virtual time (s)")
    tw.set_ylabel("virtual time of the run (s)")
    ax.set_title("small_cnn, Fashion-MNIST: leakage against the split")
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    ax = axes[1]
    for s in summary:
        if not s["setting"].startswith("split 2, withheld"):
            ax.scatter(s["ssim"], s["accuracy"])
            ax.annotate(s["setting"].replace("split 2, ", ""), (s["ssim"], s["accuracy"]), fontsize=7)
    ax.set_xlabel("reconstruction SSIM (lower = less leakage)")
    ax.set_ylabel("test accuracy")
    ax.set_title("each setting: accuracy against input leakage")
    ax.grid(alpha=0.3)
    ax = axes[2]
    labels = [s for s in summary if s["setting"] in ("split 2", "split 2, labels withheld")
              or s["setting"].startswith("split 2, withheld")]
    names = [s["setting"].replace("split 2, ", "").replace("split 2", "labels sent") for s in labels]
    ax.barh(names, [s["label_attack"] for s in labels], color="tab:red", alpha=0.6, label="label attack accuracy")
    ax.scatter([s["accuracy"] for s in labels], names, color="k", zorder=3, label="test accuracy")
    ax.axvline(0.1, color="grey", ls=":", label="chance")
    ax.set_xlim(0, 1.05)
    ax.set_title("labels: what the coordinator reads off")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    examples = [r for r in rows if "examples" in r]
    if examples:
        fig, axes = plt.subplots(len(examples) + 1, 8, figsize=(8, 1.1 * (len(examples) + 1)), squeeze=False)
        for j in range(8):
            axes[0][j].imshow(examples[0]["examples"]["truth"][j], cmap="gray", vmin=0, vmax=1)
        axes[0][0].set_ylabel("private", fontsize=6)
        for i, r in enumerate(examples, start=1):
            for j in range(8):
                axes[i][j].imshow(r["examples"]["recon"][j], cmap="gray", vmin=0, vmax=1)
            axes[i][0].set_ylabel(r["setting"].replace("split 2, ", ""), fontsize=6, rotation=0, ha="right")
        for ax in axes.flat:
            ax.set_xticks([])
            ax.set_yticks([])
        fig.tight_layout()
        fig.savefig(path.with_name(path.stem + "_examples.png"), dpi=100)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--settings", nargs="*", default=None, help=f"a subset of: {'; '.join(SETTINGS)}")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tau", type=int, default=20, help="local steps per round")
    p.add_argument("--eval-samples", type=int, default=2000)
    p.add_argument("--public", type=int, default=5000, help="public images the attacker trains its inverter on")
    p.add_argument("--victims", type=int, default=512, help="private images of the victim agent attacked")
    p.add_argument("--epochs", type=int, default=10, help="epochs of the attacker's inverter")
    p.add_argument("--jobs", type=int, default=2, help="settings in parallel, one core each")
    p.add_argument("--work", type=Path, default=Path("/tmp/sfl-bench-leakage"))
    p.add_argument("--result-name", default="leakage", help="name of the JSON and figure files (a --settings "
                   "subset run can write beside the full one)")
    args = p.parse_args(argv)
    names = list(args.settings or SETTINGS)
    if args.quick:
        names = [n for n in QUICK if n in names] or names[:2]
        args.seeds, args.rounds, args.tau, args.eval_samples = 1, 1, 3, 200
        args.public, args.victims, args.epochs, args.agents, args.jobs = 256, 64, 1, 2, 1
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    spec = args.data
    if not Path(spec).is_dir() or "mnist" not in Path(spec).name.lower():
        raise SystemExit(f"--data {spec!r}: this bench needs a folder of Fashion-MNIST or MNIST (28x28 images)")
    dataset, root = ("fashion-mnist" if "fashion" in Path(spec).name.lower() else "mnist"), spec
    shared = {"dataset": dataset, "root": root, "agents": args.agents, "rounds": args.rounds, "tau": args.tau,
              "eval_samples": args.eval_samples, "public": args.public, "victims": args.victims,
              "epochs": args.epochs, "work": str(args.work), "threads": 1 if args.jobs > 1 else args.threads}
    show = {"split 1", "split 2", "split 3", "split 2, width 2/32", "split 2, NoPeek 2", "split 2, noise 0.015",
            "split 2, DP-SGD 1,1"}
    jobs = [(n, seed, {**shared, "examples": seed == 0 and n in show}) for n in names for seed in range(args.seeds)]
    rows = common.run_jobs(run_one, jobs, args)
    summary = summarise(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(summary, rows, args.out / f"{args.result_name}.png")
    for r in rows:
        r.pop("examples", None)     # pictures, in the figure only
    common.print_table(
        f"Leakage, accuracy and time: small_cnn on {dataset}, {args.agents} agents, {args.rounds} rounds x "
        f"{args.tau} steps, {args.seeds} seed(s) (means; attack: inverter on {args.public} public images)",
        ["setting", "accuracy", "virtual s", "MB up/round", "SSIM", "PSNR dB", "dCor2 (u)", "dCor", "label attack",
         "epsilon"],
        [[s["setting"], f"{s['accuracy']:.3f}", f"{s['virtual_s']:.0f}", f"{s['bytes_up_per_round'] / 1e6:.2f}",
          f"{s['ssim']:.3f}", f"{s['psnr_db']:.1f}", f"{s['dcor2_u']:.3f}", f"{s['dcor']:.3f}",
          f"{s['label_attack']:.2f}", "-" if s["epsilon"] is None else f"{s['epsilon']:.2f}"] for s in summary],
        caption="SSIM 1 = perfect reconstruction; label attack: share of labels the coordinator reads (chance 0.10)")
    out = common.write_result(args.out, args.result_name, {
        "config": common.config_record(args), "reference": "model inversion (He et al. 2019) on what an agent "
        "sends; label direction attack on withheld labels' logit gradients",
        "results": rows, "summary": summary})
    print(f"wrote {out}")
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    main()
