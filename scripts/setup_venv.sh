# Sourced by scripts/test.sh and scripts/localnet.sh: creates .venv if missing and installs
# the project with its test extra. Re-running is fast: it reinstalls only when setup.py changed.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.k3-installed
want=$(sha256sum setup.py | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing torch==2.13.0 (CPU build) then the project"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e '.[test]'
  echo "$want" > "$stamp"
fi
