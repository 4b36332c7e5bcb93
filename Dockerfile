# Metrale: one image for the gateway and the workers (`met gateway`, `met worker`).
# CPU torch by default; for CUDA workers build with
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MET_CACHE_DIR=/data/cache

WORKDIR /app
# A C compiler for the CPU kernels, compiled for the host's CPU when a worker first runs them.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# torch first, from the chosen index (its pin is the one in pyproject.toml), so `pip install .`
# finds it satisfied and never pulls the default CUDA wheel into a CPU image.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY metrale ./metrale
RUN pip install --no-cache-dir . && met --help > /dev/null

# Models (the built-in tiny one is written here on first start) and checkpoints.
VOLUME /data
EXPOSE 8000
ENTRYPOINT []
CMD ["met", "--help"]
