# syntax=docker/dockerfile:1
# Ember's image. One image runs every process: `ember serve` (API + pools controller),
# `ember worker`, `ember beat`, and the replicas the controller starts (`ember engine`);
# deploy/k8s runs each with `command: ["ember"]` and its own args. Two variants:
#
#   docker build --target cuda -t ember:0.1.0 .       # GPU nodes (torch CUDA build, vLLM)
#   docker build --target cpu  -t ember:0.1.0-cpu .   # CPU only (torch CPU build, no vLLM)
#
# Both run as the unprivileged uid/gid 10001 (the manifests' runAsUser, and the owner the
# GPU nodes' bootstrap gives the NVMe cache), with `ember` on PATH from /opt/ember/.venv.
# The CUDA variant also has vLLM in its own virtualenv, /opt/ember/.venv-vllm (vLLM pins
# its own versions of much of what Ember uses): the local replica backend runs vLLM
# versions with the `ember` of `.venv-vllm` beside its own virtualenv, as on a developer's
# machine (scripts/vllm-venv.sh). Nothing secret is in the image: the database and Redis
# URLs and the admin key come from the environment at run time (deploy/k8s: the Secret
# ember-secrets). tests/infra/test_image.py lints this file with hadolint and runs every
# command the image and the manifests run, from the development venv.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# CUDA 13.0: what torch 2.13.0's Linux wheels on PyPI are built for (they bring their own
# CUDA libraries as pip packages, so the slim `base` flavour is enough; it carries the
# driver requirement, NVIDIA_REQUIRE_CUDA, that the NVIDIA container toolkit checks).
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.8

FROM ${UV_IMAGE} AS uv

# --- CPU ----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    UV_NO_CACHE=1 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    VIRTUAL_ENV=/opt/ember/.venv \
    PATH=/opt/ember/.venv/bin:$PATH \
    HOME=/home/ember \
    EMBER_DATA_DIR=/var/lib/ember \
    EMBER_HOST=0.0.0.0
COPY --from=uv /uv /usr/local/bin/uv
# redis-server: `ember up` (one machine, embedded defaults) starts its own Redis.
# DL3008 (pin apt versions): the base image's archive drops superseded versions, so a
# pin breaks the build at the next security update; the base image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 ember \
    && useradd --uid 10001 --gid 10001 --home-dir /home/ember --create-home \
        --shell /usr/sbin/nologin ember \
    && install -d -o 10001 -g 10001 /var/lib/ember
# torch first, in a layer of its own (large, changes rarely), and kept as a constraint so
# that nothing installed later replaces the CPU build with PyPI's CUDA one.
RUN uv venv --python /usr/local/bin/python3.11 /opt/ember/.venv \
    && uv pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}" \
    && uv pip freeze | grep -i '^torch==' > /opt/ember/constraints.txt
COPY pyproject.toml README.md /opt/ember/src/
COPY ember /opt/ember/src/ember
RUN uv pip install --constraint /opt/ember/constraints.txt "/opt/ember/src[engine]" \
    && rm -rf /opt/ember/src \
    && ember --help > /dev/null
WORKDIR /var/lib/ember
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["ember"]
CMD ["serve"]

# --- CUDA ---------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS cuda
ARG TORCH_VERSION=2.13.0
# Keep in step with scripts/vllm-venv.sh (the CPU build of the same release).
ARG VLLM_VERSION=0.32.0
# 0: no vLLM (an image several GB smaller, for torch and transformers versions only).
ARG WITH_VLLM=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    UV_NO_CACHE=1 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    VIRTUAL_ENV=/opt/ember/.venv \
    PATH=/opt/ember/.venv/bin:$PATH \
    HOME=/home/ember \
    EMBER_DATA_DIR=/var/lib/ember \
    EMBER_HOST=0.0.0.0
COPY --from=uv /uv /usr/local/bin/uv
# DL3008: as in the CPU stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 ember \
    && useradd --uid 10001 --gid 10001 --home-dir /home/ember --create-home \
        --shell /usr/sbin/nologin ember \
    && install -d -o 10001 -g 10001 /var/lib/ember
# Ubuntu 24.04 has no Python 3.11: a standalone CPython build (python-build-standalone,
# through uv) under /opt/python serves both virtualenvs.
RUN uv python install 3.11 \
    && uv venv --python 3.11 /opt/ember/.venv \
    && uv pip install "torch==${TORCH_VERSION}" nvidia-ml-py \
    && uv pip freeze | grep -i '^torch==' > /opt/ember/constraints.txt
# vLLM and everything it pins, before Ember's source (so a code change rebuilds neither);
# what it installed becomes the constraints Ember's own dependencies are resolved under.
RUN if [ "$WITH_VLLM" = 1 ]; then \
        uv venv --python 3.11 /opt/ember/.venv-vllm \
        && uv pip install --python /opt/ember/.venv-vllm/bin/python \
            "vllm==${VLLM_VERSION}" "torch==${TORCH_VERSION}" nvidia-ml-py \
        && uv pip freeze --python /opt/ember/.venv-vllm/bin/python \
            > /opt/ember/vllm-constraints.txt; \
    fi
COPY pyproject.toml README.md /opt/ember/src/
COPY ember /opt/ember/src/ember
RUN uv pip install --constraint /opt/ember/constraints.txt "/opt/ember/src[engine]" \
    && if [ "$WITH_VLLM" = 1 ]; then \
        uv pip install --python /opt/ember/.venv-vllm/bin/python \
            --constraint /opt/ember/vllm-constraints.txt /opt/ember/src \
        && /opt/ember/.venv-vllm/bin/python -c "import vllm, ember.engine.vllm_plugin"; \
    fi \
    && rm -rf /opt/ember/src \
    && ember --help > /dev/null
WORKDIR /var/lib/ember
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["ember"]
CMD ["serve"]
