# Sourced by scripts/test.sh and scripts/localnet.sh (or run: bash scripts/setup_venv.sh): creates .venv with a
# Python >= 3.11 and installs torch (the CPU build, or the CUDA build with K3_TORCH=cuda), then the project with
# its test extra, every dependency at the version pinned in constraints.txt. Re-running is fast: it reinstalls
# only when pyproject.toml, constraints.txt or K3_TORCH changed, and rebuilds a .venv made with an older Python.
#
#   PYTHON=/path/to/python3.12   the interpreter to use (default: python3.11, python3.12, python3.13, python3,
#                                the first that is 3.11 or newer)
#   K3_TORCH=cpu|cuda            which torch build (default cpu: the CPU wheel, ~200 MB, not PyPI's ~2.5 GB CUDA one)
#   K3_SETUP_DRY_RUN=1           say what would be done (interpreter, .venv, torch) and stop before installing
k3_setup() {
  local torch_version=2.13.0 want_major=3 want_minor=11 py="" version="" candidate
  local torch_kind=${K3_TORCH:-cpu} venv_state=kept
  k3_python_ok() {  # prints the version of interpreter $1 when it is >= 3.11
    "$1" -c "import sys; v = sys.version_info; print(f'{v[0]}.{v[1]}.{v[2]}'); sys.exit(v < ($want_major, $want_minor))" \
      2>/dev/null
  }
  if [ -n "${PYTHON:-}" ]; then
    if ! version=$(k3_python_ok "$PYTHON"); then
      echo "[setup] PYTHON=$PYTHON is not Python 3.11 or newer ($("$PYTHON" --version 2>&1 | head -1)); set PYTHON to a python3.11, python3.12 or python3.13" >&2
      return 1
    fi
    py=$PYTHON
  else
    for candidate in python3.11 python3.12 python3.13 python3; do
      if command -v "$candidate" >/dev/null 2>&1 && version=$(k3_python_ok "$candidate"); then
        py=$candidate
        break
      fi
    done
  fi
  if [ -z "$py" ]; then
    echo "[setup] needs Python 3.11 or newer, found $(python3 --version 2>&1 | head -1 || echo 'no python3'): install one (Ubuntu 22.04: sudo apt install python3.11 python3.11-venv; or uv python install 3.11) and run again, or set PYTHON=/path/to/python3.11" >&2
    return 1
  fi
  if [ -e .venv ] && ! k3_python_ok .venv/bin/python >/dev/null; then
    echo "[setup] .venv was made with $(.venv/bin/python --version 2>&1 | head -1 || echo 'a Python that no longer runs'): rebuilding it with $py ($version)"
    [ -n "${K3_SETUP_DRY_RUN:-}" ] || rm -rf .venv
    venv_state=rebuilt
  fi
  [ -e .venv ] || venv_state=created
  case "$torch_kind" in
    cpu) local torch_spec="torch==$torch_version+cpu" torch_index="https://download.pytorch.org/whl/cpu"
         local torch_what="CPU build" ;;
    cuda) local torch_spec="torch==$torch_version" torch_index="" torch_what="CUDA build (PyPI's Linux wheel)" ;;
    *) echo "[setup] K3_TORCH=$torch_kind: use cpu or cuda" >&2; return 1 ;;
  esac
  if [ -n "${K3_SETUP_DRY_RUN:-}" ]; then
    echo "[setup] dry run: Python $py ($version); .venv $venv_state; torch $torch_spec ($torch_what); then pip install -c constraints.txt -e '.[test]'"
    return 0
  fi
  if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $py ($version)"
    "$py" -m venv .venv || { echo "[setup] $py -m venv failed: install its venv module (Ubuntu: sudo apt install python${version%.*}-venv)" >&2; return 1; }
  fi
  local stamp=.venv/.k3-installed want
  want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1) $torch_kind"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  local t0=$SECONDS
  echo "[setup] 1/3 pip itself"
  .venv/bin/python -m pip install --upgrade pip | tail -1
  echo "[setup] 2/3 $torch_spec ($torch_what)"
  # the CPU wheel's local version (+cpu) lives on PyTorch's index; a mirror configured for pip may carry it too
  if ! .venv/bin/python -m pip install "$torch_spec"; then
    if [ -z "$torch_index" ]; then return 1; fi
    echo "[setup] $torch_spec is not on the configured index: taking it from $torch_index"
    .venv/bin/python -m pip install "$torch_spec" --index-url "$torch_index" || return 1
  fi
  echo "[setup] 3/3 the project and its test extra, pinned by constraints.txt (a few minutes on a fresh machine)"
  .venv/bin/python -m pip install -c constraints.txt -e '.[test]' || return 1
  echo "[setup] torch $(.venv/bin/python -c 'import torch; print(torch.__version__, "CUDA " + torch.version.cuda if torch.version.cuda else "(CPU build)")') installed; .venv ready in $((SECONDS - t0)) s"
  echo "$want" > "$stamp"
}
k3_status=0
k3_setup || k3_status=$?
unset -f k3_setup k3_python_ok
if [ "$k3_status" != 0 ]; then
  if [ "${BASH_SOURCE[0]}" = "$0" ]; then exit "$k3_status"; else return "$k3_status"; fi
fi
