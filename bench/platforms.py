"""The agent on the boards' platforms: emulated arm64 (Debian's own Python) and an older host Python.

A user's question: "will `sfl-agent` install and train on my Jetson Xavier (JetPack 5: arm64,
Python 3.8, torch 2.0/2.1) or my Raspberry Pi?" Claims are cheap, so this script runs it:

``arm64``
    A Debian arm64 root file system (``debootstrap --foreign`` from Debian's archive, its
    packages unpacked without running anything) holds Debian's own aarch64 Python. The wheel
    of this checkout and its dependencies are installed by Debian's own pip, emulated, so that
    pip evaluates the dependencies' environment markers for that Python (a host pip with
    ``--platform``/``--python-version`` checks only wheel tags and Requires-Python, and drops
    dependencies such as ``eval_type_backport; python_version < "3.10"``); torch is pinned to
    ``--torch`` (default 2.0.1, the agents' floor). ``qemu-aarch64-static -L ROOTFS`` runs the
    interpreter without ``binfmt_misc``. Then an emulated ``sfl-agent start`` joins a
    coordinator on the host over loopback (Mosquitto on a free port) and trains ``--rounds``
    rounds of the demo model; the same run with a host (x86) agent is the reference, same
    seed: the accuracy per round must agree within ``--tolerance``. Finally the agent's test
    subset runs under emulation. Debian 11 ("bullseye", the default suite) ships Python 3.9,
    so one root file system covers "arm64" and "an older Python" at once.
``host``
    The same comparison and test subset with another interpreter of the host (``--python``,
    e.g. ``/usr/bin/python3.8``) in a fresh virtual environment with torch ``--torch``.

Emulated times are no measure of a board's speed (qemu translates every instruction): the
per-step time is recorded only to show the run was real. Results accumulate in
``bench/results/platforms.json`` (one entry per platform).

    python bench/platforms.py arm64                       # needs debootstrap and qemu-user-static
    python bench/platforms.py host --python python3.8     # e.g. pyenv's 3.8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (bench helper; also puts the repo root on sys.path)
import yaml  # noqa: E402
from brokers import MosquittoBroker, find_mosquitto  # noqa: E402

REPO = common.REPO_ROOT
AGENT_TESTS = ["tests/test_wire.py", "tests/test_protocol.py", "tests/test_agent_config.py", "tests/test_local_data.py",
               "tests/test_timing.py", "tests/test_bottleneck.py", "tests/test_partition.py", "tests/test_losses.py",
               "tests/test_aggregation.py", "tests/test_config.py", "tests/test_models.py", "tests/test_accounting.py",
               "tests/test_data.py", "tests/test_agent_core.py"]
"""What the agent runs (wire, protocol, settings, data, models, costs, training); none starts a process."""
EMULATED_TESTS = [t for t in AGENT_TESTS[:9] if t != "tests/test_bottleneck.py"] + ["--deselect",
                                    "tests/test_agent_config.py::test_file_is_read_before_the_broker_is_contacted"]
"""Under emulation the subset without model-zoo sweeps (each of those builds, trains or profiles
every model of the zoo: an hour under qemu), and without the one test that starts
``sys.executable`` itself: without binfmt_misc the kernel cannot run an aarch64 binary that is
not started through qemu."""
PIP_ISOLATED = {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": None, "PIP_CONSTRAINT": None}
"""Resolve against the index alone: local mirrors and constraints may lack Requires-Python
data, and pip would then pick releases that no longer support the target's Python."""


def _env(changes: dict[str, str | None] | None) -> dict[str, str]:
    """This process's environment with ``changes`` (None: removed)."""
    env = dict(os.environ)
    for key, value in (changes or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def sh(cmd: list[str], *, env: dict[str, str | None] | None = None, cwd: Path | None = None, timeout: float = 3600,
       log: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd``; its output goes to ``log`` (or is captured); a failure stops the script with it."""
    print("+", " ".join(str(c) for c in cmd), flush=True)
    out = open(log, "w") if log else subprocess.PIPE
    p = subprocess.run([str(c) for c in cmd], env=_env(env), cwd=cwd, timeout=timeout,
                       stdout=out, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        tail = log.read_text()[-3000:] if log else (p.stdout or "")[-3000:]
        raise SystemExit(f"{cmd[0]} exited {p.returncode}:\n{tail}")
    return p


def build_wheel(work: Path) -> Path:
    dist = work / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, REPO])
    return next(dist.glob("sfl_edge-*.whl"))


# ------------------------------------------------------------------ arm64 root file system

def rootfs(work: Path, suite: str, mirror: str) -> Path:
    """Debian ``suite`` for arm64 under ``work``, unpacked (``debootstrap --foreign``, then every
    downloaded package extracted): no maintainer script runs, none is needed to run Python."""
    root = work / f"{suite}-arm64"
    if (root / "usr" / "lib" / "python3" / "dist-packages" / "pip").exists():
        return root
    if shutil.which("debootstrap") is None:
        raise SystemExit("debootstrap not found: apt-get install debootstrap qemu-user-static")
    shutil.rmtree(root, ignore_errors=True)
    sh(["debootstrap", "--arch=arm64", "--foreign", "--variant=minbase",
        "--include=python3,python3-distutils,python3-pip,ca-certificates,libgomp1", suite, root, mirror],
       log=work / "debootstrap.log")
    for deb in sorted((root / "var" / "cache" / "apt" / "archives").glob("*.deb")):
        sh(["dpkg-deb", "-x", deb, root])
    return root


def emulated_python(root: Path) -> list[str]:
    qemu = shutil.which("qemu-aarch64-static")
    if qemu is None:
        raise SystemExit("qemu-aarch64-static not found: apt-get install qemu-user-static")
    return [qemu, "-L", str(root), str(root / "usr" / "bin" / "python3")]


def install_for_target(python: list[str], site: Path, wheel: Path, torch_version: str, index: str) -> None:
    """The wheel, its dependencies, the demo's extra and the test tools into ``site``, resolved by
    the target's own pip (what ``pip install sfl-edge`` on the board resolves), wheels only. A
    site that has them already from an earlier run gets only the new wheel (emulated pip is slow)."""
    wanted = f"{wheel.name} torch=={torch_version}"
    stamp = site / ".sfl-platforms"
    pip = [*python, "-m", "pip", "install", "-q", "--no-cache-dir", "--index-url", index, "--only-binary=:all:",
           "--target", site]
    if stamp.exists() and stamp.read_text().split()[1:] == wanted.split()[1:]:
        sh([*pip, "--no-deps", "--upgrade", wheel], env=PIP_ISOLATED, timeout=7200)
    else:
        shutil.rmtree(site, ignore_errors=True)
        sh([*pip, f"{wheel}[demo]", f"torch=={torch_version}", "numpy<2", "pytest>=7", "pytest-timeout>=2",
            "hypothesis>=6"], env=PIP_ISOLATED, timeout=7200)
    stamp.write_text(wanted)


# ------------------------------------------------------------------ host interpreter

def host_env(work: Path, python: str, wheel: Path, torch_version: str, index: str, in_place: bool) -> list[str]:
    """``python`` in a fresh virtual environment (or its own, ``in_place``) with torch
    ``torch_version``, this wheel (demo extra) and the test tools."""
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    if in_place:
        interpreter = python
    else:
        venv = work / f"venv-py{version}"
        if not (venv / "bin" / "python").exists():
            sh([python, "-m", "venv", venv])
        interpreter = str(venv / "bin" / "python")
    pip = [interpreter, "-m", "pip", "install", "-q", "--index-url", index]
    sh([*pip, f"torch=={torch_version}", "numpy<2"], env=PIP_ISOLATED)
    sh([*pip, "--force-reinstall", "--no-deps", wheel], env=PIP_ISOLATED)
    sh([*pip, f"{wheel}[demo]", "pytest>=7", "pytest-timeout>=2", "hypothesis>=6"], env=PIP_ISOLATED)
    return [interpreter]


# ------------------------------------------------------------------ the run, and its reference

def write_config(path: Path, out: Path, rounds: int, seed: int) -> Path:
    """The demo's model and data with one agent: what that agent computes decides every figure."""
    path.write_text(yaml.safe_dump({
        "run": "platform", "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid", "seed": 0},
        "fleet": [{"profile": "rpi4", "count": 1}], "rounds": rounds, "strategy": "sfl",
        "server_mode": "merged", "batch_size": 16, "lr": 0.05, "momentum": 0.5, "local_iters": 10, "seed": seed,
        "step_timeout_s": 600, "register_timeout_s": 900, "output_dir": str(out)}))
    return path


def one_run(name: str, agent_python: list[str], env: dict[str, str], work: Path, rounds: int, seed: int,
            broker: MosquittoBroker) -> dict[str, Any]:
    """A coordinator on this host and one agent started with ``agent_python``: per-round accuracy,
    training loss and the agent's compute seconds per step."""
    out = work / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = write_config(out / "run.yaml", out / "out", rounds, seed)
    coord = subprocess.Popen([sys.executable, "-m", "cli.coord", "serve", "--config", str(config), "--broker",
                              broker.url, "--quiet", "--verbose"], cwd=REPO,
                             stdout=open(out / "coord.log", "w"), stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    try:
        agent = subprocess.run([*agent_python, "-m", "cli.agent", "start", "--profile", "rpi4", "--broker",
                                broker.url, "--run", "platform", "--index", "0", "--agent-id", name, "--verbose",
                                "--coordinator-key", common.coordinator_key(out)],
                               cwd=work, env={**os.environ, **env}, stdout=open(out / "agent.log", "w"),
                               stderr=subprocess.STDOUT, timeout=3600)
        code = coord.wait(timeout=120)
    finally:
        if coord.poll() is None:
            coord.kill()
            coord.wait()
    if agent.returncode != 0 or code != 0:
        raise SystemExit(f"{name}: agent exited {agent.returncode}, coordinator {code}; see {out}")
    history = [json.loads(line) for line in (out / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [a["compute_s"] / 10 for r in history[1:] for a in r["agents"].values()]
    return {"accuracy": [r["accuracy"] for r in history], "train_loss": [r["train_loss"] for r in history],
            "compute_s_per_step": round(sum(steps) / len(steps), 4), "wall_s": round(time.monotonic() - t0, 1)}


def detected_profile(python: list[str], env: dict[str, str], work: Path, broker: MosquittoBroker) -> dict[str, Any]:
    """``sfl-agent profile --detect`` on the platform: the profile it writes, as read back."""
    out = work / "detected.yaml"
    subprocess.run([*python, "-m", "cli.agent", "profile", "--detect", "--model", "small_cnn", "--input-shape",
                    "1,8,8", "--broker", broker.url, "--output", str(out)], cwd=work, env={**os.environ, **env},
                   capture_output=True, text=True, timeout=1800, check=True)
    from sfl_core.config.run import load_profile
    return load_profile(str(out)).to_dict()


def agent_facts(python: list[str], env: dict[str, str], work: Path) -> dict[str, str]:
    code = ("import json, platform, sys, torch, numpy, pydantic, typer; print(json.dumps({'python': platform.python_version(),"
            " 'machine': platform.machine(), 'torch': torch.__version__, 'numpy': numpy.__version__,"
            " 'pydantic': pydantic.VERSION, 'typer': typer.__version__}))")
    p = subprocess.run([*python, "-c", code], cwd=work, env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=1800, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_tests(python: list[str], env: dict[str, str], tests: list[str], work: Path) -> dict[str, Any]:
    log = work / "tests.log"
    t0 = time.monotonic()
    p = subprocess.run([*python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                        "-o", "timeout=3600", *tests], cwd=REPO, env={**os.environ, **env}, stdout=open(log, "w"),
                       stderr=subprocess.STDOUT, timeout=7200)
    summary = [line for line in log.read_text().splitlines() if " passed" in line or " failed" in line]
    return {"arguments": tests, "exit_code": p.returncode, "summary": summary[-1] if summary else "no summary",
            "wall_s": round(time.monotonic() - t0, 1)}


def site_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", choices=["arm64", "host"])
    ap.add_argument("--python", help="host: the interpreter to test (e.g. python3.8)")
    ap.add_argument("--suite", default="bullseye", help="arm64: the Debian suite (bullseye: Python 3.9)")
    ap.add_argument("--mirror", default="http://deb.debian.org/debian")
    ap.add_argument("--torch", default="2.0.1", help="the torch release the agent gets (the agents' floor: 2.0)")
    ap.add_argument("--index", default="https://pypi.org/simple")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.02,
                    help="largest accepted difference of accuracy per round from the host agent's")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "sfl-platforms")
    ap.add_argument("--no-tests", action="store_true", help="skip the agent test subset")
    ap.add_argument("--in-place", action="store_true",
                    help="host: install into --python's own environment instead of a fresh one")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = ap.parse_args()
    if find_mosquitto() is None:
        raise SystemExit("mosquitto not found: apt-get install mosquitto")
    args.work.mkdir(parents=True, exist_ok=True)
    wheel = build_wheel(args.work)
    if args.target == "arm64":
        root = rootfs(args.work, args.suite, args.mirror)
        python = emulated_python(root)
        version = subprocess.run([*python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        site = args.work / f"site-{args.suite}-py{version}-aarch64"
        install_for_target(python, site, wheel, args.torch, args.index)
        env = {"PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
        label, tests, installed = f"arm64 (qemu), Debian {args.suite}", EMULATED_TESTS, site_size(site)
    else:
        if not args.python:
            raise SystemExit("host needs --python PATH")
        python = host_env(args.work, args.python, wheel, args.torch, args.index, args.in_place)
        env = {"PYTHONPATH": ""}
        label, tests, installed = f"x86_64, {args.python}", AGENT_TESTS, None
    facts = agent_facts(python, env, args.work)
    with MosquittoBroker() as broker:
        platform_run = one_run("platform", python, env, args.work, args.rounds, args.seed, broker)
        reference = one_run("reference", [sys.executable], {}, args.work, args.rounds, args.seed, broker)
        profile = detected_profile(python, env, args.work, broker)
    diff = max(abs(a - b) for a, b in zip(platform_run["accuracy"], reference["accuracy"]))
    tests_result = None if args.no_tests else run_tests(python, env, tests, args.work)
    entry = {"platform": label, "agent": facts, "wheel": wheel.name, "installed_bytes": installed,
             "run": platform_run, "reference": {**reference, "python": sys.version.split()[0],
                                                "torch": common.torch.__version__},
             "max_accuracy_difference": diff, "tolerance": args.tolerance, "same_accuracy": diff <= args.tolerance,
             "tests": tests_result, "detected_profile": profile,
             "note": "emulated: per-step times measure qemu, not a board" if args.target == "arm64" else ""}
    path = args.out / "platforms.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    platforms = {**previous.get("platforms", {}), f"{facts['machine']}-py{facts['python']}-torch{facts['torch']}": entry}
    common.write_result(args.out, "platforms", {"platforms": platforms})
    common.print_table("The agent on other platforms", ["platform", "python", "torch", "accuracy per round",
                                                        "host agent's", "max diff", "s/step", "tests"],
                       [[e["platform"], e["agent"]["python"], e["agent"]["torch"],
                         " ".join(f"{a:.4f}" for a in e["run"]["accuracy"]),
                         " ".join(f"{a:.4f}" for a in e["reference"]["accuracy"]), e["max_accuracy_difference"],
                         e["run"]["compute_s_per_step"], (e["tests"] or {}).get("summary", "-")]
                        for e in platforms.values()])
    if not entry["same_accuracy"] or (tests_result and tests_result["exit_code"] != 0):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
