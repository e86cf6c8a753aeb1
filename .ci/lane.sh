#!/usr/bin/env bash
# Build the virtual environment of one lane of the support matrix (.ci/lanes.txt) from scratch:
#   bash .ci/lane.sh NAME [VENV_DIR]      (default VENV_DIR: .venvs/NAME)
# torch goes in first, at the lane's version; the package and its extras are then installed with
# torch and megatron-core pinned by a constraints file, so no dependency can replace that torch.
# The constraints file also stands in for any machine-wide pip constraint (PIP_CONSTRAINT), which
# is how a lane reaches a torch newer than such a cap.
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:?usage: .ci/lane.sh NAME [VENV_DIR]}"
venv="${2:-.venvs/$name}"
read -r _ py torch mcore < <(awk -v n="$name" '$1 == n' .ci/lanes.txt) || true
if [ -z "${torch:-}" ]; then
  echo "lane '$name': not in .ci/lanes.txt" >&2
  exit 2
fi

find_python() {  # an interpreter of version $1: on PATH, else pyenv's
  local v="$1" cand
  local root="${PYENV_ROOT:-${HOME:-/root}/.pyenv}"
  for cand in "python$v" "$root/versions/$v"*/bin/"python$v"; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'pass' 2>/dev/null; then
      echo "$cand"
      return 0
    fi
  done
  return 1
}
pybin="$(find_python "$py")" || { echo "lane '$name': no Python $py on this machine" >&2; exit 1; }

fail() { echo "lane '$name': $1 failed (Python $py, torch $torch, megatron-core $mcore)" >&2; exit 1; }
rm -rf "$venv"
"$pybin" -m venv "$venv" || fail "creating the virtual environment"
constraints="$(cd "$venv" && pwd)/constraints.txt"
printf 'torch==%s\nmegatron-core==%s\n' "$torch" "$mcore" > "$constraints"
export PIP_CONSTRAINT="$constraints"
vpy="$venv/bin/python"
pip_install() {  # pip install -q, without the notes about local index folders this machine lacks
  "$vpy" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location '.*' is ignored"
  return "${PIPESTATUS[0]}"
}
pip_install --upgrade pip || fail "upgrading pip"
pip_install "torch==$torch" || fail "installing torch==$torch"
extras="test,dev,megatron"
if [ "$name" = main ]; then
  extras="$extras,docs"  # the main lane also builds the manual (.ci/run)
fi
pip_install -e ".[$extras]" || fail "installing the package with its extras"
"$vpy" - "$torch" "$mcore" <<'PY' || fail "checking the installed versions"
import sys
from importlib.metadata import version

want_torch, want_mcore = sys.argv[1:]
got_torch = version("torch").split("+")[0]
got_mcore = version("megatron-core")
print(f"python {sys.version.split()[0]}, torch {version('torch')}, megatron-core {got_mcore}")
if got_torch != want_torch or got_mcore != want_mcore:
    sys.exit(f"expected torch {want_torch} and megatron-core {want_mcore}")
PY
