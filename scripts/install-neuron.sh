#!/usr/bin/env bash
# Install the TorchNeuron stack on Ubuntu 24.04, as root: the Dockerfile runs it, and so can a bare trn2/trn3
# instance (after the Neuron driver, aws-neuronx-dkms, which lives on the host, not in a container).
#   - the Neuron runtime (aws-neuronx-runtime-lib, aws-neuronx-collectives, aws-neuronx-tools) from the
#     Neuron apt repository;
#   - a Python 3.12 virtual environment in $VENV (default /opt/venv) with requirements-neuron.txt:
#     torch==2.13.0, torch-neuronx==2.13.* (TorchNeuron, Neuron SDK 2.33+), neuronx-cc, nki and the app's packages.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-/opt/venv}"
export DEBIAN_FRONTEND=noninteractive

apt-get update
apt-get install -y --no-install-recommends ca-certificates gnupg wget python3.12 python3.12-venv g++
# shellcheck source=/dev/null
. /etc/os-release
install -m 0755 -d /etc/apt/keyrings
wget -qO - https://apt.repos.neuron.amazonaws.com/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB |
    gpg --batch --yes --dearmor -o /etc/apt/keyrings/neuron.gpg
echo "deb [signed-by=/etc/apt/keyrings/neuron.gpg] https://apt.repos.neuron.amazonaws.com ${VERSION_CODENAME} main" \
    >/etc/apt/sources.list.d/neuron.list
apt-get update
apt-get install -y --no-install-recommends aws-neuronx-runtime-lib aws-neuronx-collectives aws-neuronx-tools
rm -rf /var/lib/apt/lists/*

python3.12 -m venv "$VENV"
"$VENV/bin/python" -m pip install --no-cache-dir --upgrade pip
"$VENV/bin/python" -m pip install --no-cache-dir -r requirements-neuron.txt
