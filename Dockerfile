# ftjob images: one file, two targets (docs/install.md, "Build the images"):
#   docker build --target operator -t ghcr.io/ftjob/operator:0.1.0 .
#   docker build --target trainer  -t ghcr.io/ftjob/trainer:0.1.0 .
#   docker build --target trainer --build-arg EFA=true -t ghcr.io/ftjob/trainer:0.1.0-efa .
#   docker build --target trainer --build-arg FLASH_ATTN=true ...   # optional flash-attn
# What each target pip-installs is checked against pyproject.toml's extras and
# constraints.txt by tests/unit/test_dockerfile.py; hadolint runs in the same test.
# CI builds both targets from this file with podman on stand-in bases and runs them
# (scripts/images.sh, tests/images/).

# Bases, pinned by tag. The trainer base must carry the torch that constraints.txt pins
# (a test compares the tag with the pin), so pip never swaps it for another build.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
ARG TRAINER_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime

# ---------------------------------------------------------------------------------------
# operator: kopf + kubernetes client in a venv built here, copied into a clean slim image.
FROM ${PYTHON_IMAGE} AS operator-build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/ftjob
COPY constraints.txt /src/constraints.txt
# Dependencies first, source second: a code change rebuilds only the small last layer.
# The names are ftjob's dependencies + the "operator" extra (the test keeps them equal).
RUN /opt/ftjob/bin/pip install --no-cache-dir -c /src/constraints.txt \
      pyyaml jsonschema common-expression-language \
      kopf kubernetes prometheus-client
COPY pyproject.toml README.md /src/
COPY ftjob /src/ftjob
RUN /opt/ftjob/bin/pip install --no-cache-dir --no-deps /src

FROM ${PYTHON_IMAGE} AS operator
# Non-root; the Helm chart's securityContext runs as the same uid (a test checks).
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin ftjob
COPY --from=operator-build /opt/ftjob /opt/ftjob
ENV PATH=/opt/ftjob/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# 8080: kopf's liveness endpoint (/healthz); 9090: Prometheus metrics (/metrics).
EXPOSE 8080 9090
# For plain `docker run`; Kubernetes ignores HEALTHCHECK and uses the chart's probes on the
# same endpoint.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["ftjob"]
CMD ["operator", "--all-namespaces", "--liveness", "http://0.0.0.0:8080/healthz"]

# ---------------------------------------------------------------------------------------
# trainer: CUDA PyTorch runtime + the trainer extra; torch itself comes from the base.
FROM ${TRAINER_IMAGE} AS trainer
ARG EFA=false
ARG EFA_INSTALLER_VERSION=1.43.1
ARG FLASH_ATTN=false
ARG FLASH_ATTN_VERSION=2.8.3
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# EFA (AWS): libfabric with the efa provider and the aws-ofi-nccl plugin NCCL loads, both
# from AWS's EFA installer. No kernel module or limits file: the node provides those; the
# pod gets the devices through the vpc.amazonaws.com/efa resource. The build fails if the
# plugin is missing rather than producing an image that silently falls back to TCP; NCCL
# loads libnccl-net.so by default, so that name points at the plugin.
# The installer must run from its own folder (it finds its packages relative to it).
# hadolint ignore=DL3003
RUN if [ "${EFA}" = "true" ]; then \
      cd /tmp \
      && python -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], 'efa.tgz')" \
           "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
      && tar -xzf efa.tgz \
      && (cd aws-efa-installer && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify) \
      && fabric=$(find /opt/amazon/efa -name 'libfabric.so*' -print -quit) \
      && plugin=$(find /opt/amazon/ofi-nccl -name 'libnccl-net*.so' -print -quit) \
      && [ -n "${fabric}" ] && [ -n "${plugin}" ] \
      && plugins="$(dirname "${plugin}")" \
      && { [ -e "${plugins}/libnccl-net.so" ] || ln -s "${plugin}" "${plugins}/libnccl-net.so"; } \
      && rm -rf /tmp/efa.tgz /tmp/aws-efa-installer /var/lib/apt/lists/* \
      && { dirname "${fabric}"; echo "${plugins}"; } > /etc/ld.so.conf.d/efa.conf \
      && ldconfig; \
    fi
ENV PATH=/opt/amazon/efa/bin:$PATH

COPY constraints.txt /src/constraints.txt
# ftjob's dependencies + the "trainer", "qlora" and "tracking" extras, less torch (the base's,
# held by the pin): a QLoRA job finds torchao, a job's spec.tracking its tracker's client.
# flash-attn compiles against the base's torch and CUDA (without a prebuilt wheel it needs
# nvcc: build it with TRAINER_IMAGE=...-devel); off by default, sdpa needs nothing.
RUN pip install --no-cache-dir -c /src/constraints.txt \
      pyyaml jsonschema common-expression-language \
      transformers peft datasets safetensors tokenizers huggingface-hub obstore torchao trl prometheus-client rich \
      mlflow-skinny wandb tensorboard \
    && if [ "${FLASH_ATTN}" = "true" ]; then \
      pip install --no-cache-dir --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"; \
    fi
COPY pyproject.toml README.md /src/
COPY ftjob /src/ftjob
RUN pip install --no-cache-dir --no-deps /src \
    && python -c "import torch, ftjob.trainer, mlflow, wandb, torch.utils.tensorboard; print('torch', torch.__version__)" \
    && mkdir -p /home/ftjob && chown 1000:1000 /home/ftjob
# The operator's pods run as uid 1000 (fsGroup 1000 on the shared volume) with a read-only
# root filesystem and HOME=/tmp; USER and HOME here serve `docker run`.
ENV HOME=/home/ftjob \
    USER=ftjob
USER 1000:1000
WORKDIR /home/ftjob
CMD ["python", "-m", "ftjob.trainer", "--help"]
