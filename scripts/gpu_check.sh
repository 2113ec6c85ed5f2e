#!/usr/bin/env bash
# The prepared GPU check (docs/benchmarks.md, "GPU check"): the project's engine and stage miners on one GPU against
# the fp32 CPU reference, speed, KDA against fla's kernels, a 3-stage swarm, the bandwidth roofline; one JSON file.
#   scripts/gpu_check.sh --out gpu_check.json --work ~/k3-gpu-check    # --device cuda, the scaled K3 at 20 GB
#   scripts/gpu_check.sh --device cpu --out dry.json                       # the dry run on a CPU (0.2 GB)
# Every flag goes to python -m benchmarks.gpu_check (--help lists them). The interpreter: $PYTHON, else .venv's,
# else python3. Wheels in .whl/ (scripts/gpu_wheels.sh: the dependencies a bare GPU image lacks) are installed
# into /tmp/k3-gpu-site first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then py=$PYTHON; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
if compgen -G ".whl/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/k3-gpu-site .whl/*.whl
  export PYTHONPATH=/tmp/k3-gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec "$py" -m benchmarks.gpu_check "$@"
