#!/usr/bin/env bash
# Install the TorchNeuron stack of Neuron SDK 2.33, as root: the Dockerfile runs it, and so can a trn2/trn3
# instance (the Neuron driver, aws-neuronx-dkms, lives on the host: docs/deploy-trn.md, "Host driver").
#
#   NEURON_STACK=install (default): Ubuntu 26.04, which the 2.33 TorchNeuron wheels are built for.
#     - the Neuron runtime from the Neuron apt repository, pinned to the 2.33 versions below
#       (aws-neuronx-runtime-lib, aws-neuronx-collectives, aws-neuronx-tools);
#     - a virtual environment in $VENV (default /opt/venv) from Ubuntu's own python3 (3.14 on 26.04) with
#       $NEURON_REQUIREMENTS: requirements-neuron.txt (torch 2.13.0, torch-neuronx 2.13.3.0.*, the default) or
#       requirements-neuron-2.14.txt (torch 2.14.0, torch-neuronx 2.14.3.0.*), each with neuronx-cc, nki and
#       the app's packages.
#   NEURON_STACK=present: the Python in $VENV already has TorchNeuron (the 2.33 DLAMI's
#     /opt/aws_neuronx_venv_torch_neuronx_2_14_0, or a Neuron DLC's python3 when $VENV does not exist): only
#     requirements-common.txt is installed, with the torch, torch-neuronx, neuronx-cc and nki found there held
#     at their versions (no downgrade of the DLAMI's 2.14 stack); nothing comes from apt.
set -euo pipefail
cd "$(dirname "$0")/.."

NEURON_STACK="${NEURON_STACK:-install}"
VENV="${VENV:-/opt/venv}"
NEURON_REQUIREMENTS="${NEURON_REQUIREMENTS:-requirements-neuron.txt}"
# Neuron SDK 2.33.0 (its release notes' component index); the Dockerfile's ARGs carry the same defaults.
NEURON_RUNTIME_VERSION="${NEURON_RUNTIME_VERSION:-2.35.30.0}"
NEURON_COLLECTIVES_VERSION="${NEURON_COLLECTIVES_VERSION:-2.35.43.0}"
NEURON_TOOLS_VERSION="${NEURON_TOOLS_VERSION:-2.33.38.0}"
export DEBIAN_FRONTEND=noninteractive

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
    rm -f "$held"
    exit 0
elif [[ "$NEURON_STACK" != install ]]; then
    echo "error: NEURON_STACK must be install or present, got '$NEURON_STACK'" >&2
    exit 2
fi

# shellcheck source=/dev/null
. /etc/os-release
if [[ "${VERSION_ID:-}" != 26.04 ]]; then
    echo "warning: the Neuron 2.33 TorchNeuron wheels are built for Ubuntu 26.04 only, this is ${PRETTY_NAME:-unknown};" \
        "on Ubuntu 24.04 use the Neuron DLAMI (NEURON_STACK=present) or build torch-neuronx from source." \
        "doctor --stack fails if the wheel does not import" >&2
fi
apt-get update
apt-get install -y --no-install-recommends ca-certificates gnupg wget python3 python3-venv g++
install -m 0755 -d /etc/apt/keyrings
wget -qO - https://apt.repos.neuron.amazonaws.com/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB |
    gpg --batch --yes --dearmor -o /etc/apt/keyrings/neuron.gpg
echo "deb [signed-by=/etc/apt/keyrings/neuron.gpg] https://apt.repos.neuron.amazonaws.com ${VERSION_CODENAME} main" \
    >/etc/apt/sources.list.d/neuron.list
apt-get update
apt-get install -y --no-install-recommends \
    "aws-neuronx-runtime-lib=${NEURON_RUNTIME_VERSION}*" \
    "aws-neuronx-collectives=${NEURON_COLLECTIVES_VERSION}*" \
    "aws-neuronx-tools=${NEURON_TOOLS_VERSION}*"
rm -rf /var/lib/apt/lists/*

python3 -m venv "$VENV"
if ! "$VENV/bin/python" -c 'import sys; sys.exit(not (3, 12) <= sys.version_info[:2] <= (3, 14))'; then
    echo "error: $("$VENV/bin/python" -V) here; TorchNeuron 2.33 ships for Python 3.12-3.14" >&2
    exit 2
fi
"$VENV/bin/python" -m pip install --no-cache-dir --upgrade pip
"$VENV/bin/python" -m pip install --no-cache-dir -r "$NEURON_REQUIREMENTS"
"$VENV/bin/python" -m pip install --no-cache-dir --no-deps -r requirements-nodeps.txt
