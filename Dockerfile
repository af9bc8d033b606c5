# FLUX.2-klein on AWS Trainium, on an AWS Neuron PyTorch inference Deep Learning Container, which
# brings torch, torch-neuronx and the Neuron compiler (tags: https://github.com/aws-neuron/deep-learning-containers).
# Every command here is explained in README.md ("Deploy on a trn instance").
#
#   docker build -t flux2-klein-trn .
#   docker run --device=/dev/neuron0 -p 7860:7860 -v neuron-app-cache:/var/cache/neuron-app flux2-klein-trn
ARG BASE_IMAGE=public.ecr.aws/neuron/pytorch-inference-neuronx:2.9.0-neuronx-py312-sdk2.31.0-ubuntu24.04
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GRADIO_ANALYTICS_ENABLED=False \
    NEURON_APP_DEVICE=neuron \
    NEURON_APP_SERVER_NAME=0.0.0.0 \
    NEURON_APP_SERVER_PORT=7860 \
    NEURON_APP_CACHE_DIR=/var/cache/neuron-app \
    HF_HOME=/var/cache/neuron-app/huggingface

WORKDIR /app
# The app's packages only: requirements-neuron.txt pins no torch, so the image's Neuron build stays.
COPY requirements-common.txt requirements-neuron.txt ./
RUN pip install --no-cache-dir -r requirements-neuron.txt
COPY . .

# Compiled graphs (NEFF), the manifest and the downloaded model: mount a named volume or an EBS-backed
# folder here, or every new container compiles every shape again. Precompiling needs the Neuron device,
# which `docker build` does not have: run it once into the volume with PRECOMPILE=1 (or
# `python -m neuron_app precompile` as the command), before or while serving.
VOLUME ["/var/cache/neuron-app"]
EXPOSE 7860

# Liveness only; readiness (model loaded, a shape compiled) is GET /readyz for the load balancer.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('NEURON_APP_SERVER_PORT', '7860'), timeout=4)"]

# TP=N (tensor-parallel ranks, torchrun) and PRECOMPILE=1 are read by the launch script.
CMD ["scripts/launch-trn.sh"]
