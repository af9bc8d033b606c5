#!/usr/bin/env bash
# Start the FLUX.2-klein app on a Trainium instance: on a Neuron DLAMI (no Docker) or as the
# Docker image's command. Settings are NEURON_APP_* variables (see settings.toml); this script adds:
#
#   TP=N|auto     tensor-parallel degree: one group (NEURON_APP_REPLICAS=1) of N > 1 starts
#                 `torchrun --nproc_per_node=N app.py`, one rank per NeuronCore (N must divide the transformer's
#                 heads); several copies (NEURON_APP_REPLICAS > 1 or auto) start `python app.py`, whose Ray Serve
#                 replicas are the groups; auto: the plan's (python -m neuron_app topology); default 1
#   PRECOMPILE=1  compile the configured shapes into the cache folder before serving (TP=1:
#                 `python -m neuron_app precompile`; TP>1: the served ranks compile them at start, warmup=all)
#   PRECOMPILE_RESOLUTIONS="1024x1024 768x1344"   only these shapes (default: every configured one)
#
#   NEURON_APP_VISIBLE_CORES=2-3  the NeuronCores this server lays its copy on. With TP>1 the group takes the
#                 first aligned block of TP cores there, one core per rank (the topology: python -m neuron_app
#                 topology); several TP groups per instance are replicas (NEURON_APP_REPLICAS, docs/replicas.md)
#
# Needs the TorchNeuron stack (Neuron SDK 2.34 or 2.33, torch-neuronx==2.13.* with torch==2.13.0, Python 3.12+):
# the Docker image, a Neuron DLAMI's TorchNeuron environment, or scripts/install-neuron.sh. It is checked
# first with `python -m neuron_app doctor --stack`, which refuses the PyTorch/XLA torch-neuronx.
set -euo pipefail
cd "$(dirname "$0")/.."

TP="${TP:-${NEURON_APP_TP_DEGREE:-1}}"
PRECOMPILE="${PRECOMPILE:-0}"
export NEURON_APP_DEVICE="${NEURON_APP_DEVICE:-neuron}"
# Compiled graphs (NEFF), the manifest and the model download live here: keep it on a persistent
# volume (EBS), never /tmp, or every restart recompiles for minutes.
export NEURON_APP_CACHE_DIR="${NEURON_APP_CACHE_DIR:-/var/cache/neuron-app}"
export HF_HOME="${HF_HOME:-$NEURON_APP_CACHE_DIR/huggingface}"
export NEURON_APP_SERVER_NAME="${NEURON_APP_SERVER_NAME:-0.0.0.0}"
export NEURON_APP_SERVER_PORT="${NEURON_APP_SERVER_PORT:-7860}"
export GRADIO_ANALYTICS_ENABLED="${GRADIO_ANALYTICS_ENABLED:-False}"
mkdir -p "$NEURON_APP_CACHE_DIR"

if ! [[ "$TP" =~ ^([1-9][0-9]*|auto)$ ]]; then
    echo "error: TP must be a positive whole number or auto, got '$TP'" >&2
    exit 2
fi
if ((TP > 1)) && [[ -n "${NEURON_RT_VISIBLE_CORES:-}" ]]; then
    # TorchNeuron keeps a user's NEURON_RT_VISIBLE_CORES for every rank (a range trips its one-core-per-rank
    # assert); the app exports each rank's own core from the topology instead.
    echo "error: TP=$TP: unset NEURON_RT_VISIBLE_CORES; name the cores with NEURON_APP_VISIBLE_CORES" >&2
    exit 2
fi
if [[ "$NEURON_APP_DEVICE" == neuron ]] && ! python -m neuron_app doctor --stack >&2; then
    echo "error: the TorchNeuron stack is not ready in $(command -v python) (see the doctor's lines above):" \
        "use the Docker image, a Neuron DLAMI's TorchNeuron environment or scripts/install-neuron.sh" >&2
    exit 2
fi

# The topology (copies x TP x placement on aligned core blocks), chosen once here and exported: the app, its
# replicas and every torchrun rank read it; one that does not fit the cores held stops here, in one line.
NEURON_APP_TOPOLOGY="$(NEURON_APP_TP_DEGREE="$TP" python -m neuron_app topology --json)" || exit 2
export NEURON_APP_TOPOLOGY
read -r TP COPIES < <(python -c 'import json, os; t = json.loads(os.environ["NEURON_APP_TOPOLOGY"]); print(t["tp"], t["copies"])')
GROUP=0 # one TP group without Ray: torchrun
if ((TP > 1 && COPIES == 1)) && [[ -z "${NEURON_APP_RAY_ADDRESS:-}" ]]; then
    GROUP=1
fi

if [[ "$PRECOMPILE" == 1 ]]; then
    if ((TP > 1)); then
        # The precompile command is a single process; sharded graphs are compiled by the served ranks.
        export NEURON_APP_WARMUP="${NEURON_APP_WARMUP:-all}"
    else
        args=()
        if [[ -n "${PRECOMPILE_RESOLUTIONS:-}" ]]; then
            read -r -a shapes <<<"$PRECOMPILE_RESOLUTIONS"
            args=(--resolutions "${shapes[@]}")
        fi
        status=0
        python -m neuron_app precompile "${args[@]}" || status=$?
        if ((status == 2)); then
            exit 2 # bad settings: serving would fail the same way
        elif ((status != 0)); then
            echo "warning: some shapes failed to precompile; they compile again on first use" >&2
        fi
    fi
fi

if ((GROUP)); then
    # Every rank reads the exported topology and takes its own core of the group's block before torch touches
    # the device; the group's rendezvous port is MASTER_PORT (set one per group when several run on a host).
    exec torchrun --nproc_per_node="$TP" --master-port="${MASTER_PORT:-29500}" app.py
fi
exec python app.py
