#!/usr/bin/env bash
# Start the FLUX.2-klein app on a Trainium instance: on a Neuron DLAMI (no Docker) or as the
# Docker image's command. Settings are NEURON_APP_* variables (see settings.toml); this script adds:
#
#   TP=N          tensor-parallel degree: N > 1 starts `torchrun --nproc_per_node=N app.py`, one rank per
#                 NeuronCore (N must divide the transformer's 24 heads: 2, 4, 6, 8); default 1 = `python app.py`
#   PRECOMPILE=1  compile the configured shapes into the cache folder before serving (TP=1:
#                 `python -m neuron_app precompile`; TP>1: the served ranks compile them at start, warmup=all)
#   PRECOMPILE_RESOLUTIONS="1024x1024 768x1344"   only these shapes (default: every configured one)
#
# On a Neuron DLAMI, activate the SDK's PyTorch environment and install the app's packages first:
#   source /opt/aws_neuronx_venv_pytorch_*/bin/activate     (the name depends on the DLAMI release)
#   pip install -r requirements-neuron.txt
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

if ! [[ "$TP" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: TP must be a positive whole number, got '$TP'" >&2
    exit 2
fi
if [[ "$NEURON_APP_DEVICE" == neuron ]] && ! python -c "import torch_neuronx" 2>/dev/null; then
    echo "error: torch_neuronx is not importable from $(command -v python): activate the Neuron PyTorch" \
        "environment (source /opt/aws_neuronx_venv_pytorch_*/bin/activate) or use the Docker image" >&2
    exit 2
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

if ((TP > 1)); then
    exec torchrun --nproc_per_node="$TP" app.py
fi
exec python app.py
