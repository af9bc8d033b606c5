# FLUX.2-klein on AWS Trainium (Trn2, Trn3) with TorchNeuron, Neuron SDK 2.34 (2.33 still accepted:
# --build-arg NEURON_SDK=2.33): torch-neuronx 2.13.* with torch 2.13.0. The base is ubuntu:26.04 with its own
# python3 (3.14) in a venv and the Neuron runtime from the Neuron apt repository; for 2.34, --build-arg
# BASE_IMAGE=ubuntu:24.04 (Python 3.12) is offered again (2.34's 24.04 wheels unconfirmed: the build's
# doctor --stack fails if the wheel does not load). Every command here is explained in docs/deploy-trn.md.
#
#   docker build -t flux2-klein-trn .
#   docker run --device=/dev/neuron0 -p 7860:7860 -v neuron-app-cache:/var/cache/neuron-app flux2-klein-trn
#
# Alternative base: a Neuron "PyTorch Training (TorchNeuron)" DLC, which already carries torch-neuronx with its
# torch and the runtime; only requirements-common.txt is installed into it:
#   docker build --build-arg BASE_IMAGE=<that DLC's image> --build-arg NEURON_STACK=present -t flux2-klein-trn .
ARG BASE_IMAGE=ubuntu:26.04
FROM ${BASE_IMAGE}

# install: the Neuron runtime (apt) and a venv with NEURON_REQUIREMENTS (empty: the release's own file,
# requirements-neuron.txt for 2.34, requirements-neuron-2.33.txt for 2.33; requirements-neuron-2.14.txt: torch
# 2.14); present: the base already has TorchNeuron, add the app's packages only.
ARG NEURON_STACK=install
ARG NEURON_SDK=2.34
ARG NEURON_REQUIREMENTS=
# The runtime packages' versions: empty takes the release's own from scripts/install-neuron.sh (2.34: runtime-lib
# and collectives 2.36.*, tools 2.34.*; 2.33: 2.35.30.0, 2.35.43.0, 2.33.38.0; docs/deploy-trn.md, "Versions");
# the driver is on the host. The Neuron apt suite: empty is the base's codename.
ARG NEURON_RUNTIME_VERSION=
ARG NEURON_COLLECTIVES_VERSION=
ARG NEURON_TOOLS_VERSION=
ARG NEURON_APT_SUITE=

# LD_LIBRARY_PATH as AWS's own Neuron containers set it (libnrt, libnccom), kept after the base image's own entries.
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:/opt/aws/neuron/bin:$PATH \
    LD_LIBRARY_PATH=/opt/aws/neuron/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
    GRADIO_ANALYTICS_ENABLED=False \
    NEURON_APP_DEVICE=neuron \
    NEURON_APP_SERVER_NAME=0.0.0.0 \
    NEURON_APP_SERVER_PORT=7860 \
    NEURON_APP_CACHE_DIR=/var/cache/neuron-app \
    HF_HOME=/var/cache/neuron-app/huggingface

WORKDIR /app
# The Neuron runtime (apt) and a venv with torch, torch-neuronx, neuronx-cc, nki and the app's packages (the ARGs
# above reach the script as environment variables), then Ray Serve into the same Python (WITH_REPLICAS=1), so that
# the image also serves NEURON_APP_REPLICAS=N on one instance (docs/replicas.md); the single-process quick start
# (requirements.txt) leaves it out.
COPY scripts/install-neuron.sh scripts/
COPY requirements-common.txt requirements-nodeps.txt requirements-neuron*.txt requirements-replicas.txt ./
RUN WITH_REPLICAS=1 scripts/install-neuron.sh
COPY . .
# The build fails on a wrong stack (the PyTorch/XLA torch-neuronx, a torch that does not match, no compiler) and
# on a wheel that is installed but does not import here.
RUN python -m neuron_app doctor --stack

# Compiled graphs (NEFF), the manifest and the downloaded model: mount a named volume or an EBS-backed
# folder here, or every new container compiles every shape again. Precompiling needs the Neuron device,
# which `docker build` does not have: run it once into the volume with PRECOMPILE=1 (or
# `python -m neuron_app precompile` as the command), before or while serving.
VOLUME ["/var/cache/neuron-app"]
EXPOSE 7860

# Liveness only; readiness (model loaded, a shape compiled) is GET /readyz for the load balancer.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('NEURON_APP_SERVER_PORT', '7860'), timeout=4)"]

# No wrapper entrypoint: the command is the container's main process (the launch script execs the app), so
# `docker stop`'s SIGTERM reaches the app (graceful drain) and one-off commands such as precompile exit.
ENTRYPOINT []
# TP=N (tensor-parallel ranks, torchrun) and PRECOMPILE=1 are read by the launch script.
CMD ["scripts/launch-trn.sh"]
