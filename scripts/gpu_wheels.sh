#!/usr/bin/env bash
# Wheels of the project's dependencies that a bare GPU image with PyTorch and Triton lacks (bittensor, pydantic,
# fla-core and what they need), for Python 3.12 on x86-64 Linux, pinned as constraints.txt pins them, into .whl/
# (scripts/gpu_check.sh installs them there). Run it where pip reaches PyPI; add .whl/ to .git/info/exclude.
#   scripts/gpu_wheels.sh [PYTHON_VERSION]     # default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
names=(annotated-types bitarray bittensor bittensor-core ckzg cytoolz eth-abi eth-account eth-hash eth-keyfile eth-keys
       eth-rlp eth-typing eth-utils fla-core hexbytes httpx-sse parsimonious pycryptodome pydantic pydantic_core qrcode
       rlp typing-inspection websockets)
pins=()
for name in "${names[@]}"; do
  pin=$(grep -i -E "^${name//[-_]/[-_]}==" constraints.txt || true)
  pins+=("${pin:-$name}")
done
platforms=()
for n in 39 35 34 31 28 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls .whl
