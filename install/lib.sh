# Shared by install/agent.sh and install/coordinator.sh (sourced, not run).
#
# Layout under PREFIX (default /opt/sfl), the same for a real install and a test:
#   PREFIX/venv/                       virtual environment (sfl-agent, sfl-coord)
#   PREFIX/etc/                        configuration (written once, never overwritten)
#   PREFIX/share/sfl-edge/profiles/    device profiles and run configs (SFL_PROFILES_DIR)
#   PREFIX/var/<service>/              working and state directory of the service
#   PREFIX/lib/systemd/system/         the generated systemd unit
# Only with --systemd (auto: as root, with systemd running and the default prefix) is
# the unit also copied to /etc/systemd/system and the service user created.
# shellcheck shell=bash

DEFAULT_PREFIX=/opt/sfl
PREFIX="$DEFAULT_PREFIX"
PREFIX_GIVEN=0
PYTHON="${PYTHON:-python3}"
SYSTEM_SITE=0
OFFLINE=0
FIND_LINKS=""
SKIP_TORCH=0
SERVICE_USER=sfl
SYSTEMD=auto
SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SYSTEM_UNIT_DIR=/etc/systemd/system
COMMON_SHIFT=0

COMMON_USAGE="Common options:
  --prefix DIR            install root, default $DEFAULT_PREFIX; everything goes under it:
                          DIR/venv, DIR/etc, DIR/share/sfl-edge, DIR/var, DIR/lib/systemd/system
  --python PY             interpreter that creates the virtual environment (default: python3)
  --system-site-packages  the environment also sees the packages PY can import: its system
                          site-packages (e.g. JetPack's preinstalled torch) and, when PY runs in a
                          virtual environment, that environment's packages (linked with a .pth file)
  --offline               never use the network: no pip self-upgrade, pip --no-index, the package
                          built without build isolation; dependencies must already be importable
                          (--system-site-packages) or be wheels in --find-links
  --find-links DIR        a directory of wheels for pip (an air-gapped board's wheelhouse)
  --skip-torch            do not install torch (it is importable already)
  --user NAME             service user in the unit (default: sfl; created with --systemd)
  --systemd auto|yes|no   also install the unit into $SYSTEM_UNIT_DIR, create the user and
                          reload systemd; auto (default) = yes when run as root, systemd is
                          running and --prefix was not given
  -h, --help              show this help
pip also honours its PIP_* environment variables (PIP_INDEX_URL, PIP_PROXY, ...).
Running the script again is safe: it re-installs the package, rewrites the unit, and keeps
every existing configuration file as it is."

die() { echo "error: $*" >&2; exit 1; }
usage_error() { echo "error: $*" >&2; echo "Try '$0 --help'." >&2; exit 2; }
note() { echo ">> $*"; }
warn() { echo "warning: $*" >&2; }

need_value() {  # need_value OPTION "$@": OPTION must be followed by a value
    [[ $# -ge 3 && -n "$3" && "$3" != --* ]] || usage_error "$1 needs a value"
}

# Handle one of the common options at "$@"; sets COMMON_SHIFT to the arguments it used (0 = not ours).
common_option() {
    COMMON_SHIFT=0
    case "$1" in
        --prefix) need_value --prefix "$@"; PREFIX="$2"; PREFIX_GIVEN=1; COMMON_SHIFT=2 ;;
        --python) need_value --python "$@"; PYTHON="$2"; COMMON_SHIFT=2 ;;
        --system-site-packages) SYSTEM_SITE=1; COMMON_SHIFT=1 ;;
        --offline) OFFLINE=1; COMMON_SHIFT=1 ;;
        --find-links) need_value --find-links "$@"; FIND_LINKS="$2"; COMMON_SHIFT=2 ;;
        --skip-torch) SKIP_TORCH=1; COMMON_SHIFT=1 ;;
        --user) need_value --user "$@"; SERVICE_USER="$2"; COMMON_SHIFT=2 ;;
        --systemd) need_value --systemd "$@"; SYSTEMD="$2"; COMMON_SHIFT=2 ;;
    esac
}

# Validate the common options and derive the layout; call once after parsing.
setup_layout() {  # setup_layout SERVICE_NAME
    local service="$1"
    [[ "$SYSTEMD" =~ ^(auto|yes|no)$ ]] || usage_error "--systemd must be auto, yes or no, got '$SYSTEMD'"
    [[ "$SERVICE_USER" =~ ^[a-z_][a-z0-9_-]*$ ]] || usage_error "--user must be a user name like 'sfl', got '$SERVICE_USER'"
    [[ -z "$FIND_LINKS" || -d "$FIND_LINKS" ]] || die "--find-links: no such directory: $FIND_LINKS"
    command -v "$PYTHON" >/dev/null 2>&1 || die "interpreter not found: $PYTHON (use --python)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 8))' \
        || die "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'); sfl-edge needs >= 3.8 (use --python)"
    [[ "$PREFIX" == /* ]] || PREFIX="$PWD/$PREFIX"
    # The prefix ends up in unit lines, where '%' starts a specifier, '$' an environment
    # variable and blanks separate arguments: refuse them rather than half-escape them.
    local safe='^/[A-Za-z0-9._/+-]*$'
    [[ "$PREFIX" =~ $safe ]] || die "--prefix may contain only letters, digits and . _ / + - (got '$PREFIX')"
    mkdir -p "$PREFIX" || die "cannot create $PREFIX (run as root, or choose --prefix)"
    PREFIX="$(cd "$PREFIX" && pwd -P)"
    [[ "$PREFIX" =~ $safe ]] || die "--prefix resolves to '$PREFIX', which has characters other than letters, digits and . _ / + -"
    VENV="$PREFIX/venv"
    ETC="$PREFIX/etc"
    SHARE="$PREFIX/share/sfl-edge"
    STATE="$PREFIX/var/$service"
    UNIT_DIR="$PREFIX/lib/systemd/system"
    if [[ "$SYSTEMD" == auto ]]; then
        if [[ $EUID -eq 0 && -d /run/systemd/system && "$PREFIX_GIVEN" == 0 ]]; then SYSTEMD=yes; else SYSTEMD=no; fi
    fi
    if [[ "$SYSTEMD" == yes ]]; then
        [[ $EUID -eq 0 ]] || die "--systemd yes needs root (sudo)"
        command -v systemctl >/dev/null 2>&1 || die "--systemd yes: systemctl not found"
        # the units use PrivateTmp=true, which hides the host's /tmp from the service
        [[ "$PREFIX" != /tmp/* && "$PREFIX" != /var/tmp/* ]] || die "--systemd yes: a prefix under /tmp is invisible to the service"
    fi
    mkdir -p "$ETC" "$SHARE" "$STATE" "$UNIT_DIR"
}

PIP_COMMON=(--disable-pip-version-check --no-input)

pip_install() {  # pip_install ARGS...: pip install into the venv, offline/find-links honoured
    local args=("${PIP_COMMON[@]}")
    [[ "$OFFLINE" == 1 ]] && args+=(--no-index)
    [[ -n "$FIND_LINKS" ]] && args+=(--find-links "$FIND_LINKS")
    "$VENV/bin/python" -m pip install "${args[@]}" "$@"
}

# The virtual environment: created once, reused afterwards (delete PREFIX/venv to change
# --python or --system-site-packages).
make_venv() {
    local inherit=()
    if [[ "$SYSTEM_SITE" == 1 ]]; then
        # `python -m venv --system-site-packages` exposes the *base* interpreter's packages,
        # not those of a virtual environment PY may belong to; list those in a .pth file.
        mapfile -t inherit < <("$PYTHON" - <<'PY'
import site, sys
if sys.prefix != sys.base_prefix:
    for d in site.getsitepackages():
        print(d)
PY
)
    fi
    if [[ -x "$VENV/bin/python" ]]; then
        note "reusing the virtual environment $VENV"
    else
        local flags=()
        if [[ "$SYSTEM_SITE" == 1 ]]; then
            flags+=(--system-site-packages)
            # A venv's own bundled pip/setuptools would shadow PY's newer ones (and need the
            # network to upgrade); when PY has pip, use PY's.
            "$PYTHON" -c "import pip" >/dev/null 2>&1 && flags+=(--without-pip)
        fi
        note "creating the virtual environment $VENV (${PYTHON})"
        "$PYTHON" -m venv "${flags[@]}" "$VENV" \
            || die "cannot create a virtual environment with $PYTHON (Debian/Ubuntu: apt-get install python3-venv)"
    fi
    if [[ ${#inherit[@]} -gt 0 ]]; then
        local site_dir
        site_dir="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        printf '%s\n' "${inherit[@]}" | write_if_changed "$site_dir/sfl-inherited-site.pth" 0644
    fi
    if [[ "$OFFLINE" == 0 ]]; then
        pip_install --upgrade pip setuptools wheel
    fi
    "$VENV/bin/python" -m pip --version >/dev/null 2>&1 || die "no pip in $VENV (install python3-pip, or drop --offline)"
}

# The package from SRC_DIR, re-installed on every run. Built from a clean copy so that
# the checkout gets no build/ or *.egg-info and may be read-only.
install_package() {  # install_package [--no-deps]; PACKAGE_EXTRAS="[coordinator]" adds extras
    local stage
    stage="$(mktemp -d)"
    # shellcheck disable=SC2064  # expand now: the trap must remove this very directory
    trap "rm -rf '$stage'" EXIT
    tar -C "$SRC_DIR" --exclude=.git --exclude='*.egg-info' --exclude=__pycache__ --exclude=./build \
        --exclude=./runs --exclude=./.venv --exclude=./.pytest_cache --exclude=./bench/results -cf - . \
        | tar -C "$stage" -xf -
    local flags=()
    [[ "$OFFLINE" == 1 ]] && flags+=(--no-build-isolation)
    note "installing sfl-edge from $SRC_DIR"
    pip_install "${flags[@]}" "$@" "${stage}${PACKAGE_EXTRAS:-}"
    rm -rf "$stage"
    trap - EXIT
}

# Device profiles and run configs: an installed package has no repository around it, so
# the units point SFL_PROFILES_DIR here. Shipped files, refreshed on every run.
install_profiles() {
    rm -rf "$SHARE/profiles.new"
    cp -R "$SRC_DIR/profiles" "$SHARE/profiles.new"
    rm -rf "$SHARE/profiles"
    mv "$SHARE/profiles.new" "$SHARE/profiles"
}

# Write stdin to FILE with MODE unless FILE already holds exactly that (idempotent).
write_if_changed() {  # write_if_changed FILE MODE < content
    local file="$1" mode="$2" tmp
    tmp="$(mktemp "$file.XXXXXX")"
    cat >"$tmp"
    chmod "$mode" "$tmp"
    if [[ -f "$file" ]] && cmp -s "$tmp" "$file"; then
        rm -f "$tmp"
        chmod "$mode" "$file"
        return 0
    fi
    mv -f "$tmp" "$file"
    note "wrote $file"
}

# Write stdin to FILE only if FILE does not exist: the operator's edits are never touched.
write_config_once() {  # write_config_once FILE MODE < content
    local file="$1" mode="$2"
    if [[ -e "$file" ]]; then
        cat >/dev/null
        note "kept the existing $file"
        return 0
    fi
    write_if_changed "$file" "$mode"
}

# Hardening shared by both units. Deliberately absent: PrivateDevices= (the GPU device
# nodes, /dev/nvidia* and a Jetson's /dev/nvhost-*, must stay visible),
# MemoryDenyWriteExecute= (torch and onnxruntime generate code at run time) and a
# SystemCallFilter= (a blocked call in a vendor's CUDA stack would crash-loop the service).
unit_hardening() {  # unit_hardening STATE_DIR
    cat <<UNIT
NoNewPrivileges=true
ProtectSystem=strict
ReadWritePaths=$1
ProtectHome=read-only
PrivateTmp=true
ProtectKernelTunables=true
ProtectKernelModules=true
ProtectKernelLogs=true
ProtectControlGroups=true
ProtectClock=true
ProtectHostname=true
ProtectProc=invisible
RestrictSUIDSGID=true
RestrictRealtime=true
RestrictNamespaces=true
LockPersonality=true
RemoveIPC=true
CapabilityBoundingSet=
AmbientCapabilities=
SystemCallArchitectures=native
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
UMask=0027
UNIT
}

unit_user_lines() {
    echo "User=$SERVICE_USER"
    echo "Group=$SERVICE_USER"
    # GPU access on a Jetson (and /dev/dri elsewhere) goes through the video group
    if getent group video >/dev/null 2>&1; then echo "SupplementaryGroups=video"; fi
}

# With --systemd: the service user, ownership, the unit in /etc/systemd/system, daemon-reload.
systemd_install() {  # systemd_install UNIT_NAME CONFIG_FILE...
    local unit="$1"; shift
    [[ "$SYSTEMD" == yes ]] || return 0
    if ! id -u "$SERVICE_USER" >/dev/null 2>&1; then
        note "creating the system user $SERVICE_USER"
        useradd --system --home-dir "$STATE" --no-create-home --shell /usr/sbin/nologin "$SERVICE_USER"
    fi
    chown "$SERVICE_USER:$SERVICE_USER" "$STATE"
    local f
    for f in "$@"; do  # readable by the service, not by everybody (broker passwords)
        chown "root:$SERVICE_USER" "$f"
        chmod 0640 "$f"
    done
    write_if_changed "$SYSTEM_UNIT_DIR/$unit" 0644 <"$UNIT_DIR/$unit"
    systemctl daemon-reload
}
