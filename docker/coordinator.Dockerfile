# The coordinator: request state, scheduling, the client-facing API. CPU only, and no torch in the
# image (the last RUN fails the build if anything pulled it in). One image serves CPU and GPU setups.
#
#   docker build -f docker/coordinator.Dockerfile -t specsplit-coordinator:0.1.0 .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

RUN groupadd --system --gid 10001 specsplit \
    && useradd --system --uid 10001 --gid specsplit --no-create-home --shell /usr/sbin/nologin specsplit

WORKDIR /opt/specsplit
COPY pyproject.toml README.md src/
COPY specsplit src/specsplit
RUN pip install "./src[coordinator]" \
    && rm -rf src \
    && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"

# The demo checkpoint (the coordinator reads only its tokenizer); real models are mounted over it.
COPY checkpoints/demo checkpoints/demo
COPY docker/healthcheck.py healthcheck.py

USER 10001:10001
# 50051: the gRPC API; 8000: the OpenAI-compatible HTTP API; 9464: Prometheus metrics.
EXPOSE 50051 8000 9464
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/specsplit/healthcheck.py", "127.0.0.1:50051", "specsplit.v1.Coordinator"]
ENTRYPOINT ["specsplit", "serve", "coordinator"]
# Beside its verifier: it reaches it on the verifier's Unix socket, so the two share $TMPDIR (or --socket-dir).
CMD ["--host", "0.0.0.0", "--port", "50051", "--http-port", "8000", "--metrics-port", "9464", \
     "--model", "/opt/specsplit/checkpoints/demo", "--verifier", "specsplit-verifier:50052"]
