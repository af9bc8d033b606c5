#!/usr/bin/env bash
# Install the TorchNeuron stack, as root: the Dockerfile runs it, and so can a trn2/trn3 instance.
# NEURON_SDK picks the release: 2.34 (default) or 2.33 (still accepted; docs/deploy-trn.md, "Versions").
#
#   NEURON_STACK=install (default): Ubuntu 26.04 (2.33 and 2.34) or 24.04 (2.34 only, see below).
#     - the Neuron runtime from the Neuron apt repository (aws-neuronx-runtime-lib, aws-neuronx-collectives,
#       aws-neuronx-tools): 2.33 pinned to its component versions; 2.34 pinned to its release's series (no
#       source read for this project lists 2.34's exact versions: see the 2.34 row), and what was installed is
#       written to $VENV/neuron-sdk.txt;
#     - a virtual environment in $VENV (default /opt/venv) from Ubuntu's own python3 (3.14 on 26.04, 3.12 on
#       24.04) with $NEURON_REQUIREMENTS (default: requirements-neuron.txt for 2.34, requirements-neuron-2.33.txt
#       for 2.33), then requirements-replicas.txt (Ray Serve) when WITH_REPLICAS=1.
#   NEURON_STACK=present: the Python in $VENV already has TorchNeuron (the DLAMI's
#     /opt/aws_neuronx_venv_torch_neuronx_2_14_0, or a Neuron DLC's python3 when $VENV does not exist): only
#     requirements-common.txt is installed, with the torch, torch-neuronx, neuronx-cc and nki found there held
#     at their versions (no downgrade of the DLAMI's stack); nothing comes from apt.
#   NEURON_STACK=host: the host side of a bare instance, never a container: the Neuron apt repository, then
#     `apt-get update`, the kernel headers and the driver (aws-neuronx-dkms); run it before the install mode.
# On an Ubuntu release the chosen SDK has no wheels for, the script stops (exit 2) unless ALLOW_OTHER_OS=1.
set -euo pipefail
cd "$(dirname "$0")/.."

NEURON_STACK="${NEURON_STACK:-install}"
NEURON_SDK="${NEURON_SDK:-2.34}"
VENV="${VENV:-/opt/venv}"
export DEBIAN_FRONTEND=noninteractive

# Per release: the apt versions (empty: the repository's newest) and the Ubuntu releases with wheels.
case "$NEURON_SDK" in
2.34)
    # 2.34.0 (2026-11-30). Its package list was in no source this project could read, so each package is pinned
    # to its 2.34 series: every release from 2.30 to 2.33 shipped runtime-lib and collectives as 2.(N+2).*, tools
    # as 2.N.* and the driver as 2.(N-2).* (AWS's release content pages, docs/deploy-trn.md "Versions"), so 2.34's
    # are 2.36.*, 2.36.*, 2.34.* and 2.32.*: never 2.35's. A series the repository lacks stops the install with
    # the versions it has (check_pins). 24.04 wheels promised by TorchNeuron 2.33's notes for "the next release"
    # (unconfirmed for 2.34 by a stored source: doctor --stack fails the build if the wheel does not load).
    SDK_RUNTIME=2.36. SDK_COLLECTIVES=2.36. SDK_TOOLS=2.34. SDK_DRIVER=2.32. SDK_UBUNTU="24.04 26.04"
    SDK_REQUIREMENTS=requirements-neuron.txt
    ;;
2.33)
    # Neuron SDK 2.33.0 (its release notes' component index).
    SDK_RUNTIME=2.35.30.0 SDK_COLLECTIVES=2.35.43.0 SDK_TOOLS=2.33.38.0 SDK_DRIVER=2.31.7.0 SDK_UBUNTU="26.04"
    SDK_REQUIREMENTS=requirements-neuron-2.33.txt
    ;;
*)
    echo "error: NEURON_SDK must be 2.34 or 2.33, got '$NEURON_SDK'" >&2
    exit 2
    ;;
esac
NEURON_RUNTIME_VERSION="${NEURON_RUNTIME_VERSION:-$SDK_RUNTIME}"
NEURON_COLLECTIVES_VERSION="${NEURON_COLLECTIVES_VERSION:-$SDK_COLLECTIVES}"
NEURON_TOOLS_VERSION="${NEURON_TOOLS_VERSION:-$SDK_TOOLS}"
NEURON_DRIVER_VERSION="${NEURON_DRIVER_VERSION:-$SDK_DRIVER}"
NEURON_REQUIREMENTS="${NEURON_REQUIREMENTS:-$SDK_REQUIREMENTS}"

# "name=version*" for apt, or the bare name (the repository's newest) when no version is pinned.
apt_pin() { if [[ -n "$2" ]]; then echo "$1=$2*"; else echo "$1"; fi; }
# Each pinned package must have a version in its pin's series in the repository, else stop naming what it has and
# the variable that overrides the pin (apt's own "not found" names neither). Lines: "package variable version"
# (the version last: an empty one, the repository's newest, is then no check).
check_pins() {
    local package variable pin found
    while read -r package variable pin; do
        [[ -n "$pin" ]] || continue
        found="$(apt-cache madison "$package" | awk -F'|' '{gsub(/ /, "", $2); print $2}')"
        if ! grep -qxF -- "$pin" <<<"$(cut -c1-${#pin} <<<"$found")"; then
            echo "error: Neuron $NEURON_SDK pins $package to $pin*, the repository has: $(tr '\n' ' ' <<<"$found")" \
                "- set $variable to one of them (docs/deploy-trn.md, \"Versions\")" >&2
            exit 2
        fi
    done
}

if [[ "$NEURON_STACK" == present ]]; then
    PY="$VENV/bin/python"
    [[ -x "$PY" ]] || PY="$(command -v python3)"
    if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch_neuronx") is None)'; then
        echo "error: NEURON_STACK=present, but $PY has no torch_neuronx: point VENV at the TorchNeuron" \
            "environment (e.g. /opt/aws_neuronx_venv_torch_neuronx_2_14_0) or use NEURON_STACK=install" >&2
        exit 2
    fi
    held="$(mktemp)"
    "$PY" - >"$held" <<'PY'
import importlib.metadata as m

for dist in ("torch", "torch-neuronx", "neuronx-cc", "nki"):
    try:
        print(f"{dist}=={m.version(dist)}")
    except m.PackageNotFoundError:
        pass
PY
    echo "keeping $(tr '\n' ' ' <"$held")in $PY" >&2
    "$PY" -m pip install --no-cache-dir -r requirements-common.txt -c "$held"
    "$PY" -m pip install --no-cache-dir --no-deps -r requirements-nodeps.txt
    if [[ "${WITH_REPLICAS:-0}" == 1 ]]; then
        "$PY" -m pip install --no-cache-dir -r requirements-replicas.txt -c "$held"
    fi
    rm -f "$held"
    exit 0
elif [[ "$NEURON_STACK" != install && "$NEURON_STACK" != host ]]; then
    echo "error: NEURON_STACK must be install, present or host, got '$NEURON_STACK'" >&2
    exit 2
fi

# shellcheck source=/dev/null
. "${OS_RELEASE:-/etc/os-release}"
if [[ "$NEURON_STACK" == install && " $SDK_UBUNTU " != *" ${VERSION_ID:-none} "* ]]; then
    message="the Neuron $NEURON_SDK TorchNeuron wheels are built for Ubuntu $SDK_UBUNTU, this is ${PRETTY_NAME:-unknown}"
    if [[ "${ALLOW_OTHER_OS:-0}" != 1 ]]; then
        echo "error: $message; use the Neuron DLAMI (NEURON_STACK=present), another NEURON_SDK, or ALLOW_OTHER_OS=1" \
            "to try anyway" >&2
        exit 2
    fi
    echo "warning: $message (ALLOW_OTHER_OS=1); doctor --stack fails if the wheel does not import" >&2
fi
apt-get update
apt-get install -y --no-install-recommends ca-certificates gnupg wget
install -m 0755 -d /etc/apt/keyrings
wget -qO - https://apt.repos.neuron.amazonaws.com/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB |
    gpg --batch --yes --dearmor -o /etc/apt/keyrings/neuron.gpg
# The suite is the OS codename unless NEURON_APT_SUITE names another (the 26.04 suite name is unconfirmed).
echo "deb [signed-by=/etc/apt/keyrings/neuron.gpg] https://apt.repos.neuron.amazonaws.com" \
    "${NEURON_APT_SUITE:-${VERSION_CODENAME}} main" >/etc/apt/sources.list.d/neuron.list
apt-get update

if [[ "$NEURON_STACK" == host ]]; then
    check_pins <<<"aws-neuronx-dkms NEURON_DRIVER_VERSION $NEURON_DRIVER_VERSION"
    # The package lists stay: `apt-get install aws-neuronx-dkms` later, or an upgrade, needs them.
    apt-get install -y --no-install-recommends "linux-headers-$(uname -r)" \
        "$(apt_pin aws-neuronx-dkms "$NEURON_DRIVER_VERSION")"
    echo "driver installed; check with: lsmod | grep neuron && ls /dev/neuron*" >&2
    exit 0
fi

check_pins <<EOF
aws-neuronx-runtime-lib NEURON_RUNTIME_VERSION $NEURON_RUNTIME_VERSION
aws-neuronx-collectives NEURON_COLLECTIVES_VERSION $NEURON_COLLECTIVES_VERSION
aws-neuronx-tools NEURON_TOOLS_VERSION $NEURON_TOOLS_VERSION
EOF
apt-get install -y --no-install-recommends python3 python3-venv g++ \
    "$(apt_pin aws-neuronx-runtime-lib "$NEURON_RUNTIME_VERSION")" \
    "$(apt_pin aws-neuronx-collectives "$NEURON_COLLECTIVES_VERSION")" \
    "$(apt_pin aws-neuronx-tools "$NEURON_TOOLS_VERSION")"
installed_debs="$(dpkg-query -W -f='${Package}==${Version}\n' aws-neuronx-runtime-lib aws-neuronx-collectives \
    aws-neuronx-tools)"
rm -rf /var/lib/apt/lists/*

python3 -m venv "$VENV"
if ! "$VENV/bin/python" -c 'import sys; sys.exit(not (3, 12) <= sys.version_info[:2] <= (3, 14))'; then
    echo "error: $("$VENV/bin/python" -V) here; TorchNeuron ships for Python 3.12-3.14" >&2
    exit 2
fi
"$VENV/bin/python" -m pip install --no-cache-dir --upgrade pip
"$VENV/bin/python" -m pip install --no-cache-dir -r "$NEURON_REQUIREMENTS"
"$VENV/bin/python" -m pip install --no-cache-dir --no-deps -r requirements-nodeps.txt
if [[ "${WITH_REPLICAS:-0}" == 1 ]]; then
    "$VENV/bin/python" -m pip install --no-cache-dir -r requirements-replicas.txt
fi
# What this release resolved to (2.34's exact builds come from the repository, within the pinned series):
# `python -m neuron_app doctor` shows the file's first line.
{
    echo "Neuron SDK $NEURON_SDK on Ubuntu ${VERSION_ID:-?} ($NEURON_REQUIREMENTS)"
    echo "$installed_debs"
    "$VENV/bin/python" -m pip freeze | grep -E '^(torch|torch-neuronx|torch_neuronx|neuronx-cc|neuronx_cc|nki)==' || true
} >"$VENV/neuron-sdk.txt"
