"""install/agent.sh --detect: which board, JetPack, Python and torch, from fake release files.

A Jetson names its L4T release in /etc/nv_tegra_release and a Raspberry Pi its model in
/proc/device-tree/model; the script reads the paths in SFL_NV_TEGRA_RELEASE and
SFL_DEVICE_MODEL instead when set, and SFL_MACHINE instead of ``uname -m``. ``--detect``
changes nothing: it says what it found and which torch the agent would get, or refuses with
exit 2 (a configuration error) and the exact way out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("bash") is None,
                                reason="the install scripts are for Linux (bash)")

REPO = Path(__file__).resolve().parent.parent
RELEASES = {   # first lines of /etc/nv_tegra_release as the boards write them
    "jp4": "# R32 (release), REVISION: 7.4, GCID: 33514132, BOARD: t210ref, EABI: aarch64, DATE: Fri Jun  9 04:25:08 UTC 2023",
    "jp512": "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: Tue Aug  1 19:57:35 UTC 2023",
    "jp511": "# R35 (release), REVISION: 3.1, GCID: 32827747, BOARD: t186ref, EABI: aarch64, DATE: Sun Mar 19 15:19:21 UTC 2023",
    "jp60": "# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64, DATE: Mon May  6 17:34:21 UTC 2024",
    "garbled": "not a release line",
}


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """An interpreter that cannot import torch (a Jetson image without NVIDIA's build)."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    assert subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"], capture_output=True).returncode != 0
    return str(venv / "bin" / "python")


def detect(tmp_path: Path, *args: str, release: str | None = None, model: str | None = None,
           machine: str = "aarch64", cuda: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "SFL_NV_TEGRA_RELEASE": str(tmp_path / "absent"), "SFL_DEVICE_MODEL": str(tmp_path / "absent"),
           "SFL_MACHINE": machine, "SFL_CUDA_HOME": str(tmp_path / "cuda")}
    if release is not None:
        (tmp_path / "nv_tegra_release").write_text(RELEASES[release] + "\n")
        env["SFL_NV_TEGRA_RELEASE"] = str(tmp_path / "nv_tegra_release")
    if model is not None:
        (tmp_path / "model").write_bytes(model.encode() + b"\0")
        env["SFL_DEVICE_MODEL"] = str(tmp_path / "model")
    if cuda is not None:
        (tmp_path / "cuda").mkdir()
        (tmp_path / "cuda" / "version.json").write_text('{\n "cuda" : {\n  "name" : "CUDA SDK",\n  "version" : "%s"\n }\n}\n'
                                                       % cuda)
    return subprocess.run(["bash", str(REPO / "install" / "agent.sh"), "--detect", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_an_x86_machine_gets_torch_from_pypi(tmp_path):
    p = detect(tmp_path, "--python", sys.executable, machine="x86_64")
    assert p.returncode == 0, p.stderr
    assert "a x86_64 machine (no Jetson or Raspberry Pi found)" in p.stdout
    assert 'torch: pip install "torch>=2.0,<3" from PyPI' in p.stdout


def test_jetpack_5_uses_the_system_torch_when_its_python_has_one(tmp_path):
    """The interpreter that runs this test imports torch: on a Jetson that is NVIDIA's build."""
    p = detect(tmp_path, "--python", sys.executable, release="jp512", cuda="11.4.315")
    assert p.returncode == 0, p.stderr
    assert "Jetson: L4T R35.4.1, JetPack 5.1.2, Python 3.8" in p.stdout
    assert "CUDA toolkit 11.4.315" in p.stdout
    assert "using the system's torch" in p.stdout and "--system-site-packages --skip-torch" in p.stdout


@pytest.mark.parametrize("release,jetpack,python,index", [
    ("jp512", "5.1.2", "3.8", "jp/v512/pytorch/"), ("jp511", "5.1.1", "3.8", "jp/v511/pytorch/"),
    ("jp60", "6.0", "3.10", "jp/v60/pytorch/")])
def test_a_jetson_without_torch_is_told_which_wheel_to_fetch(tmp_path, bare_python, release, jetpack, python, index):
    p = detect(tmp_path, "--python", bare_python, release=release)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"JetPack {jetpack}" in p.stdout
    assert f"download NVIDIA's wheel for JetPack {jetpack}, Python {python}" in p.stderr
    assert f"https://developer.download.nvidia.com/compute/redist/{index}" in p.stderr and "--torch-wheel PATH" in p.stderr
    p = detect(tmp_path, "--python", bare_python, "--torch-from-pypi", release=release)
    assert p.returncode == 0 and "from PyPI" in p.stdout, p.stderr


def test_jetpack_4_is_refused_unless_a_newer_python_and_a_cpu_torch_are_chosen(tmp_path):
    p = detect(tmp_path, "--python", sys.executable, release="jp4")
    assert p.returncode == 2
    assert "JetPack 4 (Jetson Nano, TX2) ships Python 3.6" in p.stderr and "--torch-from-pypi" in p.stderr
    p = detect(tmp_path, "--python", sys.executable, "--torch-from-pypi", release="jp4")
    assert p.returncode == 0, p.stderr


def test_an_unreadable_release_file_is_named(tmp_path, bare_python):
    p = detect(tmp_path, "--python", bare_python, release="garbled")
    assert "JetPack unknown (unreadable" in p.stdout and "not a release line" in p.stdout


def test_raspberry_pi_needs_the_64_bit_os(tmp_path):
    p = detect(tmp_path, "--python", sys.executable, model="Raspberry Pi 4 Model B Rev 1.4")
    assert p.returncode == 0, p.stderr
    assert "Raspberry Pi 4 Model B Rev 1.4 (aarch64)" in p.stdout and "from PyPI" in p.stdout
    p = detect(tmp_path, "--python", sys.executable, model="Raspberry Pi 4 Model B Rev 1.4", machine="armv7l")
    assert p.returncode == 2 and "install the 64-bit Raspberry Pi OS" in p.stderr


def test_a_python_below_the_floor_is_refused(tmp_path):
    old = tmp_path / "python3.7"
    old.write_text("#!/bin/sh\necho 3.7\n")
    old.chmod(0o755)
    p = detect(tmp_path, "--python", str(old), machine="x86_64")
    assert p.returncode == 2 and "Python 3.7: the agent needs Python >= 3.8" in p.stderr
