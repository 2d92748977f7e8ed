"""install/agent.sh and install/coordinator.sh, run for real into a temporary prefix.

No root and no network: ``--offline --system-site-packages --python <this interpreter>``
builds a fresh virtual environment that reuses the packages this test runs with, and
installs the package from this checkout into it. What is checked is what an operator
relies on: the installed commands work, the config and unit are where the unit says,
the unit is valid for systemd, and a second run changes nothing the operator edited.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("bash") is None,
                                 reason="the install scripts are for Linux (bash)"),
              # --offline builds the package with this interpreter's pip and setuptools
              pytest.mark.skipif(importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None,
                                 reason="the offline install reuses this interpreter's pip and setuptools")]

REPO = Path(__file__).resolve().parent.parent
FAST = ["--python", sys.executable, "--system-site-packages", "--offline"]


def run_script(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["bash", str(REPO / "install" / name), *args], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PIP_NO_INPUT": "1"})
    if check:
        assert p.returncode == 0, f"{name} {' '.join(args)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def verify_unit(unit: Path) -> None:
    """`systemd-analyze verify` accepts the unit (checked where systemd-analyze exists)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return
    p = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    ours = [ln for ln in (p.stdout + p.stderr).splitlines() if unit.name in ln]
    assert p.returncode == 0 and not ours, p.stdout + p.stderr


def snapshot(prefix: Path, *rel: str) -> dict[str, bytes]:
    return {r: (prefix / r).read_bytes() for r in rel}


def test_usage_and_argument_errors():
    for script in ("agent.sh", "coordinator.sh"):
        p = run_script(script, "--help")
        assert "--prefix DIR" in p.stdout and "--offline" in p.stdout and "--system-site-packages" in p.stdout
        p = run_script(script, "--bogus", check=False)
        assert p.returncode == 2 and "unknown argument: --bogus" in p.stderr
        p = run_script(script, "--prefix", check=False)
        assert p.returncode == 2 and "--prefix needs a value" in p.stderr
        p = run_script(script, "--systemd", "maybe", check=False)
        assert p.returncode == 2 and "--systemd must be auto, yes or no" in p.stderr
    p = run_script("agent.sh", "--torch-wheel", "/nonexistent/torch.whl", check=False)
    assert p.returncode == 1 and "torch wheel not found" in p.stderr
    p = run_script("coordinator.sh", "--cuda", "cuda12", check=False)
    assert p.returncode == 2 and "--cuda must be" in p.stderr


def test_agent_install_is_complete_and_idempotent(tmp_path: Path):
    prefix = tmp_path / "sfl"
    p = run_script("agent.sh", "--prefix", str(prefix), *FAST, "--set", "profile=rpi4", "--set", "index=3",
                   "--set", "broker=mqtt://broker.local:1883")
    assert "not installed into systemd" in p.stdout   # --prefix given: nothing outside it, even as root
    agent = prefix / "venv" / "bin" / "sfl-agent"
    config = prefix / "etc" / "agent.yaml"
    unit = prefix / "lib" / "systemd" / "system" / "sfl-agent.service"
    assert config.is_file() and unit.is_file()

    # the venv's own command, from the package installed into it (not this checkout)
    p = subprocess.run([str(agent), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "start" in p.stdout
    p = subprocess.run([str(prefix / "venv" / "bin" / "python"), "-c", "import edge_agent; print(edge_agent.__file__)"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.stdout.strip().startswith(str(prefix / "venv")), p.stdout + p.stderr

    # the config: the documented example with the --set keys filled in
    text = config.read_text()
    assert "\nprofile: rpi4\n" in text and "\nindex: 3\n" in text and "\nbroker: mqtt://broker.local:1883\n" in text
    assert "#run: demo" in text
    assert oct(config.stat().st_mode & 0o777) == "0o640"   # may hold broker credentials

    # the unit: restarts on failure, runs this prefix's binary with this prefix's config
    u = unit.read_text()
    assert f"ExecStart={agent} start --config {config}\n" in u
    assert "Restart=on-failure" in u and "NoNewPrivileges=true" in u and "ProtectSystem=strict" in u
    assert f"Environment=SFL_PROFILES_DIR={prefix}/share/sfl-edge/profiles" in u
    assert (prefix / "share" / "sfl-edge" / "profiles" / "devices" / "rpi4.yaml").is_file()
    verify_unit(unit)

    # the installed agent reads its installed config (--help exits before connecting)
    p = subprocess.run([str(agent), "start", "--config", str(config), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr

    # operator edits the config; a second run keeps it byte for byte and rewrites nothing else
    config.write_text(text.replace("index: 3", "index: 4") + "# edited by the operator\n")
    before = snapshot(prefix, "etc/agent.yaml", "lib/systemd/system/sfl-agent.service")
    p = run_script("agent.sh", "--prefix", str(prefix), *FAST, "--set", "profile=jetson-nano")
    assert snapshot(prefix, "etc/agent.yaml", "lib/systemd/system/sfl-agent.service") == before
    assert "kept the existing" in p.stdout and "--set ignored" in p.stderr
    assert "reusing the virtual environment" in p.stdout
    assert "Successfully installed sfl-edge" in p.stdout   # the package itself is re-installed


def test_agent_install_refuses_bad_settings(tmp_path: Path):
    prefix = tmp_path / "sfl"
    p = run_script("agent.sh", "--prefix", str(prefix), *FAST, "--skip-torch", "--set", "indx=3", check=False)
    assert p.returncode == 1
    assert "field 'indx': unknown key; did you mean 'index'?" in p.stderr
    assert not (prefix / "etc" / "agent.yaml").exists()


def test_coordinator_install_is_complete_and_idempotent(tmp_path: Path):
    prefix = tmp_path / "sfl"
    run_script("coordinator.sh", "--prefix", str(prefix), *FAST, "--skip-torch")
    coord = prefix / "venv" / "bin" / "sfl-coord"
    run_yaml = prefix / "etc" / "run.yaml"
    env_file = prefix / "etc" / "coord.env"
    unit = prefix / "lib" / "systemd" / "system" / "sfl-coord.service"
    assert run_yaml.read_text() == (REPO / "profiles" / "runs" / "demo.yaml").read_text()
    assert "SFL_COORD_ARGS=--listen 127.0.0.1:1883 --quiet\n" in env_file.read_text()

    p = subprocess.run([str(coord), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "serve" in p.stdout

    u = unit.read_text()
    assert f"ExecStart={coord} serve --config {run_yaml} --resume auto $SFL_COORD_ARGS\n" in u
    assert f"EnvironmentFile={env_file}\n" in u
    assert "Restart=on-failure" in u and "NoNewPrivileges=true" in u
    verify_unit(unit)

    run_yaml.write_text(run_yaml.read_text() + "# operator's note\n")
    env_file.write_text("SFL_COORD_ARGS=--broker mqtt://localhost:1883\n")
    files = ("etc/run.yaml", "etc/coord.env", "lib/systemd/system/sfl-coord.service")
    before = snapshot(prefix, *files)
    p = run_script("coordinator.sh", "--prefix", str(prefix), *FAST, "--skip-torch")
    assert snapshot(prefix, *files) == before
    assert "Successfully installed sfl-edge" in p.stdout
