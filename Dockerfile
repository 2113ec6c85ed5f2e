# The k3-subnet image: every console script (k3-miner, k3-validator, k3-chain, k3-localnet, ...), the
# tiny model tools and the local testnet, installed from constraints.txt. CPU build by default.
#
#   docker build -t k3-subnet .
#   docker run --rm k3-subnet k3-miner --help
#   docker compose up                      # devnet, two miners and a validator: see compose.yaml
#
# CUDA variant (NVIDIA GPUs): the same file with torch's CUDA wheels, which carry the CUDA runtime
# libraries themselves, so the slim base serves both; the host needs the NVIDIA driver and the NVIDIA
# container toolkit.
#   docker build -t k3-subnet:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --rm --gpus all k3-subnet:cuda k3-miner ...       (podman: --device nvidia.com/gpu=all)
# Pick the CUDA build of torch 2.13.0 that your driver supports (cu126, cu128, ...).
#
# Build arguments:
#   BASE             a Debian-based image with Python 3.11+ and its venv module
#   TORCH_INDEX_URL  the index torch==2.13.0 comes from; empty: the default index (and any find-links)
#   EXTRAS           extras of the project to install as well, e.g. "test"
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/k3 \
    PATH=/opt/k3/bin:$PATH

RUN python3 -m venv /opt/k3

# torch first, from its own index and without its dependencies (they come pinned with the project's)
COPY constraints.txt /tmp/k3/constraints.txt
RUN pip install --no-deps ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"

COPY pyproject.toml README.md LICENSE /tmp/k3/
COPY inference /tmp/k3/inference
COPY protocol /tmp/k3/protocol
COPY scoring /tmp/k3/scoring
COPY neurons /tmp/k3/neurons
COPY chain /tmp/k3/chain
RUN pip install -c /tmp/k3/constraints.txt "/tmp/k3${EXTRAS:+[$EXTRAS]}" \
    && rm -rf /tmp/k3 \
    && k3-chain --help > /dev/null

RUN useradd --create-home --uid 1000 k3 && mkdir -p /data && chown k3:k3 /data
USER k3
WORKDIR /data
VOLUME /data
# miner API and metrics (k3-miner --port / --metrics-port)
EXPOSE 8091 9091
CMD ["k3", "--help"]
