#!/usr/bin/env bash
# Install the SFL edge agent on a Linux board (Jetson, Raspberry Pi, x86 laptop/server).
#
# Creates a virtual environment under the prefix (default /opt/sfl), installs torch and
# this package, writes the agent's YAML config (PREFIX/etc/agent.yaml, once: an edited
# config is never overwritten) and the systemd unit sfl-agent.service, which runs
# `sfl-agent start --config PREFIX/etc/agent.yaml` and restarts it on failure. Running it
# again re-installs the package and changes nothing else. Only pip (and, for
# --systemd, useradd/systemctl) are used; nothing else is downloaded.
#
# The board decides the torch (install/board.sh): on a Jetson it reads /etc/nv_tegra_release,
# says which JetPack it found, and uses the system Python's NVIDIA torch if it has one
# (--system-site-packages, automatically); otherwise it names NVIDIA's wheel directory for
# that JetPack, to pass with --torch-wheel (installed with --no-deps, so pip keeps it).
# PyPI has no CUDA wheels for Jetson: --torch-from-pypi installs a CPU-only agent there.
# On a Raspberry Pi (64-bit OS) or an x86 machine, `pip install "torch>=2.0,<3"` is used.
# --detect only says what it found and what it would do.
set -euo pipefail

# shellcheck source=install/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

UNIT=sfl-agent.service
TORCH_WHEEL=""
TORCH_FROM_PYPI=0
DETECT=0
SETTINGS=()

usage() {
    cat <<USAGE
Usage: sudo $0 [--torch-wheel PATH.whl | --torch-from-pypi] [--set KEY=VALUE]... [--detect] [common options]

Installs the sfl-edge agent into PREFIX/venv, writes PREFIX/etc/agent.yaml (only if it
does not exist) and the unit sfl-agent.service.

Agent options:
  --torch-wheel PATH      local torch wheel installed with --no-deps (Jetson: NVIDIA's JetPack
                          wheel). Without it: the system's NVIDIA torch on a Jetson, else
                          pip install "torch>=2.0,<3"
  --torch-from-pypi       on a Jetson, install PyPI's torch anyway (CPU-only there)
  --detect                say which board, JetPack, Python and CUDA were found and which torch
                          would be used, then stop (changes nothing)
  --set KEY=VALUE         a setting for the new agent.yaml, e.g. --set profile=jetson-nano
                          --set broker=mqtts://board7@broker:8883 --set index=7 (keys: the
                          options of 'sfl-agent start'; see profiles/agent.example.yaml)

$COMMON_USAGE

Afterwards:
  1. edit PREFIX/etc/agent.yaml (profile, broker, run, index, data, coordinator_key: the
     coordinator.pub that sfl-coord broker-config issued with this device's credentials, ...)
  2. sudo systemctl enable --now sfl-agent; journalctl -u sfl-agent -f
USAGE
}

while [[ $# -gt 0 ]]; do
    common_option "$@"
    if [[ $COMMON_SHIFT -gt 0 ]]; then shift "$COMMON_SHIFT"; continue; fi
    case "$1" in
        --torch-wheel) need_value --torch-wheel "$@"; TORCH_WHEEL="$2"; shift 2 ;;
        --torch-from-pypi) TORCH_FROM_PYPI=1; shift ;;
        --detect) DETECT=1; shift ;;
        --set) need_value --set "$@"; [[ "$2" == *=* ]] || usage_error "--set needs KEY=VALUE, got '$2'"
               SETTINGS+=("$2"); shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) usage_error "unknown argument: $1" ;;
    esac
done

if [[ -n "$TORCH_WHEEL" ]]; then
    [[ -f "$TORCH_WHEEL" ]] || die "torch wheel not found: $TORCH_WHEEL"
    TORCH_WHEEL="$(cd "$(dirname "$TORCH_WHEEL")" && pwd -P)/$(basename "$TORCH_WHEEL")"
    [[ "$SKIP_TORCH" == 0 ]] || usage_error "--torch-wheel and --skip-torch exclude each other"
fi

# shellcheck source=install/board.sh
source "$(dirname "${BASH_SOURCE[0]}")/board.sh"
detect_board
note "found $(board_summary)"
CUDA="$(cuda_version)"
[[ -n "$CUDA" ]] && note "CUDA toolkit $CUDA"
command -v "$PYTHON" >/dev/null 2>&1 || die "interpreter not found: $PYTHON (use --python)"
PY_VERSION="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
note "Python $PY_VERSION ($PYTHON)"
if [[ "$BOARD" == jetson && -n "$JETPACK_PYTHON" && "$PY_VERSION" != "$JETPACK_PYTHON" && -z "$TORCH_WHEEL" ]]; then
    warn "NVIDIA's torch wheels for JetPack $JETPACK are built for Python $JETPACK_PYTHON, not $PY_VERSION"
fi
if [[ -n "$TORCH_WHEEL" || "$SKIP_TORCH" == 1 ]]; then
    TORCH_SOURCE=board
elif [[ "$TORCH_FROM_PYPI" == 1 || "$BOARD" != jetson ]]; then
    TORCH_SOURCE=pypi
elif SYSTEM_TORCH="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null)"; then
    note "using the system's torch $SYSTEM_TORCH (NVIDIA's build): --system-site-packages --skip-torch"
    SYSTEM_SITE=1
    SKIP_TORCH=1
    TORCH_SOURCE=board
else
    TORCH_SOURCE=none
fi
REFUSAL="$(board_refusal "$PY_VERSION" "$TORCH_SOURCE")"
if [[ -n "$REFUSAL" ]]; then
    echo "error: $REFUSAL" >&2
    exit 2   # a configuration error: a service manager must not retry it
fi
if [[ "$DETECT" == 1 ]]; then
    case "$TORCH_SOURCE" in
        board) note "torch: ${TORCH_WHEEL:-the one already importable (--skip-torch)}" ;;
        pypi) note "torch: pip install \"torch>=2.0,<3\" from PyPI${CUDA:+ (CPU-only on this board)}" ;;
    esac
    exit 0
fi
setup_layout sfl-agent
CONFIG="$ETC/agent.yaml"

make_venv

if [[ "$SKIP_TORCH" == 1 ]]; then
    note "not installing torch (--skip-torch)"
elif [[ -n "$TORCH_WHEEL" ]]; then
    note "installing the provided torch wheel (no deps, so pip keeps NVIDIA's build): $TORCH_WHEEL"
    pip_install --no-deps "$TORCH_WHEEL"
    # torch's own pure-Python dependencies, without letting pip swap torch itself
    pip_install filelock typing-extensions sympy networkx jinja2 fsspec
else
    note "installing torch"
    pip_install "torch>=2.0,<3"
fi

if [[ -n "$TORCH_WHEEL" ]]; then
    # NVIDIA's wheels carry versions like 2.1.0a0+nv23.06 that do not satisfy
    # "torch>=2.0", so a normal install would replace them with a PyPI build.
    # Install the package without deps, then its other dependencies explicitly.
    install_package --no-deps
    mapfile -t DEPS < <("$VENV/bin/python" - "$SRC_DIR/pyproject.toml" <<'PY'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M).group(1)
for dep in re.findall(r'"([^"]+)"', block):
    if not re.match(r"torch\b", dep):
        print(dep)
PY
)
    pip_install "${DEPS[@]}"
else
    install_package
fi

install_profiles

# The config: profiles/agent.example.yaml (every key, commented out) with the --set keys
# filled in. Written once; afterwards it belongs to the operator.
if [[ ! -e "$CONFIG" ]]; then
    # where the run's coordinator key is kept across restarts (docs/protocol.md §2.1); the key
    # itself comes with the device's credentials: --set coordinator_key=/path/coordinator.pub
    if ! printf '%s\n' "${SETTINGS[@]}" | grep -q '^trust_file='; then
        SETTINGS=("trust_file=$STATE/known_coordinators.json" "${SETTINGS[@]}")
    fi
    # what `sfl-agent status --config PREFIX/etc/agent.yaml` reads (the unit cannot write to home)
    if ! printf '%s\n' "${SETTINGS[@]}" | grep -q '^status_file='; then
        SETTINGS=("status_file=$STATE/status.json" "${SETTINGS[@]}")
    fi
    "$VENV/bin/python" - "$SRC_DIR/profiles/agent.example.yaml" "${SETTINGS[@]}" <<'PY' | write_config_once "$CONFIG" 0640
import re, sys
import yaml

text = open(sys.argv[1], encoding="utf-8").read()
for item in sys.argv[2:]:
    key, _, raw = item.partition("=")
    value = yaml.safe_load(raw) if raw.strip() else None
    line = yaml.safe_dump({key: value}, default_flow_style=False, width=1_000).strip()
    pattern = re.compile(rf"^#{re.escape(key)}:.*$", re.M)  # the example's "#key: value" lines
    if pattern.search(text):  # replace the commented example line, keeping its comment block
        text = pattern.sub(lambda m: line, text, count=1)
    else:  # an unknown key lands at the end; the check below names it
        text += f"{line}\n"
sys.stdout.write(text)
PY
    # a wrong --set key or value is reported now, not when the service first starts
    if ! SFL_PROFILES_DIR="$SHARE/profiles" "$VENV/bin/sfl-agent" start --config "$CONFIG" --help >/dev/null 2>"$ETC/.agent-check.err"; then
        cat "$ETC/.agent-check.err" >&2
        rm -f "$CONFIG" "$ETC/.agent-check.err"
        die "the settings given with --set are invalid (nothing was written to $CONFIG)"
    fi
    rm -f "$ETC/.agent-check.err"
else
    note "kept the existing $CONFIG"
    [[ ${#SETTINGS[@]} -eq 0 ]] || warn "--set ignored: $CONFIG exists (edit it instead)"
fi

write_if_changed "$UNIT_DIR/$UNIT" 0644 <<UNIT
# sfl-agent.service, generated by install/agent.sh; re-running it rewrites this file, so
# put local changes in a drop-in (systemctl edit sfl-agent).
# Settings: $CONFIG (keys: the options of 'sfl-agent start').
[Unit]
Description=Split federated learning edge agent (sfl-agent)
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
$(unit_user_lines)
WorkingDirectory=$STATE
Environment=HOME=$STATE
Environment=PYTHONUNBUFFERED=1
Environment=SFL_PROFILES_DIR=$SHARE/profiles
ExecStart=$VENV/bin/sfl-agent start --config $CONFIG
# The agent reconnects to the broker by itself; systemd restarts it after a crash, but
# not after a configuration error (exit status 2), which a restart cannot fix.
Restart=on-failure
RestartSec=5
RestartPreventExitStatus=2
TimeoutStopSec=30
$(unit_hardening "$STATE")

[Install]
WantedBy=multi-user.target
UNIT

systemd_install "$UNIT" "$CONFIG"

"$VENV/bin/python" -c "import torch, edge_agent; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
note "done: $VENV/bin/sfl-agent"
note "config: $CONFIG"
if [[ "$SYSTEMD" == yes ]]; then
    note "unit: $SYSTEM_UNIT_DIR/$UNIT -- after editing the config: sudo systemctl enable --now sfl-agent"
else
    note "unit: $UNIT_DIR/$UNIT (not installed into systemd; as root: sudo cp $UNIT_DIR/$UNIT $SYSTEM_UNIT_DIR/ && sudo systemctl daemon-reload)"
fi
