"""The built wheel, installed into a fresh virtual environment, works away from the checkout.

What a user of ``pip install sfl_edge-*.whl`` relies on: the device profiles and run configs
ship inside the package (``sfl_profiles``), so ``sfl-coord profiles`` lists them, an agent
finds ``jetson-nano`` by name and the packaged demo config runs, all from a directory that
has nothing to do with this repository; ``SFL_PROFILES_DIR`` still points at your own folder.

No network: the wheel is built with this interpreter's setuptools (``--no-build-isolation``)
from a copy of the checkout, installed with ``--no-deps --no-index``, and the fresh venv sees
the dependencies (torch, ...) through a ``.pth`` file naming this interpreter's site-packages.
Lines of a ``.pth`` file only extend ``sys.path``; the ``.pth`` files in the directories they
name (this checkout's editable-install hook) are not run, so the checkout stays invisible,
which the tests check.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow,
              pytest.mark.skipif(sys.platform == "win32", reason="the venv layout used here is POSIX (bin/)")]

REPO = Path(__file__).resolve().parent.parent
# never copied into the build tree: outputs, caches, and the checkout's own venv
_SKIP_TOP = {".git", ".venv", "build", "dist", "runs", ".pytest_cache", ".hypothesis", ".whl"}


def _ignore(directory: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    if Path(directory) == REPO:
        skip |= _SKIP_TOP & set(names)
    return skip


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "SFL_PROFILES_DIR", "VIRTUAL_ENV")}
    env.update(PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", OMP_NUM_THREADS="1")
    return env


class Installed:
    def __init__(self, root: Path, wheel: Path, venv: Path, work: Path):
        self.root, self.wheel, self.venv, self.work = root, wheel, venv, work
        self.python = venv / "bin" / "python"
        self.site = Path(self.py("import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())

    def run(self, *cmd: str | Path, env: dict[str, str] | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess:
        p = subprocess.run([str(c) for c in cmd], cwd=self.work, env=env or _clean_env(), capture_output=True,
                           text=True, timeout=timeout)
        if check:
            assert p.returncode == 0, f"{cmd} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p

    def py(self, code: str, **kw) -> subprocess.CompletedProcess:
        return self.run(self.python, "-c", code, **kw)

    def bin(self, name: str) -> Path:
        return self.venv / "bin" / name


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("the offline build reuses this interpreter's pip and setuptools")
    root = tmp_path_factory.mktemp("packaging")
    # 1. the wheel, built from a copy (an in-tree build would share ./build with other runs)
    src = root / "src"
    shutil.copytree(REPO, src, ignore=_ignore)
    dist = root / "dist"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-w", str(dist), str(src)], capture_output=True, text=True, timeout=180, env=_clean_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (wheel,) = dist.glob("sfl_edge-*.whl")

    # 2. a fresh venv with only the wheel installed; dependencies through a .pth line
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                        "--no-deps", "--no-index", "--no-compile", str(wheel)],
                       capture_output=True, text=True, timeout=180, env=_clean_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    work = root / "work"   # the working directory of every command: not the repository
    work.mkdir()
    inst = Installed(root, wheel, venv, work)
    dep_dirs = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"],
                              sysconfig.get_paths()["platlib"], *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])])
    (inst.site / "_sfl_test_deps.pth").write_text("".join(f"{d}\n" for d in dep_dirs if Path(d).is_dir()))
    return inst


def test_profiles_dir_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """$SFL_PROFILES_DIR, else a source checkout's profiles/, else the installed sfl_profiles package."""
    from sfl_core.config import profiles as config
    monkeypatch.delenv("SFL_PROFILES_DIR", raising=False)
    assert (config.default_profiles_dir(), config.profiles_origin()) == (REPO / "profiles", "source checkout")
    # as installed from a wheel: no checkout around sfl_core, the package beside it
    monkeypatch.setattr(config, "_CHECKOUT_PROFILES", tmp_path / "site-packages" / "profiles")
    monkeypatch.delitem(sys.modules, "sfl_profiles", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site-packages"), *sys.path])
    packaged = tmp_path / "site-packages" / "sfl_profiles"
    (packaged / "devices").mkdir(parents=True)
    (packaged / "__init__.py").write_text("")
    (packaged / "devices" / "board.yaml").write_text("name: board\ncompute_flops: 1e9\nlink_bytes_per_s: 1e6\n")
    importlib.invalidate_caches()
    assert (config.default_profiles_dir(), config.profiles_origin()) == (packaged, "installed package sfl_profiles")
    assert config.list_profiles() == ["board"] and config.load_profile("board").compute_flops == 1e9
    monkeypatch.setenv("SFL_PROFILES_DIR", str(tmp_path / "mine"))
    assert (config.default_profiles_dir(), config.profiles_origin()) == (tmp_path / "mine", "SFL_PROFILES_DIR")


def test_wheel_ships_every_profile_and_run_config(installed: Installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    shipped = {f"sfl_profiles/{p.relative_to(REPO / 'profiles').as_posix()}"
               for p in (REPO / "profiles").rglob("*.y*ml")}
    assert {"sfl_profiles/devices/jetson-nano.yaml", "sfl_profiles/runs/demo.yaml"} <= shipped
    assert shipped <= names, sorted(shipped - names)


def test_fresh_venv_uses_its_own_copy(installed: Installed):
    p = installed.py("import sfl_core, coordinator, edge_agent, sfl_profiles, importlib.metadata as m\n"
                     "for mod in (sfl_core, coordinator, edge_agent, sfl_profiles): print(mod.__file__)\n"
                     "print(m.distribution('sfl-edge').locate_file(''))")
    for line in p.stdout.split():
        assert Path(line).resolve().is_relative_to(installed.site.resolve()), p.stdout   # never this checkout


def test_version_flags(installed: Installed):
    from sfl_core.version import package_version

    assert package_version() != "unknown"
    assert installed.run(installed.bin("sfl-coord"), "--version").stdout.strip() == f"sfl-coord {package_version()}"
    assert installed.run(installed.bin("sfl-agent"), "--version").stdout.strip() == f"sfl-agent {package_version()}"


def test_profiles_come_from_the_package(installed: Installed):
    p = installed.run(installed.bin("sfl-coord"), "profiles", env={**_clean_env(), "COLUMNS": "200"})
    out = p.stdout + p.stderr
    assert "installed package sfl_profiles" in out and str(installed.site / "sfl_profiles") in out
    assert "jetson-nano" in out and "rpi4" in out and "demo.yaml" in out
    # what `sfl-agent start --profile jetson-nano` does with the name
    p = installed.py("from sfl_core.config.run import load_profile; print(load_profile('jetson-nano').compute_flops)")
    assert float(p.stdout) > 0


def test_packaged_demo_by_name_resume_auto_metrics_and_page(installed: Installed):
    """`simulate -c demo` (the shipped run config by name, from any directory), `--resume auto`
    (what the shipped unit runs), then the metrics endpoint, the live page and the Grafana
    dashboard from the installed package."""
    installed.run(installed.bin("sfl-coord"), "simulate", "-c", "demo", "--rounds", "1", "--quiet", timeout=180)
    from coordinator.state import METRICS_FILE

    metrics = installed.work / "runs" / "demo" / METRICS_FILE   # output_dir null: relative to the cwd
    rounds = [json.loads(line)["round"] for line in metrics.read_text().splitlines()]
    assert rounds[-1] == 1, rounds   # (round 0: the initial model's evaluation)
    # what the shipped unit runs after a crash: --resume auto continues from the checkpoint
    installed.run(installed.bin("sfl-coord"), "simulate", "-c", "demo", "--rounds", "2", "--resume", "auto",
                  "--quiet", timeout=180)
    rounds = [json.loads(line)["round"] for line in metrics.read_text().splitlines()]
    assert rounds == [0, 1, 2], rounds
    p = installed.py("import types, urllib.request\n"
                     "from coordinator.web import start_metrics\n"
                     "m = start_metrics('127.0.0.1:0', types.SimpleNamespace(run_id='demo', rounds=2))\n"
                     "print(urllib.request.urlopen(f'http://127.0.0.1:{m.port}/metrics').read().decode().count('sfl_'))\n"
                     "m.finish(True)")
    assert int(p.stdout.strip()) > 10, p.stdout
    p = installed.py("import json, pathlib, urllib.request, coordinator\n"
                     "from coordinator.web import start_dashboard\n"
                     "page = start_dashboard('127.0.0.1:0', pathlib.Path('runs/demo'))\n"
                     "html = urllib.request.urlopen(f'http://127.0.0.1:{page.port}/').read().decode()\n"
                     "st = json.loads(urllib.request.urlopen(f'http://127.0.0.1:{page.port}/api/state').read())\n"
                     "page.finish(True)\n"
                     "grafana = pathlib.Path(coordinator.__file__).parent / 'static' / 'grafana-dashboard.json'\n"
                     "print('<title>sfl-edge: fleet</title>' in html, len(st['fleet']), st['status'],\n"
                     "      len(json.loads(grafana.read_text())['panels']) > 0)")
    assert p.stdout.split()[:2] == ["True", "4"] and p.stdout.split()[-1] == "True", p.stdout


def test_packaged_fleet_on_its_own_folders_with_a_users_model(installed: Installed):
    """The own-data path from the wheel, from another directory: check-data, simulate on the
    devices' folders with a model file next to the run file, export, predict photos."""
    import yaml
    from helpers import MODEL_FILE, NAMES, write_fleet

    work = installed.work / "own"
    write_fleet(work)
    (work / "my_models.py").write_text(MODEL_FILE)
    (work / "run.yaml").write_text(yaml.safe_dump({
        "run": "own", "model": "my_models.py:build_net", "strategy": "auto", "rounds": 2, "local_iters": 10,
        "task": {"classes": NAMES, "input_shape": [1, 8, 8]}, "eval": {"data": "server", "federated_every": 1},
        "fleet": [{"profile": "rpi4", "data": "pi-1"}, {"profile": "jetson-nano", "data": "pi-3"}],
        "output_dir": str(work / "out")}))
    p = installed.run(installed.bin("sfl-agent"), "check-data", "--data", work / "pi-3", "--run-config",
                      work / "run.yaml", "--model-file", work / "my_models.py")
    assert "fits the run (model build_net" in p.stdout + p.stderr
    installed.run(installed.bin("sfl-coord"), "simulate", "-c", work / "run.yaml", "--quiet", timeout=180)
    last = json.loads((work / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["round"] == 2 and last["federated"]["count"] == 80
    installed.run(installed.bin("sfl-coord"), "export", work / "out", "--onnx", work / "m.onnx")
    p = installed.run(installed.bin("sfl-agent"), "predict", work / "m.onnx", work / "server" / "val", "--raw")
    assert f"accuracy: {last['accuracy']:.4f} (" in p.stdout + p.stderr, p.stdout + p.stderr


def test_profiles_dir_override_still_wins(installed: Installed, tmp_path: Path):
    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "my-board.yaml").write_text("name: my-board\ncompute_flops: 1e9\nlink_bytes_per_s: 1e6\n")
    p = installed.run(installed.bin("sfl-coord"), "profiles",
                      env={**_clean_env(), "SFL_PROFILES_DIR": str(tmp_path), "COLUMNS": "200"})
    out = p.stdout + p.stderr
    assert "SFL_PROFILES_DIR" in out and "my-board" in out and "jetson-nano" not in out


def test_an_agent_installs_lean(installed: Installed):
    """`pip install sfl-edge` on a board pulls only what an agent uses, from Python 3.8 on: the
    coordinator's packages (embedded broker, ONNX, metrics, the demo's scikit-learn) are extras."""
    meta = zipfile.ZipFile(installed.wheel).read(
        next(n for n in zipfile.ZipFile(installed.wheel).namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Python: >=3.8" in meta
    base = [line.split(":", 1)[1].strip() for line in meta.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]
    names = {re.split(r"[<>=!;\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in base}
    assert names == {"torch", "paho-mqtt", "msgpack", "zstandard", "typer", "rich", "numpy", "pyyaml", "pydantic",
                     "typing-extensions", "eval-type-backport", "cryptography", "pillow"}, names
    assert any(d.startswith("torch") and ">=2.0" in d for d in base)
    coordinator = {re.split(r"[<>=!;\[ ]", line.split(":", 1)[1].strip(), maxsplit=1)[0].lower()
                   for line in meta.splitlines() if line.startswith("Requires-Dist:") and "extra == \"coordinator\"" in line}
    assert {"onnx", "onnxruntime", "amqtt", "prometheus-client", "scikit-learn"} <= coordinator
