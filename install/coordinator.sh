#!/usr/bin/env bash
# Install the SFL coordinator on a GPU server.
#
# Creates a virtual environment under the prefix (default /opt/sfl), installs a CUDA
# build of torch from the PyTorch package index and this package, writes the run config
# (PREFIX/etc/run.yaml) and the service settings (PREFIX/etc/coord.env) once -- edited
# files are never overwritten -- and the systemd unit sfl-coord.service, which runs
# `sfl-coord serve --config PREFIX/etc/run.yaml --resume auto $SFL_COORD_ARGS` and restarts it on
# failure. Optionally installs Mosquitto from apt. Running it again re-installs the
# package and changes nothing else. Only pip and apt are used; nothing else is downloaded.
set -euo pipefail

# shellcheck source=install/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

UNIT=sfl-coord.service
# PyTorch publishes CUDA wheels on its own index, one per CUDA version
# (cu118, cu121, cu124, cu126, ...). Pick the one your NVIDIA driver supports
# (`nvidia-smi` shows the highest CUDA version); "cpu" gives a CPU-only build.
CUDA=cu124
WITH_MOSQUITTO=0
BROKER_ARGS=()
RUN_CONFIG="$SRC_DIR/profiles/runs/demo.yaml"
SERVE_ARGS="--listen 127.0.0.1:1883 --quiet"

usage() {
    cat <<USAGE
Usage: sudo $0 [--cuda cu124|cu121|cu118|cpu] [--run-config FILE] [--serve-args "ARGS"]
               [--with-mosquitto [--agents-file F] [--tls-cert C --tls-key K]] [common options]

Installs the sfl-edge coordinator into PREFIX/venv, writes PREFIX/etc/run.yaml and
PREFIX/etc/coord.env (only if they do not exist) and the unit sfl-coord.service.

Coordinator options:
  --cuda TAG            PyTorch wheel index tag (default: $CUDA); torch comes from
                        https://download.pytorch.org/whl/TAG
  --run-config FILE     run config copied to PREFIX/etc/run.yaml
                        (default: profiles/runs/demo.yaml)
  --serve-args "ARGS"   initial SFL_COORD_ARGS in coord.env, extra arguments of
                        'sfl-coord serve' (default: "$SERVE_ARGS", i.e. the embedded broker, loopback only;
                        e.g. "--broker mqtt://sfl:PASS@localhost:1883 --device cuda --quiet")
  --with-mosquitto      apt-get install mosquitto and configure it with
                        'sfl-coord broker-config' into /etc/mosquitto/sfl (needs root):
                        no anonymous clients, one user and password per device
                        (/etc/mosquitto/sfl/credentials/<user>.password), the topic ACL;
                        TLS on 8883 with --tls-cert/--tls-key. Re-running keeps passwords.
  --agents-file F       agent user names (= agent ids), one per line, for --with-mosquitto
  --tls-cert C, --tls-key K
                        the broker's certificate and key (PEM) for --with-mosquitto

$COMMON_USAGE

Without a broker, 'sfl-coord serve' starts an embedded one (fine for trials, not for
many boards). Afterwards:
  1. edit PREFIX/etc/run.yaml and PREFIX/etc/coord.env
  2. sudo systemctl enable --now sfl-coord; journalctl -u sfl-coord -f
USAGE
}

while [[ $# -gt 0 ]]; do
    common_option "$@"
    if [[ $COMMON_SHIFT -gt 0 ]]; then shift "$COMMON_SHIFT"; continue; fi
    case "$1" in
        --cuda) need_value --cuda "$@"; CUDA="$2"; shift 2 ;;
        --run-config) need_value --run-config "$@"; RUN_CONFIG="$2"; shift 2 ;;
        --serve-args) [[ $# -ge 2 ]] || usage_error "--serve-args needs a value"; SERVE_ARGS="$2"; shift 2 ;;
        --with-mosquitto) WITH_MOSQUITTO=1; shift ;;
        --agents-file) need_value --agents-file "$@"; BROKER_ARGS+=(--agents-file "$(realpath "$2")"); shift 2 ;;
        --tls-cert) need_value --tls-cert "$@"; BROKER_ARGS+=(--tls-cert "$(realpath "$2")"); shift 2 ;;
        --tls-key) need_value --tls-key "$@"; BROKER_ARGS+=(--tls-key "$(realpath "$2")"); shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) usage_error "unknown argument: $1" ;;
    esac
done

[[ "$CUDA" =~ ^(cpu|cu[0-9]+)$ ]] || usage_error "--cuda must be 'cpu' or like 'cu124', got '$CUDA'"
[[ -f "$RUN_CONFIG" ]] || die "run config not found: $RUN_CONFIG"
[[ "$SERVE_ARGS" != *$'\n'* ]] || usage_error "--serve-args must be one line"
if [[ "$WITH_MOSQUITTO" == 1 && $EUID -ne 0 ]]; then die "--with-mosquitto needs root (sudo)"; fi
setup_layout sfl-coord
CONFIG="$ETC/run.yaml"
ENV_FILE="$ETC/coord.env"

make_venv

if [[ "$SKIP_TORCH" == 1 ]]; then
    note "not installing torch (--skip-torch)"
elif [[ "$OFFLINE" == 1 ]]; then
    # no index to ask: torch must be importable already or be a wheel in --find-links
    note "installing torch (offline)"
    pip_install "torch>=2.0,<3"
else
    # CUDA torch first, from PyTorch's index: a plain `pip install torch` may pick a
    # build for a different CUDA version (or CPU-only) than this server's driver needs.
    note "installing torch ($CUDA) from https://download.pytorch.org/whl/$CUDA"
    pip_install "torch>=2.0,<3" --index-url "https://download.pytorch.org/whl/$CUDA"
fi

PACKAGE_EXTRAS="[coordinator]" install_package   # the coordinator's own packages (ONNX, metrics, broker)
install_profiles

if [[ "$WITH_MOSQUITTO" == 1 ]]; then
    note "installing mosquitto (apt) and writing its configuration to /etc/mosquitto/sfl"
    apt-get update
    apt-get install -y mosquitto mosquitto-clients
    # users, passwords (kept on re-runs), ACL and listener, from the protocol's own topic layout
    "$VENV/bin/sfl-coord" broker-config /etc/mosquitto/sfl ${BROKER_ARGS[@]+"${BROKER_ARGS[@]}"}  # Debian's main config keeps persistence on
    chgrp mosquitto /etc/mosquitto/sfl/passwd /etc/mosquitto/sfl/acl   # the broker runs as 'mosquitto'
    chmod 0640 /etc/mosquitto/sfl/passwd /etc/mosquitto/sfl/acl
    install -m 0644 /etc/mosquitto/sfl/mosquitto.conf /etc/mosquitto/conf.d/sfl.conf
    systemctl restart mosquitto || warn "could not restart mosquitto; start it yourself"
fi

write_config_once "$CONFIG" 0640 <"$RUN_CONFIG"
write_config_once "$ENV_FILE" 0640 <<ENV
# Settings of sfl-coord.service (EnvironmentFile=); after editing: sudo systemctl restart sfl-coord
# The service runs:  sfl-coord serve --config $CONFIG --resume auto \$SFL_COORD_ARGS
# (--resume auto: a restart after a crash continues the run from its last checkpoint; a run
# that has no checkpoint yet starts fresh; a damaged checkpoint stops the service, exit 2)
# SFL_COORD_ARGS is split at blanks (no quoting), e.g.
#   --broker mqtt://sfl:PASS@localhost:1883    an external broker (default: an embedded one on --listen)
#   --broker mqtts://coordinator@broker:8883 --ca-file $ETC/ca.crt --password-file $ETC/coordinator.password
#   --device cuda    --metrics 127.0.0.1:9464    --dashboard 127.0.0.1:8080
# The embedded broker (no --broker) has no TLS and no passwords: it listens on loopback only.
# Agents on other hosts need --with-mosquitto (TLS, one user per device); on a network you
# trust completely, '--listen 0.0.0.0:1883 --insecure-listen' opens the embedded one to it.
# Relative paths are relative to the service's working directory, $STATE,
# where the run's outputs (runs/<run>/) go too.
SFL_COORD_ARGS=$SERVE_ARGS
ENV

# the run config must load (fleet profiles resolved from the installed copies)
if ! SFL_PROFILES_DIR="$SHARE/profiles" "$VENV/bin/python" -c \
        "import sys; from sfl_core.config.run import load_run_config; load_run_config(sys.argv[1])" "$CONFIG"; then
    warn "$CONFIG does not load (see above); fix it before starting the service"
fi

write_if_changed "$UNIT_DIR/$UNIT" 0644 <<UNIT
# sfl-coord.service, generated by install/coordinator.sh; re-running it rewrites this
# file, so put local changes in a drop-in (systemctl edit sfl-coord).
# Settings: $ENV_FILE and the run config $CONFIG.
[Unit]
Description=Split federated learning coordinator (sfl-coord)
Wants=network-online.target
After=network-online.target mosquitto.service

[Service]
Type=simple
$(unit_user_lines)
EnvironmentFile=$ENV_FILE
WorkingDirectory=$STATE
Environment=HOME=$STATE
Environment=PYTHONUNBUFFERED=1
Environment=SFL_PROFILES_DIR=$SHARE/profiles
ExecStart=$VENV/bin/sfl-coord serve --config $CONFIG --resume auto \$SFL_COORD_ARGS
# Restarted after a crash, not after a configuration error (exit status 2) nor after the
# run has finished (exit status 0); --resume auto continues a crashed run from its last
# checkpoint. A second coordinator of the same run exits 2 (the run directory is locked).
Restart=on-failure
RestartSec=5
RestartPreventExitStatus=2
# 130: stopped by SIGTERM (systemctl stop), the run checkpointed: a clean stop, not a failure
SuccessExitStatus=130
TimeoutStopSec=60
$(unit_hardening "$STATE")

[Install]
WantedBy=multi-user.target
UNIT

systemd_install "$UNIT" "$CONFIG" "$ENV_FILE"

"$VENV/bin/python" -c "import torch, coordinator; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
note "done: $VENV/bin/sfl-coord"
note "config: $CONFIG and $ENV_FILE"
if [[ "$SYSTEMD" == yes ]]; then
    note "unit: $SYSTEM_UNIT_DIR/$UNIT -- after editing the config: sudo systemctl enable --now sfl-coord"
else
    note "unit: $UNIT_DIR/$UNIT (not installed into systemd; as root: sudo cp $UNIT_DIR/$UNIT $SYSTEM_UNIT_DIR/ && sudo systemctl daemon-reload)"
fi
