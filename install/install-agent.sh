#!/usr/bin/env bash
# Install the SFL edge agent on a board (Raspberry Pi, Jetson, laptop).
#
# Creates a virtual environment at /opt/sfl (override with --prefix), installs
# torch, then this package, and copies the systemd template unit
# sfl-agent@.service. Only pip and apt are used; nothing else is downloaded.
#
# Torch on Jetson: PyPI has no CUDA wheels for Jetson (aarch64 + JetPack).
# Download the wheel matching your JetPack from NVIDIA ("PyTorch for Jetson",
# developer.download.nvidia.com/compute/redist/jp/...) and pass it with
# --torch-wheel; it is installed with --no-deps so pip does not replace it.
# Without --torch-wheel, `pip install "torch>=2.1,<3"` is used (CPU build on
# most boards; fine for Raspberry Pi and x86 laptops).
set -euo pipefail

PREFIX=/opt/sfl
TORCH_WHEEL=""
INSTALL_UNIT=1
SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"

usage() {
    cat <<USAGE
Usage: sudo $0 [--prefix DIR] [--torch-wheel PATH.whl] [--no-unit] [--python PY]

Installs the sfl-edge agent into a virtual environment and the systemd unit.

  --prefix DIR         virtual environment location (default: /opt/sfl)
  --torch-wheel PATH   local torch wheel to install with --no-deps (Jetson: the
                       JetPack wheel from NVIDIA). Without it: pip install "torch>=2.1,<3"
  --no-unit            do not copy sfl-agent@.service to /etc/systemd/system
  --python PY          interpreter used to create the venv (default: python3)
  -h, --help           show this help

After installing:
  1. write /etc/sfl/agent.env, e.g.  SFL_BROKER=mqtt://agent:PASS@coordinator:1883
  2. sudo systemctl enable --now sfl-agent@<profile>     (profile = device profile name)
USAGE
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) PREFIX="${2:?--prefix needs a directory}"; shift 2 ;;
        --torch-wheel) TORCH_WHEEL="${2:?--torch-wheel needs a path}"; shift 2 ;;
        --no-unit) INSTALL_UNIT=0; shift ;;
        --python) PYTHON="${2:?--python needs an interpreter}"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "error: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

if [[ -n "$TORCH_WHEEL" && ! -f "$TORCH_WHEEL" ]]; then
    echo "error: torch wheel not found: $TORCH_WHEEL" >&2
    exit 1
fi

echo ">> creating virtual environment at $PREFIX"
"$PYTHON" -m venv "$PREFIX"
PIP=("$PREFIX/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip wheel

if [[ -n "$TORCH_WHEEL" ]]; then
    echo ">> installing the provided torch wheel (no deps, so pip keeps NVIDIA's build): $TORCH_WHEEL"
    "${PIP[@]}" install --no-deps "$TORCH_WHEEL"
    # torch's own pure-Python dependencies, without letting pip swap torch itself
    "${PIP[@]}" install filelock typing-extensions sympy networkx jinja2 fsspec
else
    echo ">> installing torch from PyPI"
    "${PIP[@]}" install "torch>=2.1,<3"
fi

echo ">> installing sfl-edge from $SRC_DIR"
if [[ -n "$TORCH_WHEEL" ]]; then
    # NVIDIA's wheels carry versions like 2.1.0a0+nv23.06 that do not satisfy
    # "torch>=2.1", so a normal install would replace them with a PyPI build.
    # Install the package without deps, then its other dependencies explicitly.
    "${PIP[@]}" install --no-deps "$SRC_DIR"
    mapfile -t DEPS < <("$PREFIX/bin/python" - "$SRC_DIR/pyproject.toml" <<'PY'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M).group(1)
for dep in re.findall(r'"([^"]+)"', block):
    if not re.match(r"torch\b", dep):
        print(dep)
PY
)
    "${PIP[@]}" install "${DEPS[@]}"
else
    "${PIP[@]}" install "$SRC_DIR"
fi

if [[ "$INSTALL_UNIT" == 1 ]]; then
    if [[ $EUID -ne 0 ]]; then
        echo "warning: not root; skipping the systemd unit (re-run with sudo or copy it yourself)" >&2
    else
        install -m 0644 "$SRC_DIR/install/sfl-agent@.service" /etc/systemd/system/sfl-agent@.service
        install -d -m 0755 /etc/sfl
        if [[ ! -f /etc/sfl/agent.env ]]; then
            printf '# sfl-agent settings (see install/sfl-agent@.service)\nSFL_BROKER=mqtt://localhost:1883\nSFL_AGENT_ARGS=\n' > /etc/sfl/agent.env
        fi
        id -u sfl >/dev/null 2>&1 || useradd --system --home-dir /var/lib/sfl --shell /usr/sbin/nologin sfl
        systemctl daemon-reload || true
        echo ">> unit installed: sudo systemctl enable --now sfl-agent@<profile>"
    fi
fi

"$PREFIX/bin/python" -c "import torch, edge_agent; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
echo ">> done: $PREFIX/bin/sfl-agent"
