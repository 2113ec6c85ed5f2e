#!/usr/bin/env bash
# The whole subnet on one machine (see scripts/localnet.py --help). Sets up .venv on a fresh clone first.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
exec .venv/bin/python scripts/localnet.py "$@"
