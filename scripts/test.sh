#!/usr/bin/env bash
# Test command: sets up .venv on a fresh machine (torch CPU build first), then runs pytest.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
exec .venv/bin/python -m pytest "$@"
