# Sourced by scripts/test.sh and scripts/localnet.sh: creates .venv if missing and installs the project
# with its test extra, every dependency at the version pinned in constraints.txt. Re-running is fast: it
# reinstalls only when pyproject.toml or constraints.txt changed.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.k3-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing torch==2.13.0 (CPU build) then the project (pinned by constraints.txt)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -c constraints.txt -e '.[test]'
  echo "$want" > "$stamp"
fi
