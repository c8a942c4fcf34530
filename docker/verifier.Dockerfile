# The verifier: the target model, its paged KV cache and the rejection sampler.
#
# GPU image (default): CUDA runtime base and torch's CUDA build.
#   docker build -f docker/verifier.Dockerfile -t specsplit-verifier:0.1.0-cuda .
# CPU image (the cpu-demo overlay):
#   docker build -f docker/verifier.Dockerfile -t specsplit-verifier:0.1.0-cpu \
#     --build-arg BASE_IMAGE=debian:bookworm-slim --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && groupadd --system --gid 10001 specsplit \
    && useradd --system --uid 10001 --gid specsplit --no-create-home --shell /usr/sbin/nologin specsplit
# torch first, in its own layer: the largest and the least often changed.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/specsplit
COPY pyproject.toml README.md src/
COPY specsplit src/specsplit
# [coordinator] too: the co-located overlay runs all three services in this image (`specsplit up`).
RUN pip install "./src[worker,coordinator]" && rm -rf src

# The demo checkpoint; real models are mounted at /models (docker/k8s/overlays/pooled, colocated). Without
# arguments the service runs the demo on the CPU; Kubernetes passes --device and --dtype.
COPY checkpoints/demo checkpoints/demo
COPY docker/healthcheck.py healthcheck.py

USER 10001:10001
EXPOSE 50052 9464
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/specsplit/healthcheck.py", "127.0.0.1:50052", "specsplit.v1.Verifier"]
ENTRYPOINT ["specsplit", "serve", "verifier"]
# The default placement, colocated: one drafter beside this verifier (same GPU, a shared $TMPDIR for the
# sockets, as the coordinator's); docker/k8s/overlays/pooled passes --placement=pooled and a dns:/// name.
# On a GPU, verifier and drafter each take --gpu-memory-utilization of it (default 0.9): on one GPU give them
# shares that add up below 1, e.g. 0.8 here and 0.1 to the drafter (docs/deployment.md).
CMD ["--host", "0.0.0.0", "--port", "50052", "--metrics-port", "9464", "--drafter", "specsplit-drafter:50053", \
     "--model", "/opt/specsplit/checkpoints/demo"]
