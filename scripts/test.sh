#!/usr/bin/env bash
# Test command: sets up .venv on a fresh machine (torch CPU build first, then the project pinned by
# constraints.txt), the separate vLLM venv for the real-vLLM contract tests, then runs pytest on two workers.
# Usage: scripts/test.sh [pytest args...]
# The vLLM venv (3.4 GB, minutes to install) and SGLang's protocol wheel live outside the clone so
# that a fresh clone on the same machine reuses them: K3_VLLM_VENV, K3_SGLANG_PROTOCOL_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
export K3_VLLM_VENV=${K3_VLLM_VENV:-$HOME/.cache/k3-subnet/venv-vllm}
export K3_SGLANG_PROTOCOL_DIR=${K3_SGLANG_PROTOCOL_DIR:-$HOME/.cache/k3-subnet/sglang-protocol}
mkdir -p "$(dirname "$K3_VLLM_VENV")"
bash scripts/setup_vllm.sh "$K3_VLLM_VENV"
# Two workers (pytest-xdist), each given whole files (module fixtures start their servers once), in the
# order tests/conftest.py puts them, slowest first; K3_TEST_WORKERS=0 runs everything in this process.
workers=${K3_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
