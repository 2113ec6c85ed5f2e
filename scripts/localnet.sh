#!/usr/bin/env bash
# The whole subnet on one machine (see k3-localnet --help). Sets up .venv on a fresh clone first.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
exec .venv/bin/python -m localnet.testnet "$@"
