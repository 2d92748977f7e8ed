# Which board is this, and which torch does the agent need on it? (sourced by install/agent.sh)
#
# A Jetson says its L4T release in /etc/nv_tegra_release ("# R35 (release), REVISION: 4.1, ...");
# the release names the JetPack, and the JetPack fixes the Python (Ubuntu's) and the torch
# builds NVIDIA publishes for it. A Raspberry Pi names itself in /proc/device-tree/model.
# Tests point SFL_NV_TEGRA_RELEASE, SFL_DEVICE_MODEL and SFL_MACHINE at fake files and values.
# shellcheck shell=bash

NV_TEGRA_RELEASE="${SFL_NV_TEGRA_RELEASE:-/etc/nv_tegra_release}"
DEVICE_MODEL="${SFL_DEVICE_MODEL:-/proc/device-tree/model}"
MACHINE="${SFL_MACHINE:-$(uname -m)}"
NVIDIA_REDIST="https://developer.download.nvidia.com/compute/redist/jp"

BOARD=""          # jetson | raspberry-pi | other
L4T=""            # e.g. 35.4.1
JETPACK=""        # e.g. 5.1.2
JETPACK_PYTHON="" # the Python of that JetPack's Ubuntu
TORCH_INDEX=""    # NVIDIA's directory of torch wheels for that JetPack
BOARD_MODEL=""

# JetPack of an L4T release (major minor [patch]), its Ubuntu's Python, and NVIDIA's wheel directory.
jetpack_of() {  # jetpack_of MAJOR MINOR
    local major="$1" minor="$2"
    case "$major" in
        32) JETPACK="4.x (L4T R32.$minor)"; JETPACK_PYTHON=3.6; TORCH_INDEX="" ;;
        35) JETPACK_PYTHON=3.8
            case "$minor" in
                1) JETPACK=5.0.2; TORCH_INDEX="$NVIDIA_REDIST/v502/pytorch/" ;;
                2) JETPACK=5.1;   TORCH_INDEX="$NVIDIA_REDIST/v51/pytorch/" ;;
                3) JETPACK=5.1.1; TORCH_INDEX="$NVIDIA_REDIST/v511/pytorch/" ;;
                4) JETPACK=5.1.2; TORCH_INDEX="$NVIDIA_REDIST/v512/pytorch/" ;;
                *) JETPACK="5.1.3 or later (L4T R35.$minor)"; TORCH_INDEX="$NVIDIA_REDIST/v512/pytorch/" ;;
            esac ;;
        36) JETPACK_PYTHON=3.10
            case "$minor" in
                2) JETPACK="6.0 DP"; TORCH_INDEX="$NVIDIA_REDIST/v60dp/pytorch/" ;;
                3) JETPACK=6.0;      TORCH_INDEX="$NVIDIA_REDIST/v60/pytorch/" ;;
                *) JETPACK="6.1 or later (L4T R36.$minor)"; TORCH_INDEX="$NVIDIA_REDIST/v61/pytorch/" ;;
            esac ;;
        *) JETPACK="unknown (L4T R$major.$minor)"; JETPACK_PYTHON=""; TORCH_INDEX="" ;;
    esac
}

detect_board() {
    if [[ -r "$NV_TEGRA_RELEASE" ]]; then
        BOARD=jetson
        local line major revision
        line="$(head -n 1 "$NV_TEGRA_RELEASE")"
        major="$(sed -n 's/^# R\([0-9]\+\) .*/\1/p' <<<"$line")"
        revision="$(sed -n 's/.*REVISION: \([0-9][0-9.]*\).*/\1/p' <<<"$line")"
        [[ -n "$major" && -n "$revision" ]] || { JETPACK="unknown (unreadable $NV_TEGRA_RELEASE: '$line')"; return; }
        L4T="$major.$revision"
        jetpack_of "$major" "${revision%%.*}"
    elif [[ -r "$DEVICE_MODEL" ]] && grep -qa "Raspberry Pi" "$DEVICE_MODEL"; then
        BOARD=raspberry-pi
        BOARD_MODEL="$(tr -d '\0' <"$DEVICE_MODEL")"
    else
        BOARD=other
    fi
}

# What was found, in one line.
board_summary() {
    case "$BOARD" in
        jetson) echo "Jetson: L4T R${L4T:-?}, JetPack $JETPACK${JETPACK_PYTHON:+, Python $JETPACK_PYTHON}" ;;
        raspberry-pi) echo "$BOARD_MODEL ($MACHINE)" ;;
        *) echo "a $MACHINE machine (no Jetson or Raspberry Pi found)" ;;
    esac
}

# The CUDA toolkit the board has, if any ("11.4.315"), from the toolkit's own version file.
cuda_version() {
    local root="${SFL_CUDA_HOME:-/usr/local/cuda}"
    if [[ -r "$root/version.json" ]]; then
        tr -d '\n' <"$root/version.json" | sed -n 's/.*"cuda" *: *{[^}]*"version" *: *"\([0-9.]*\)".*/\1/p'
    elif [[ -r "$root/version.txt" ]]; then
        sed -n 's/^CUDA Version \([0-9.]*\).*/\1/p' <"$root/version.txt"
    fi
}

# Why this board cannot run the agent as asked (empty: it can). Arguments: the interpreter's
# version ("3.8") and where torch comes from: "board" (--torch-wheel, an importable NVIDIA
# torch, or --skip-torch), "pypi" (--torch-from-pypi: CPU-only on a Jetson) or "none".
board_refusal() {  # board_refusal PYTHON_VERSION TORCH_SOURCE
    local py="$1" torch="$2"
    case "$py" in
        2.*|3.[0-7]) echo "Python $py: the agent needs Python >= 3.8 (use --python)"; return ;;
    esac
    case "$BOARD" in
        jetson)
            if [[ "$JETPACK_PYTHON" == 3.6 && "$torch" != pypi ]]; then
                echo "JetPack 4 (Jetson Nano, TX2) ships Python 3.6 and NVIDIA's torch wheels for it stop at 1.10, below the agent's Python 3.8 and torch 2.0: unsupported as shipped. On a community Ubuntu 20.04 image for these boards (Python 3.8) the agent runs on the CPU: --python python3.8 --torch-from-pypi"
            elif [[ "$torch" == none ]]; then
                echo "no CUDA torch for this Jetson (PyPI's aarch64 torch is CPU-only): download NVIDIA's wheel for JetPack $JETPACK, Python $JETPACK_PYTHON, from ${TORCH_INDEX:-NVIDIA}, and pass --torch-wheel PATH; on an image whose Python already has it, --system-site-packages --skip-torch; --torch-from-pypi for a CPU-only agent"
            fi ;;
        raspberry-pi)
            [[ "$MACHINE" == aarch64 ]] || echo "a 32-bit system ($MACHINE): torch publishes no wheels for it; install the 64-bit Raspberry Pi OS (aarch64)" ;;
    esac
}
