#!/usr/bin/env bash
# Test command: sets up .venv on a fresh machine (scripts/setup_venv.sh: torch's CPU build first, then the project
# pinned by constraints.txt), then runs pytest on two workers.
# Usage: scripts/test.sh [pytest args...]
# The contract tests against a real vLLM server are opt-in: K3_TEST_VLLM=1 scripts/test.sh builds their separate
# vLLM venv first (scripts/setup_vllm.sh: about 3.5 GB, minutes, once) and runs them; CI does (.ci/run). The venv
# and SGLang's protocol wheel live outside the clone, so that a fresh clone on the same machine reuses them:
# K3_VLLM_VENV, K3_SGLANG_PROTOCOL_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
export K3_VLLM_VENV=${K3_VLLM_VENV:-$HOME/.cache/k3-subnet/venv-vllm}
export K3_SGLANG_PROTOCOL_DIR=${K3_SGLANG_PROTOCOL_DIR:-$HOME/.cache/k3-subnet/sglang-protocol}
if [ "${K3_TEST_VLLM:-0}" = 1 ]; then
  mkdir -p "$(dirname "$K3_VLLM_VENV")"
  bash scripts/setup_vllm.sh "$K3_VLLM_VENV"
else
  echo "[test] the real-vLLM contract tests are skipped; to run them: K3_TEST_VLLM=1 scripts/test.sh (builds a 3.5 GB vLLM venv once)"
fi
# Two workers (pytest-xdist), each given whole files (module fixtures start their servers once), in the
# order tests/conftest.py puts them, slowest first; K3_TEST_WORKERS=0 runs everything in this process.
workers=${K3_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
