"""Steps in flight over real, shaped links: windows 1, 2, 4, 8 and ``auto`` with a real broker,
real coordinator and agent processes, each agent in a network namespace of its own whose link
the bench shapes (``tc``: rate and, where the kernel has netem, one-way delay, each direction),
and the same runs in ``sfl-coord simulate`` to compare the time model's round with the measured
one.

The user's question: "my devices sit on slow WiFi; how much sooner does a window of steps in
flight get my model to accuracy on real links, what does it cost in accuracy, and does the
simulator predict it?" Nothing here is emulated: compute runs at this machine's speed and the
bytes cross the shaped virtual links. The simulation prices the same links (their goodput as
measured one way at a time and both ways at once, the profiles' ``bidir_*`` rates), with each device's
and the coordinator's compute rates as the lock-step run (window 1) of the same seed measured
them, and the coordinator's own seconds per agent and step (``agent_step_overhead_s``) as that
run's rounds beyond their slowest agent gave it: the windows' rounds are then predictions of the
time model's pipeline, not fits.

Lock-step runs ``--rounds``; each window runs more (:data:`LONGER` times the links' bound as
many) and is read at lock-step's seconds in rounds of the same seed: a user who gives the run
lock-step's time has that model. Its accuracy at lock-step's rounds is reported beside it.

The links (``--links``): ``boards`` (default) are the shipped profiles' own, a Raspberry Pi 4,
a Jetson Nano and a Jetson Xavier NX on WiFi (5, 10 and 20 Mb/s, the same each way, as the
profiles state them: the fleet the simulated boards bench prices); ``home`` are asymmetric
home links (2/4, 4/8 and 8/16 Mb/s up/down). The physical bound is reported beside the
measured figures: the time model's round on the links alone (compute free) at window 1 over
window 8. Steps in flight overlap the uplink with the downlink and with compute; where the
uplink is half the downlink that bound is near 1.5x, whatever the pipeline does.

Each agent runs one torch thread (``OMP_NUM_THREADS=1``): the agents stand for separate boards,
and here they share two cores with the coordinator and the broker, where torch's default of a
thread per core makes steps computed at once spin against each other.

Topology (created and removed by the bench; needs root, ``ip`` and ``tc``): a namespace
``sflp-hub`` with a bridge, Mosquitto (listening on the bridge's address, inside that namespace
only) and the coordinator, and one namespace ``sflp-aN`` per agent, joined to the bridge by a
veth pair shaped on both ends. Nothing of it is reachable from the machine's own network.

    sudo python bench/pipeline_shaped.py --seed 8 --seeds 4   # windows 1 2 4 8 auto, seeds 8-11
    sudo python bench/pipeline_shaped.py --quick            # smoke test
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import yaml

import common  # noqa: E402  (puts the repo root on sys.path)
from brokers import MESSAGE_SIZE_LIMIT, MOSQUITTO_MISSING, find_mosquitto  # noqa: E402

from sfl_core.config.profiles import load_profile  # noqa: E402
from sfl_core.wire.signing import KEY_FILE, Signer, public_text  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HUB, SUBNET, PORT = "sflp-hub", "10.89.0", 1883
BOARDS = ("rpi4", "jetson-nano", "jetson-xavier-nx")
LONGER = 1.1
"""The windowed rows run lock-step's rounds times the links' bound times this, so that they
reach lock-step's seconds in rounds; they are read there."""
"""The shipped profiles whose links ``--links boards`` shapes, one per agent in turn."""
HOME: list[dict[str, float]] = [
    # per agent: uplink and downlink in bit/s, one-way delay in ms (home broadband, a weak and a good link)
    {"up": 2_000_000, "down": 4_000_000, "delay_ms": 10},
    {"up": 4_000_000, "down": 8_000_000, "delay_ms": 10},
    {"up": 8_000_000, "down": 16_000_000, "delay_ms": 5},
]
LINKS: list[dict[str, float]] = HOME
"""The links in use (``--links``), one per agent in turn."""
COMPUTE_FLOPS = 5e9
"""The devices' compute in their profiles: this machine runs their small steps in a few ms."""
CAL_SERVER_FLOPS = 1e9
"""The server's FLOP/s in the simulation the calibration starts from: slow, so that the seconds
it charges stand well above the record's rounding (0.1 ms)."""
BOTH_PROBES = 3
"""How many times :func:`goodput` measures each link both ways at once."""
FREE_FLOPS = 1e15
"""Compute the links' bound is priced with: free beside any transfer."""
AGENT_ENV = dict(os.environ, OMP_NUM_THREADS="1")
"""One torch thread per agent process (see the module's docstring)."""
BURST = 1600
"""The token bucket's size in bytes: one full frame. A larger bucket fills while a link idles
between messages and sends its bytes at the line's own rate: lock-step links idle between
every step, pipelined ones less, so a bucket of three frames made lock-step's rounds about
10 % quicker than the rate the profiles state."""


def board_links() -> list[dict[str, float]]:
    """The shipped profiles' links in :data:`BOARDS` (downlink as the uplink where unstated)."""
    out = []
    for name in BOARDS:
        p = load_profile(name)
        out.append({"up": round(8 * p.link_bytes_per_s), "down": round(8 * p.downlink), "delay_ms": 1000 * p.latency_s})
    return out


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def has_netem() -> bool:
    """Whether this kernel can delay packets (``sch_netem``); without it the links are shaped in
    rate only, and the profiles say no latency."""
    subprocess.run(["ip", "netns", "add", "sflp-probe"], capture_output=True)
    try:
        subprocess.run(["ip", "-n", "sflp-probe", "link", "set", "lo", "up"], capture_output=True)
        return subprocess.run(["tc", "-n", "sflp-probe", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                              capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", "sflp-probe"], capture_output=True)


NETEM = False


def topology_up(n: int) -> None:
    topology_down(n)
    sh("ip", "netns", "add", HUB)
    sh("ip", "-n", HUB, "link", "set", "lo", "up")
    sh("ip", "-n", HUB, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", HUB, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
    sh("ip", "-n", HUB, "link", "set", "br0", "up")
    for i in range(n):
        ns, link = f"sflp-a{i}", LINKS[i % len(LINKS)]
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", f"sflp-h{i}", "type", "veth", "peer", "name", f"sflp-d{i}")
        sh("ip", "link", "set", f"sflp-h{i}", "netns", HUB)
        sh("ip", "link", "set", f"sflp-d{i}", "netns", ns)
        sh("ip", "-n", HUB, "link", "set", f"sflp-h{i}", "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", f"sflp-d{i}")
        sh("ip", "-n", ns, "link", "set", f"sflp-d{i}", "up")
        # the device's uplink leaves its namespace; its downlink leaves the hub's end of the pair
        shape(ns, f"sflp-d{i}", int(link["up"]), link["delay_ms"])
        shape(HUB, f"sflp-h{i}", int(link["down"]), link["delay_ms"])


def shape(ns: str, dev: str, bits_per_s: int, delay_ms: float) -> None:
    """Limit ``dev``'s egress to ``bits_per_s`` (a token bucket of one frame, :data:`BURST`, so
    the rate holds from the first byte) and, where the kernel has netem, delay it by ``delay_ms``."""
    sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{bits_per_s}bit",
       "burst", str(BURST), "latency", "2s")
    if NETEM and delay_ms:
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", "delay",
           f"{delay_ms}ms")


def topology_down(n: int) -> None:
    for ns in [HUB, *(f"sflp-a{i}" for i in range(n))]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def goodput(n: int) -> list[dict[str, float]]:
    """Each shaped link's goodput in bytes/s (:mod:`link_goodput`: bulk TCP transfers of two
    seconds at the shaped rate, timed by the receiver): ``up`` and ``down`` one way at a time,
    as a lock-step agent uses its link and as the profiles price it, and ``both_up`` and
    ``both_down`` both ways at once over one connection, as steps in flight use it (the median
    of :data:`BOTH_PROBES` probes: they vary more than one way's)."""
    script, port, out = str(REPO / "bench" / "link_goodput.py"), 5201, []
    for i in range(n):
        rates, both = {}, []
        for direction in ("up", "down", *["both"] * BOTH_PROBES):
            rate = LINKS[i % len(LINKS)]["up" if direction == "both" else direction]
            nbytes = str(max(256 * 1024, int(2 * rate / 8)))
            server = subprocess.Popen(["ip", "netns", "exec", HUB, sys.executable, script, "serve", f"{SUBNET}.1",
                                       str(port), direction, nbytes], stdout=subprocess.PIPE, text=True)
            try:
                assert server.stdout is not None
                server.stdout.readline()   # "ready"
                client = subprocess.run(["ip", "netns", "exec", f"sflp-a{i}", sys.executable, script, "connect",
                                         f"{SUBNET}.1", str(port), direction, nbytes],
                                        capture_output=True, text=True, timeout=60, check=True)
                hub_said = server.communicate(timeout=60)[0]
                if direction == "both":   # the hub received the uplink's bytes, the device the downlink's
                    both.append((float(hub_said.split()[-1]), float(client.stdout.split()[-1])))
                else:
                    rates[direction] = float((hub_said if direction == "up" else client.stdout).split()[-1])
            finally:
                if server.poll() is None:
                    server.kill()
                    server.wait()
        rates["both_up"] = statistics.median(u for u, _ in both)
        rates["both_down"] = statistics.median(d for _, d in both)
        out.append(rates)
    return out


GOODPUT: list[dict[str, float]] = []
"""The shaped links' goodput, bytes/s (:func:`goodput`), once the topology is up."""


def profiles(tmp: Path, n: int, compute: list[float] | None = None, tag: str = "") -> list[Path]:
    """Device profiles that say what the shaped links are (the run config's fleet and the
    simulation's): their goodput as measured (:data:`GOODPUT`), one way at a time and both ways
    at once, else the shaped rate; ``compute``: each device's FLOP/s where measured
    (:func:`calibrated`)."""
    out = []
    for i in range(n):
        link = LINKS[i % len(LINKS)]
        up, down = (GOODPUT[i]["up"], GOODPUT[i]["down"]) if GOODPUT else (link["up"] / 8, link["down"] / 8)
        path = tmp / f"shaped-{i}{tag}.yaml"
        both = {"bidir_link_bytes_per_s": GOODPUT[i]["both_up"],
                "bidir_downlink_bytes_per_s": GOODPUT[i]["both_down"]} if GOODPUT else {}
        path.write_text(yaml.safe_dump({
            "name": f"shaped-{i}{tag}", "compute_flops": compute[i] if compute else COMPUTE_FLOPS,
            "link_bytes_per_s": up, "downlink_bytes_per_s": down, **both,
            "latency_s": link["delay_ms"] / 1000 if NETEM else 0.0,
            "memory_bytes": 2**32, "description": "a device behind the bench's shaped link"}))
        out.append(path)
    return out


def run_config(tmp: Path, name: str, window: int | str, seed: int, args: Any, profile_paths: list[Path],
               rounds: int | None = None) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "run": name, "model": "small_cnn", "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5,
                                                    "seed": seed},
        "fleet": [{"profile": str(p), "count": 1} for p in profile_paths], "rounds": rounds or args.rounds,
        "strategy": "sfl", "split": 2, "server_mode": "merged", "batch_size": 16, "lr": 0.05, "momentum": 0.5,
        "local_iters": args.local_iters, "window": window, "seed": seed, "step_timeout_s": 60,
        "register_timeout_s": 120, "output_dir": str(tmp / "out" / name)}))
    return path


def broker(tmp: Path) -> subprocess.Popen:
    """Mosquitto in the hub namespace, on the bridge's address (anonymous: nothing outside the
    bench's namespaces can reach it)."""
    binary = find_mosquitto()
    if binary is None:
        raise SystemExit(MOSQUITTO_MISSING)
    conf = tmp / "mosquitto.conf"
    conf.write_text(f"listener {PORT} {SUBNET}.1\nallow_anonymous true\npersistence false\n"
                    f"message_size_limit {MESSAGE_SIZE_LIMIT}\nmax_inflight_messages 0\nmax_queued_messages 0\n"
                    "set_tcp_nodelay true\nlog_dest stderr\nlog_type error\n")
    proc = subprocess.Popen(["ip", "netns", "exec", HUB, binary, "-c", str(conf)], stderr=subprocess.DEVNULL)
    ok = subprocess.run(["ip", "netns", "exec", HUB, sys.executable, "-c",
                         f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); from brokers import wait_port; "
                         f"sys.exit(0 if wait_port({SUBNET + '.1'!r}, {PORT}, 10) else 1)"]).returncode == 0
    if not ok:
        proc.kill()
        raise RuntimeError("mosquitto did not start in the hub namespace")
    return proc


def real_run(tmp: Path, config: Path, name: str, n: int) -> list[dict[str, Any]]:
    out = tmp / "out" / name
    key = public_text(Signer.load_or_create(out / KEY_FILE).public)
    logs, procs = [], []
    try:
        log = open(tmp / f"{name}-coord.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(["ip", "netns", "exec", HUB, sys.executable, "-m", "cli.coord", "serve",
                                       "--config", str(config), "--broker", f"mqtt://{SUBNET}.1:{PORT}", "--quiet"],
                                      stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        for i in range(n):
            log = open(tmp / f"{name}-agent-{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", f"sflp-a{i}", sys.executable, "-m", "cli.agent", "start",
                 "--profile", str(tmp / f"shaped-{i}.yaml"), "--broker", f"mqtt://{SUBNET}.1:{PORT}",
                 "--run", name, "--index", str(i), "--agent-id", f"a{i}", "--coordinator-key", key],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=AGENT_ENV))
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=900))
            except subprocess.TimeoutExpired:
                codes.append(None)
        if codes != [0] * len(procs):
            raise RuntimeError(f"{name}: exit codes {codes}; logs in {tmp}")
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def simulated_run(config: Path, name: str, fleet: list[Path] | None = None,
                  server_flops: float | None = None, overhead_s: float = 0.0) -> list[dict[str, Any]]:
    """The same run in ``sfl-coord simulate`` (the virtual clock), on ``fleet``'s profiles,
    ``server_flops`` where given, and ``overhead_s`` as the run's ``agent_step_overhead_s``."""
    from sfl_core.config.run import run_config_from_dict
    from simulation import run_simulation

    d = yaml.safe_load(config.read_text())
    d = {**d, "run": f"{name}-sim", "output_dir": str(Path(d["output_dir"]) / "sim"), "agent_step_overhead_s": overhead_s}
    if fleet is not None:
        d["fleet"] = [{"profile": str(p), "count": 1} for p in fleet]
    if server_flops is not None:
        d["server_flops"] = server_flops
    history, _ = run_simulation(run_config_from_dict(d), device="cpu", quiet=True)
    return history


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the lock-step run of a seed measured, in the time model's terms (:func:`calibrated`)."""

    compute_flops: list[float]
    """Each device's FLOP/s."""
    server_flops: float
    """The coordinator's FLOP/s for the server steps."""
    overhead_s: float
    """The coordinator's own seconds per split agent per step (``agent_step_overhead_s``)."""


def calibrated(real: list[dict[str, Any]], sim: list[dict[str, Any]], server_flops: float, steps: int
               ) -> Calibration:
    """Each device's and the coordinator's rates and the coordinator's own overhead as the
    lock-step run measured them. ``sim``: the same run simulated at the profiles' compute,
    the server at ``server_flops`` and no overhead.

    The virtual clock charges ``flops / rate``, so a rate scales by the simulated seconds over
    the measured ones, summed over the rounds: each device's from its ``client_s``; the
    coordinator's from the server seconds the clock charged (an agent's ``time_s`` less its
    ``client_s`` and ``transfer_s``: the record's ``server_s`` is the host's watch in a
    simulation) against the measured ``server_s``. The overhead is the measured round beyond
    its slowest agent (the coordinator decoding, encoding and publishing the steps' messages,
    which no agent's time holds) per split agent per step, the run's documented way to price
    it. The links stay what the bench shaped."""
    def total(history: list[dict[str, Any]], part: Callable[[dict[str, Any]], float]) -> list[float]:
        agents = sorted(history[1]["agents"])
        return [sum(part(r["agents"][a]) for r in history[1:]) for a in agents]

    compute = [COMPUTE_FLOPS * s / m for s, m in zip(total(sim, lambda x: x["client_s"]),
                                                     total(real, lambda x: x["client_s"]))]
    charged = sum(total(sim, lambda x: x["time_s"] - x["client_s"] - x["transfer_s"]))
    server = server_flops * charged / sum(total(real, lambda x: x["server_s"]))
    beyond = [r["round_time_s"] - max(a["time_s"] for a in r["agents"].values()) for r in real[1:]]
    overhead = max(0.0, statistics.mean(beyond)) / (steps * len(real[1]["agents"]))
    return Calibration(compute, server, overhead)


ROUND_KEYS = ("round", "accuracy", "round_time_s", "elapsed_s", "wall_s", "eval_s", "waiting_s", "bytes_up",
              "bytes_down")
AGENT_KEYS = ("time_s", "client_s", "transfer_s", "server_s", "coordinator_s", "bytes_up", "bytes_down", "window",
              "overlap_s")


def compact(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the result keeps of a run's metrics: each round's time, accuracy and bytes, and each
    agent's share of the round."""
    return [{**{k: r[k] for k in ROUND_KEYS if k in r},
             "agents": {a: {k: x[k] for k in AGENT_KEYS if k in x} for a, x in r.get("agents", {}).items()}}
            for r in history]


def time_to(history: list[dict[str, Any]], target: float) -> float | None:
    return next((r["elapsed_s"] for r in history if r["accuracy"] is not None and r["accuracy"] >= target), None)


def window_arg(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a window is an integer >= 1 or 'auto'")
    return int(text)


def training_curve(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Accuracy against the seconds spent in rounds (start-up and registration left out: they
    are the same for every window)."""
    return [{"accuracy": r["accuracy"], "elapsed_s": sum(x["round_time_s"] for x in history[1:i + 1])}
            for i, r in enumerate(history)]


def links_bound(tmp: Path, seed: int, args: Any, n: int) -> float:
    """How many times shorter the links alone let a round be with steps in flight: the time
    model's round with compute free (:data:`FREE_FLOPS`) at window 1 over window 8."""
    free = profiles(tmp, n, [FREE_FLOPS] * n, tag=f"-free{seed}")
    rounds = []
    for w in (1, 8):
        run = f"bound-w{w}-s{seed}"
        sim = simulated_run(run_config(tmp, run, w, seed, args, free), run, free, FREE_FLOPS)
        rounds.append(statistics.mean(r["round_time_s"] for r in sim[1:]))
    return rounds[0] / rounds[1]


def main() -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--windows", type=window_arg, nargs="*", default=[1, 2, 4, 8, "auto"],
                   help="the windows to run, lock-step (1) first: integers >= 1 or 'auto'")
    p.add_argument("--links", choices=("boards", "home"), default="boards",
                   help="the shipped boards' links (default) or asymmetric home links (see above)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-iters", type=int, default=10)
    p.add_argument("--agents", type=int, default=3)
    args = p.parse_args()
    if args.quick:
        args.seeds, args.windows, args.rounds, args.local_iters = 1, [1, 4], 2, 4
    if not args.windows or args.windows[0] != 1:
        raise SystemExit("--windows: lock-step (1) comes first; the others are measured against it")
    global LINKS
    LINKS = board_links() if args.links == "boards" else HOME
    if os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"):
        raise SystemExit("bench/pipeline_shaped.py: needs root and the ip and tc commands (iproute2) to make "
                         "its network namespaces")
    common.apply_threads(args)
    global NETEM
    NETEM = has_netem()
    if not NETEM:
        print("this kernel has no netem (sch_netem): links shaped in rate only, no added delay", flush=True)
    n = args.agents
    runs: dict[str, list[dict[str, Any]]] = {}
    bounds: list[float] = []
    with tempfile.TemporaryDirectory(prefix="sfl-shaped-") as name:
        tmp = Path(name)
        topology_up(n)
        mosquitto = None
        try:
            GOODPUT[:] = goodput(n)
            for i, (g, x) in enumerate(zip(GOODPUT, LINKS)):
                print(f"agent {i}: goodput {g['up']:.0f} B/s up, {g['down']:.0f} down (shaped at "
                      f"{x['up'] / 8:.0f} and {x['down'] / 8:.0f}); both ways at once {g['both_up']:.0f} up, "
                      f"{g['both_down']:.0f} down (median of {BOTH_PROBES})", flush=True)
            paths = profiles(tmp, n)
            mosquitto = broker(tmp)
            for seed in range(args.seed, args.seed + args.seeds):
                bounds.append(links_bound(tmp, seed, args, n))
                print(f"seed {seed}: the links allow rounds {bounds[-1]:.2f}x shorter at most", flush=True)
                real: dict[int | str, list[dict[str, Any]]] = {}
                for w in args.windows:
                    run = f"shaped-w{w}-s{seed}"
                    rounds = args.rounds if w == 1 else math.ceil(args.rounds * bounds[-1] * LONGER)
                    t0 = time.monotonic()
                    real[w] = real_run(tmp, run_config(tmp, run, w, seed, args, paths, rounds), run, n)
                    print(f"window {w} seed {seed}: final {real[w][-1]['accuracy']:.4f}, "
                          f"{sum(r['round_time_s'] for r in real[w][1:]):.1f} s in rounds "
                          f"({time.monotonic() - t0:.0f} s with start-up)", flush=True)
                # the simulation, on the devices' and the coordinator's rates as lock-step measured them
                first = args.windows[0]
                config = run_config(tmp, f"shaped-w{first}-s{seed}", first, seed, args, paths)
                cal = calibrated(real[first], simulated_run(config, f"cal-s{seed}", server_flops=CAL_SERVER_FLOPS),
                                 CAL_SERVER_FLOPS, args.local_iters)
                fleet = profiles(tmp, n, cal.compute_flops, tag=f"-cal{seed}")
                for w in args.windows:
                    run = f"shaped-w{w}-s{seed}"
                    rounds = real[w][-1]["round"]
                    sim = simulated_run(run_config(tmp, run, w, seed, args, paths, rounds), run, fleet,
                                        cal.server_flops, cal.overhead_s)
                    runs.setdefault(f"window {w}", []).append({"seed": seed, "real": compact(real[w]),
                                                               "sim": compact(sim),
                                                               "calibrated": dataclasses.asdict(cal)})
                    print(f"window {w} seed {seed}: simulated {sum(r['round_time_s'] for r in sim[1:]):.1f} s "
                          f"in rounds", flush=True)
        finally:
            if mosquitto is not None:
                mosquitto.kill()
                mosquitto.wait()
            topology_down(n)
    summary, table = {}, []
    duplex = [1 - g[f"both_{d}"] / g[d] for g in GOODPUT for d in ("up", "down")]   # what both ways at once cost
    curves = {row: [training_curve(r["real"]) for r in rs] for row, rs in runs.items()}
    budgets = [c[-1]["elapsed_s"] for c in curves["window 1"]]   # lock-step's seconds in rounds, per seed
    target = 0.9 * statistics.mean(c[-1]["accuracy"] for c in curves["window 1"])
    ref_t = ref_round = None
    ref_times: list[float | None] = []
    for row, rs in runs.items():
        finals = [common.at_time(c, t) for c, t in zip(curves[row], budgets)]
        times = [time_to(c, target) for c in curves[row]]
        errors = [(s["round_time_s"] - m["round_time_s"]) / m["round_time_s"]
                  for r in rs for m, s in zip(r["real"][1:], r["sim"][1:]) if m["round_time_s"] > 0]
        s = summary[row] = {
            "final_mean": statistics.mean(finals), "final_worst": min(finals),
            "at_lockstep_rounds_mean": statistics.mean(r["real"][args.rounds]["accuracy"] for r in rs),
            "rounds_run": [r["real"][-1]["round"] for r in rs],
            "time_to_target_s": statistics.mean(t for t in times if t is not None) if None not in times else None,
            "round_s_measured": statistics.mean(m["round_time_s"] for r in rs for m in r["real"][1:]),
            "round_s_simulated": statistics.mean(m["round_time_s"] for r in rs for m in r["sim"][1:]),
            "sim_error_median": statistics.median(errors), "sim_error_abs_median": statistics.median(map(abs, errors))}
        ref_t = ref_t or s["time_to_target_s"]
        ref_times = ref_times or times
        ref_round = ref_round or s["round_s_measured"]
        s["speedup_to_target"] = ref_t / s["time_to_target_s"] if ref_t and s["time_to_target_s"] else None
        per_seed = [a / b if a and b else None for a, b in zip(ref_times, times)]
        s["speedup_worst_seed"] = min(x for x in per_seed if x is not None) if None not in per_seed else None
        s["rounds_shorter"] = ref_round / s["round_s_measured"]
        if row == "window auto":
            s["windows_chosen"] = dict(sorted(collections.Counter(
                str(a.get("window", 1)) for r in rs for m in r["real"][1:] for a in m["agents"].values()).items()))
        table.append([row, 100 * s["final_mean"], 100 * s["final_worst"], 100 * s["at_lockstep_rounds_mean"],
                      s["time_to_target_s"] or "-",
                      s["speedup_to_target"] or "-", s["speedup_worst_seed"] or "-", s["round_s_measured"],
                      s["rounds_shorter"],
                      s["round_s_simulated"], 100 * s["sim_error_median"]])
    common.print_table("Steps in flight over shaped links (real broker and processes; wall clock)",
                       ["row", "% at lock-step's time (mean)", "(worst)", "% at lock-step's rounds", "s to target",
                        "x sooner", "x sooner (worst seed)",
                        "round s (measured)",
                        "x shorter rounds", "round s (simulated)", "sim error % (median)"], table,
                       caption=f"target: 90 % of window 1's mean final accuracy; the links allow rounds at most "
                               f"{min(bounds):.2f}-{max(bounds):.2f}x shorter (the time model, compute free); "
                               f"window 1 calibrates the simulation (its error is a fit's, the others' predictions); "
                               f"both ways at once the links moved {100 * min(duplex):.0f}-{100 * max(duplex):.0f} % "
                               f"less each way than one way at a time (the profiles' bidir rates); "
                               f"links per agent: {LINKS[:n]}")
    name = "pipeline-shaped" + ("" if args.links == "boards" else f"-{args.links}") + ("-quick" if args.quick else "")
    path = common.write_result(args.out, name,
                               {"config": common.config_record(args), "links_set": args.links, "links": LINKS[:n],
                                "goodput": GOODPUT, "duplex_loss": duplex, "links_bound": bounds, "summary": summary, "netem": NETEM,
                                "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
