"""Whole-round benchmark: real processes over Mosquitto vs the time model's time for the same fleet
(docs/methods/time-model.md).

Command (full run, ~2-3 minutes on 2 CPU cores)::

    /tmp/venv/bin/python bench/round.py                      # small_cnn on digits, 4 agents, 5 rounds
    /tmp/venv/bin/python bench/round.py --model small_cnn --model resnet8   # + resnet8 on --data
    /tmp/venv/bin/python bench/round.py --quick              # smoke-test size, numbers not meaningful

Writes ``bench/results/round.json``.

What runs: a Mosquitto on a free port, ``sfl-coord serve --broker`` (``python -m
cli.coord``) and one ``sfl-agent start --emulate`` process per profile (default
s2fl-low-low, s2fl-mid-mid, s2fl-high-high, s2fl-low-high), feature-merging SFL
(``server_mode: merged``). ``--emulate`` stretches each agent's compute to its profile's
FLOP/s and sleeps ``bytes / link rate (+ latency)`` for every message it sends or
receives, so the fleet behaves like the profiles' devices.

Measured: each round's ``round_time_s`` from the run's ``metrics.jsonl`` (wall clock, first
assignment sent -> last weights received; aggregation and test evaluation come after and
are not in it).

Physical reference ("bound"): the time model (docs/methods/time-model.md) / S2FL Eq. 1 for the same fleet, per agent
``timing.agent_round_time`` with

- client FLOPs = ``model_costs(...)[split].client_flops * batch * tau`` at the profile's FLOP/s,
- server FLOPs = ``server_flops * batch * tau`` at ``cfg.server_flops`` (5e10),
- ``bytes_up`` / ``bytes_down`` = the encoded bytes that agent actually moved in that round
  (from the metrics: assignment + tau gradients down, tau activations + weights up) at
  the profile's up/down rates,
- ``messages`` = 2 * tau + 2 one-way latencies (0 for the S2FL profiles),

and bound = max over agents (a synchronous round lasts as long as its slowest agent).
``ratio = measured / bound`` is what the protocol and the implementation add. Also
reported: the mean ratio excluding round 1 (warm-up: first model build, first zstd
contexts, page faults).

What the bound does NOT include, i.e. what the ratio charges to the system:

- lock-step waiting: with feature merging the server needs every agent's activations
  before it can step, so each of the tau steps lasts as long as the slowest agent's step
  and the fast agents wait; the sum of per-step maxima can exceed the max of per-agent
  sums (equal when every agent's steps are alike, as here, so this is small).
- the merged server step: the server processes all agents' samples in one step, so the
  round pays the server time of the whole fleet, not of one agent. ``bound_merged`` =
  max over agents of (client + transfer) + sum over agents of server time adds that.
- the real server step on this CPU instead of 5e10 FLOP/s, zstd encode/decode on both
  sides, msgpack and validation, one PUBACK round-trip per MQTT chunk, broker hops,
  Python/paho thread hand-offs, and the coordinator's own per-step processing.
- CPU contention: all agents, the coordinator and Mosquitto share this machine (2 cores
  on the reference machine). Emulation can only slow a device down; when the real
  compute of a contended process takes longer than the profile's, the real time stands
  (``compute_s`` vs ``bound client s`` in the JSON shows it).
- with ``--agent-threads 0`` (torch's default: one OpenMP thread per core in every agent
  process) several agents on a 2-core machine oversubscribe it and real compute balloons;
  the default ``--agent-threads 1`` keeps that artefact of co-hosting out of the ratio.
- FLOPs are PyTorch's ``FlopCounterMode`` count (matmul/conv only, see accounting.py).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (bench helper; also puts the repo root on sys.path)
import yaml  # noqa: E402

from brokers import MosquittoBroker  # noqa: E402
from sfl_core import timing  # noqa: E402
from sfl_core.model.accounting import model_costs  # noqa: E402
from sfl_core.config.run import load_profile  # noqa: E402
from sfl_core.data.builtin import load_dataset  # noqa: E402

REPO = common.REPO_ROOT
DEFAULT_PROFILES = ("s2fl-low-low", "s2fl-mid-mid", "s2fl-high-high", "s2fl-low-high")
QUICK_PROFILES = ("s2fl-high-high", "s2fl-low-high")


@dataclass(frozen=True)
class Workload:
    model: str
    dataset: str
    root: Optional[str]
    batch_size: int
    local_iters: int
    codec: str
    rounds: int


def workloads(args: Any) -> list[Workload]:
    out = []
    for name in dict.fromkeys(args.model or ["small_cnn"]):
        if name == "small_cnn":
            w = Workload("small_cnn", "digits", None, 16, 10, "fp32", 5)
        elif name == "resnet8":
            ds = common.load_data(args.data)  # validates --data and tells which set it is
            given = Path(args.data).expanduser()
            root = str(given.resolve()) if ds.name != "digits" and given.exists() else None
            # fp16 and fewer steps: at 1 MB/s (s2fl-low-*) a 16-sample resnet8 step moves ~0.5 MB
            w = Workload("resnet8", ds.name, root, 16, 5, "fp16", 3)
        else:
            raise SystemExit(f"--model {name!r}: this bench knows small_cnn and resnet8")
        if args.rounds:
            w = replace(w, rounds=args.rounds)
        if args.quick:
            w = replace(w, rounds=2, local_iters=3)
        out.append(w)
    return out


# --------------------------------------------------------------------------- running the fleet


def write_config(tmp: Path, run: str, w: Workload, profiles: tuple[str, ...]) -> Path:
    cfg = {
        "run": run, "model": w.model,
        "data": {"dataset": w.dataset, "root": w.root, "partition": "iid", "seed": 0},
        "fleet": [{"profile": p, "count": 1} for p in profiles],
        "rounds": w.rounds, "strategy": "sfl", "server_mode": "merged", "batch_size": w.batch_size,
        "lr": 0.05, "momentum": 0.5, "local_iters": w.local_iters, "codec": w.codec, "zstd_level": 3,
        "step_timeout_s": 60, "register_timeout_s": 120, "output_dir": str(tmp / "out"),
    }
    path = tmp / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_fleet(url: str, w: Workload, profiles: tuple[str, ...], timeout: float,
              agent_threads: int = 0) -> tuple[list[dict], dict[str, str], float]:
    """Start coordinator + agents, wait for the run to finish; (metrics, agent->profile, seconds).

    ``agent_threads`` > 0 caps each agent's torch/OpenMP threads (OMP_NUM_THREADS): several
    agent processes on few cores otherwise each start one spinning OpenMP thread per core.
    """
    run = f"bench-round-{w.model}".replace("_", "-")
    with tempfile.TemporaryDirectory(prefix="sfl-bench-round-") as tmp_s:
        tmp = Path(tmp_s)
        config = write_config(tmp, run, w, profiles)
        t0 = time.monotonic()
        procs: list[subprocess.Popen] = []
        logs: list[Path] = []

        def launch(name: str, cmd: list[str], env: Optional[dict[str, str]] = None) -> None:
            log = tmp / f"{name}.log"
            logs.append(log)
            with open(log, "w") as fh:
                procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env))

        launch("coord", [sys.executable, "-m", "cli.coord", "serve", "--config", str(config), "--broker", url,
                         "--quiet", "--device", "cpu"])
        agent_env = None
        if agent_threads > 0:
            agent_env = {**os.environ, "OMP_NUM_THREADS": str(agent_threads), "MKL_NUM_THREADS": str(agent_threads)}
        agent_profiles = {}
        for i, prof in enumerate(profiles):
            aid = f"a{i}"
            agent_profiles[aid] = prof
            cmd = [sys.executable, "-m", "cli.agent", "start", "--profile", prof, "--broker", url, "--run", run,
                   "--index", str(i), "--agent-id", aid, "--emulate",
                   "--coordinator-key", common.coordinator_key(tmp / "out")]
            if w.root:
                cmd += ["--data", w.root]
            launch(aid, cmd, agent_env)
        try:
            deadline = time.monotonic() + timeout
            codes = []
            for p in procs:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes = [-1]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        seconds = time.monotonic() - t0
        if any(codes):
            tails = "\n".join(f"--- {lg.name}\n{lg.read_text(errors='replace')[-1500:]}" for lg in logs)
            raise RuntimeError(f"{w.model} run failed or timed out after {seconds:.0f} s (exit codes "
                               f"{[p.returncode for p in procs]}):\n{tails}")
        metrics_file = tmp / "out" / "metrics.jsonl"
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return metrics, agent_profiles, seconds


# --------------------------------------------------------------------------- the time-model bound


def round_bound(record: dict, w: Workload, agent_profiles: dict[str, str], input_shape: tuple[int, ...],
                num_classes: int, server_flops: float) -> dict[str, Any]:
    """Per-agent time-model times for the bytes this round really moved; bound = slowest agent."""
    costs = model_costs(w.model, input_shape, num_classes)
    per_agent: dict[str, Any] = {}
    for aid, a in record["agents"].items():
        prof = load_profile(agent_profiles[aid])
        cost = costs[a["split"]]
        samples = a["batch_size"] * w.local_iters
        t = timing.agent_round_time(
            client_flops=cost.client_flops * samples, server_flops=cost.server_flops * samples,
            bytes_up=a["bytes_up"], bytes_down=a["bytes_down"], client_flops_per_s=prof.compute_flops,
            server_flops_per_s=server_flops, uplink_bytes_per_s=prof.link_bytes_per_s,
            downlink_bytes_per_s=prof.downlink_bytes_per_s, latency_s=prof.latency_s,
            messages=2 * w.local_iters + 2)
        per_agent[aid] = {
            "profile": prof.name, "bytes_up": a["bytes_up"], "bytes_down": a["bytes_down"],
            "bound_s": t.total_s, "bound_client_s": t.client_compute_s, "bound_transfer_s": t.transfer_s,
            "bound_server_s": t.server_compute_s, "measured_s": a["time_s"], "compute_s": a["compute_s"],
        }
    slowest = max(per_agent, key=lambda k: per_agent[k]["bound_s"])
    bound = per_agent[slowest]["bound_s"]
    merged = (max(v["bound_client_s"] + v["bound_transfer_s"] for v in per_agent.values())
              + sum(v["bound_server_s"] for v in per_agent.values()))
    measured = float(record["round_time_s"])
    return {"round": record["round"], "measured_s": measured, "bound_s": bound, "ratio": measured / bound,
            "bound_merged_s": merged, "ratio_merged": measured / merged, "slowest": slowest,
            "accuracy": record["accuracy"], "agents": per_agent}


def run_workload(url: str, w: Workload, profiles: tuple[str, ...], timeout: float,
                 agent_threads: int = 0) -> dict[str, Any]:
    ds = load_dataset(w.dataset, w.root)
    metrics, agent_profiles, seconds = run_fleet(url, w, profiles, timeout, agent_threads)
    rounds = [r for r in metrics if r["round"] >= 1]
    if len(rounds) != w.rounds or any(len(r["completed"]) != len(profiles) for r in rounds):
        raise RuntimeError(f"{w.model}: expected {w.rounds} complete rounds of {len(profiles)} agents, "
                           f"got {[(r['round'], r['completed']) for r in rounds]}")
    per_round = [round_bound(r, w, agent_profiles, ds.input_shape, ds.num_classes, 5e10) for r in rounds]
    later = per_round[1:] or per_round
    return {
        **asdict(w), "profiles": list(profiles), "server_mode": "merged", "server_flops": 5e10,
        "input_shape": list(ds.input_shape), "run_seconds": round(seconds, 2),
        "agent_threads": agent_threads or "torch default",
        "mean_ratio_excl_round1": statistics.mean(r["ratio"] for r in later),
        "mean_ratio_merged_excl_round1": statistics.mean(r["ratio_merged"] for r in later),
        "final_accuracy": per_round[-1]["accuracy"], "rounds_detail": per_round,
    }


# --------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--model", action="append", choices=["small_cnn", "resnet8"],
                   help="workload(s): small_cnn on digits (default), resnet8 on --data; repeatable")
    p.add_argument("--profiles", nargs="+", default=None, help=f"agent profiles (default {' '.join(DEFAULT_PROFILES)})")
    p.add_argument("--rounds", type=int, default=None, help="override the rounds per workload")
    p.add_argument("--broker", default=None, help="MQTT URL of a running broker (default: start a Mosquitto)")
    p.add_argument("--agent-threads", type=int, default=1,
                   help="OMP_NUM_THREADS for each agent process (default 1; 0 = torch's default of one "
                        "thread per core, which oversubscribes a small machine hosting several agents)")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per workload run (default 600)")
    args = p.parse_args(argv)
    profiles = tuple(args.profiles or (QUICK_PROFILES if args.quick else DEFAULT_PROFILES))
    for prof in profiles:
        load_profile(prof)  # fail before starting processes
    loads = workloads(args)

    broker: Optional[MosquittoBroker] = None
    url = args.broker
    if url is None:
        broker = MosquittoBroker().start()
        url = broker.url
    try:
        results = [run_workload(url, w, profiles, args.timeout, args.agent_threads) for w in loads]
    finally:
        version = broker.version() if broker else "external broker"
        if broker:
            broker.stop()

    cpu = common.machine_info().get("cpu_count")
    contention = (f"{len(profiles)} agent processes + coordinator + Mosquitto share {cpu} CPU cores: contention "
                  "inflates real compute (emulation only slows down) and that shows up in the ratio")
    for res in results:
        rows = []
        for r in res["rounds_detail"]:
            s = r["agents"][r["slowest"]]
            rows.append([r["round"], r["measured_s"], r["bound_s"], r["ratio"], r["bound_merged_s"], r["ratio_merged"],
                         f"{r['slowest']} ({s['profile']})", s["bound_client_s"], s["bound_transfer_s"],
                         s["bound_server_s"], s["measured_s"], s["compute_s"]])
        common.print_table(
            f"round time over Mosquitto: {res['model']} on {res['dataset']}, {len(profiles)} emulated agents, "
            f"batch {res['batch_size']}, tau {res['local_iters']}, {res['codec']}",
            ["round", "measured s", "bound s", "ratio", "bound merged s", "ratio merged", "slowest (bound)",
             "client s", "transfer s", "server s", "its measured s", "its compute_s"], rows,
            caption=f"ratio = measured / time-model bound (max over agents); mean excl. round 1: "
                    f"{res['mean_ratio_excl_round1']:.3f} (merged-aware: {res['mean_ratio_merged_excl_round1']:.3f}). "
                    f"{contention}.")
    doc = {"quick": args.quick, "broker": version, "note": contention, "workloads": results}
    path = common.write_result(args.out, "round", doc)
    print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    main()
