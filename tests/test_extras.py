"""Every command that needs an optional package says so, when it is missing, in one line with
the exact ``pip install 'sfl-edge[EXTRA]'``, and exits with status 2 (a configuration error:
systemd must not restart into it). Each runs in a real process whose import of that package
fails, as in an environment installed without the extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

WITHOUT = """
import importlib.abc, sys
blocked = set(sys.argv[1].split(","))
class Without(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Without())
prog, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
if prog == "sfl-coord":
    from cli.coord import app
else:
    from cli.agent import app
app(prog_name=prog)
"""


@pytest.mark.parametrize("missing,argv,extra", [
    ("amqtt", ["sfl-coord", "serve", "-c", "demo", "--output", "{tmp}/serve"], "coordinator"),
    ("prometheus_client", ["sfl-coord", "serve", "-c", "demo", "--output", "{tmp}/m", "--metrics", "127.0.0.1:0"],
     "coordinator"),
    ("onnx", ["sfl-coord", "export", str(REPO / "tests" / "data" / "checkpoints" / "demo"), "--onnx", "{tmp}/m.onnx"],
     "coordinator"),
    ("sklearn", ["sfl-coord", "simulate", "-c", "demo", "--output", "{tmp}/sim"], "demo"),
    ("onnxruntime", ["sfl-agent", "predict", "{tmp}/m.onnx", "{tmp}/x.npy"], "predict"),
])
def test_a_command_without_its_extra_says_which_in_one_line_and_exits_2(tmp_path: Path, missing, argv, extra):
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    p = subprocess.run([sys.executable, "-c", WITHOUT, missing, *args], cwd=tmp_path, capture_output=True, text=True,
                       timeout=100, env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"})
    out = (p.stdout + p.stderr).strip()
    assert p.returncode == 2, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert f"pip install 'sfl-edge[{extra}]'" in out, out
    assert not (tmp_path / "m.onnx").exists()
