#!/usr/bin/env bash
# Install the SFL coordinator on a GPU server.
#
# Creates a virtual environment at /opt/sfl (override with --prefix), installs a
# CUDA build of torch from the PyTorch package index, then this package, and
# optionally Mosquitto from apt plus the systemd unit sfl-coord.service.
# Only pip and apt are used; nothing else is downloaded.
set -euo pipefail

PREFIX=/opt/sfl
# PyTorch publishes CUDA wheels on its own index, one per CUDA version
# (cu118, cu121, cu124, cu126, ...). Pick the one your NVIDIA driver supports
# (`nvidia-smi` shows the highest CUDA version); "cpu" gives a CPU-only build.
CUDA=cu124
WITH_MOSQUITTO=0
INSTALL_UNIT=1
SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"

usage() {
    cat <<USAGE
Usage: sudo $0 [--prefix DIR] [--cuda cu124|cu121|cu118|cpu] [--with-mosquitto] [--no-unit] [--python PY]

Installs the sfl-edge coordinator into a virtual environment.

  --prefix DIR        virtual environment location (default: /opt/sfl)
  --cuda TAG          PyTorch wheel index tag (default: $CUDA); torch comes from
                      https://download.pytorch.org/whl/TAG
  --with-mosquitto    apt-get install mosquitto and copy install/mosquitto.conf
                      to /etc/mosquitto/conf.d/sfl.conf (then create users with mosquitto_passwd)
  --no-unit           do not copy sfl-coord.service to /etc/systemd/system
  --python PY         interpreter used to create the venv (default: python3)
  -h, --help          show this help

Without a broker, 'sfl-coord serve' starts an embedded one (fine for trials,
not for many boards).
USAGE
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) PREFIX="${2:?--prefix needs a directory}"; shift 2 ;;
        --cuda) CUDA="${2:?--cuda needs a tag such as cu124}"; shift 2 ;;
        --with-mosquitto) WITH_MOSQUITTO=1; shift ;;
        --no-unit) INSTALL_UNIT=0; shift ;;
        --python) PYTHON="${2:?--python needs an interpreter}"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "error: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

if [[ ! "$CUDA" =~ ^(cpu|cu[0-9]+)$ ]]; then
    echo "error: --cuda must be 'cpu' or like 'cu124', got '$CUDA'" >&2
    exit 2
fi

if [[ "$WITH_MOSQUITTO" == 1 ]]; then
    if [[ $EUID -ne 0 ]]; then echo "error: --with-mosquitto needs root (sudo)" >&2; exit 1; fi
    echo ">> installing mosquitto (apt)"
    apt-get update
    apt-get install -y mosquitto mosquitto-clients
    install -m 0644 "$SRC_DIR/install/mosquitto.conf" /etc/mosquitto/conf.d/sfl.conf
    [[ -f /etc/mosquitto/sfl.passwd ]] || install -m 0640 -o root -g mosquitto /dev/null /etc/mosquitto/sfl.passwd
    echo "   create users: sudo mosquitto_passwd /etc/mosquitto/sfl.passwd sfl ; then: sudo systemctl restart mosquitto"
fi

echo ">> creating virtual environment at $PREFIX"
"$PYTHON" -m venv "$PREFIX"
PIP=("$PREFIX/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip wheel

# CUDA torch first, from PyTorch's index: a plain `pip install torch` may pick a
# build for a different CUDA version (or CPU-only) than this server's driver needs.
echo ">> installing torch ($CUDA) from https://download.pytorch.org/whl/$CUDA"
"${PIP[@]}" install "torch>=2.1,<3" --index-url "https://download.pytorch.org/whl/$CUDA"

echo ">> installing sfl-edge from $SRC_DIR"
"${PIP[@]}" install "$SRC_DIR"

if [[ "$INSTALL_UNIT" == 1 ]]; then
    if [[ $EUID -ne 0 ]]; then
        echo "warning: not root; skipping the systemd unit (re-run with sudo or copy it yourself)" >&2
    else
        install -m 0644 "$SRC_DIR/install/sfl-coord.service" /etc/systemd/system/sfl-coord.service
        install -d -m 0755 /etc/sfl
        if [[ ! -f /etc/sfl/coord.env ]]; then
            printf '# sfl-coord settings (see install/sfl-coord.service)\nSFL_BROKER=mqtt://localhost:1883\nSFL_COORD_ARGS=\n' > /etc/sfl/coord.env
        fi
        id -u sfl >/dev/null 2>&1 || useradd --system --home-dir /var/lib/sfl --shell /usr/sbin/nologin sfl
        systemctl daemon-reload || true
        echo ">> unit installed: sudo systemctl enable --now sfl-coord"
    fi
fi

"$PREFIX/bin/python" -c "import torch, coordinator; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
echo ">> done: $PREFIX/bin/sfl-coord"
