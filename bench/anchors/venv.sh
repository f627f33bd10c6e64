#!/usr/bin/env bash
# The anchors' Python environment: one venv shared by every anchor script, created from
# PyPI packages only (nothing vendored). Usage: bench/anchors/venv.sh GROUP... installs
# bench/anchors/requirements-GROUP.txt for each GROUP (llama: llama-cpp-python built from
# its sdist for this CPU; kvpress: kvpress on HF transformers) and prints the venv's
# python on stdout. Not part of `make test`.
#   KVGC_ANCHORS_VENV  where the venv lives (default ~/.cache/kvgc/anchors-venv)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${KVGC_ANCHORS_VENV:-$HOME/.cache/kvgc/anchors-venv}"
[ $# -gt 0 ] || { echo "usage: $0 GROUP... (groups: $(cd "$here" && ls requirements-*.txt | sed 's/requirements-//;s/\.txt//' | tr '\n' ' '))" >&2; exit 2; }
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9  # two scripts installing into one venv at once would corrupt it
if [ ! -x "$venv/bin/python" ]; then
  echo "anchors: creating $venv" >&2
  python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
fi
for group in "$@"; do
  req="$here/requirements-$group.txt"
  [ -f "$req" ] || { echo "anchors: no group '$group' ($req missing)" >&2; exit 2; }
  stamp="$venv/.installed-$group"
  # llama-cpp-python compiles llama.cpp from its sdist: native CPU flags, OpenMP, but no
  # AMX: ggml's AMX path (built wherever -march=native has AMX, as on Sapphire Rapids)
  # segfaulted in the first decode on this project's VMs.
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake_args="${CMAKE_ARGS:--DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'}"
  want="$(cat "$req"; echo "# CMAKE_ARGS=$cmake_args")"
  # Reinstall only when the requirements or the build flags changed; llama's with no pip
  # cache, whose wheel built from the same sdist would ignore new flags (a forced
  # reinstall of the kvpress group would fetch torch again: an added package only adds).
  force=""
  [ "$group" != llama ] || force="--no-cache-dir --force-reinstall"
  if [ ! -f "$stamp" ] || [ "$want" != "$(cat "$stamp")" ]; then
    echo "anchors: installing $group into $venv (first time: minutes)" >&2
    # shellcheck disable=SC2086
    CMAKE_ARGS="$cmake_args" "$venv/bin/python" -m pip install -q $force -r "$req" >&2
    printf '%s\n' "$want" > "$stamp"
  fi
done
echo "$venv/bin/python"
