#!/usr/bin/env bash
# Test command: sets up .venv on a fresh machine (torch CPU build first, then the project pinned by
# constraints.txt), the separate vLLM venv for the real-vLLM contract tests, then runs pytest.
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
exec .venv/bin/python -m pytest "$@"
