#!/usr/bin/env bash
# make test-python: installs the package with pip into a venv of its own (torch,
# transformers 4.57.x, kvpress 0.5.5, gguf: about 6 GB, created once and reused; installed by
# uv, which fetches and unpacks the wheels in parallel: 40 s on a 2-core machine, where pip
# goes one wheel at a time; pip if uv cannot be had), then runs
# the binding's tests against the installed package and the transformers and kvpress tests
# (python/tests/torch). Not part of `make test`: torch is too heavy for it.
# Then the same wheel in a second venv whose only difference is transformers 5.2.x (the
# `transformers` extra allows 4.56 to 5.2; kvpress 0.5.5 allows < 5.3): created the same
# way, its torch and the rest hard-linked from uv's cache (seconds), and the transformers,
# README and kvpress tests run there, all but the kvpress harness's evaluate.py run (70 s,
# kvpress's own code; the 4.57 run has it) and the binding's (no transformers in them).
# Each run prints its seconds.
#   KVGC_PY_VENV       the venv (default ~/.cache/kvgc/pyvenv)
#   KVGC_PY_VENV_TF5   the transformers 5.2 venv (default ~/.cache/kvgc/pyvenv-tf5);
#                      KVGC_TF5=0 skips that run
#   KVGC_REQUIRE_MODEL=1  the SmolLM2 tests fail instead of skipping when the model is missing
#   PYTEST_ARGS        extra pytest arguments (e.g. -k batch)
# tools/test-python.sh --venv-only: creates or updates the venv, and stops there (make docs).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVGC_PY_VENV:-$HOME/.cache/kvgc/pyvenv}"
venv5="${KVGC_PY_VENV_TF5:-$HOME/.cache/kvgc/pyvenv-tf5}"
reqs=python/requirements-test.txt
tf5=5.2.0
mkdir -p "$(dirname "$venv")" "$(dirname "$venv5")"
ensure_venv() {  # VENV REQS [WHAT]: creates VENV once, installs REQS when they changed
  local venv=$1 reqs=$2 what=${3:-$2}
  if [ ! -x "$venv/bin/python" ]; then
    echo "test-python: creating $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
  fi
  if [ ! -f "$venv/.installed" ] || ! cmp -s "$reqs" "$venv/.installed"; then
    echo "test-python: installing $what into $venv (first time: about a minute with uv, ~6 GB)" >&2
    [ -x "$venv/bin/uv" ] || "$venv/bin/python" -m pip install -q uv ||
      echo "test-python: no uv; pip installs instead" >&2
    if [ -x "$venv/bin/uv" ]; then
      "$venv/bin/uv" pip install -q --python "$venv/bin/python" -r "$reqs"
    else
      "$venv/bin/python" -m pip install -q -r "$reqs"
    fi
    cp "$reqs" "$venv/.installed"
  fi
}
exec 9>"$venv.lock"
flock 9
ensure_venv "$venv" "$reqs"
if [ "${1:-}" = --venv-only ]; then exit 0; fi
if [ "${KVGC_TF5:-1}" != 0 ]; then
  exec 8>"$venv5.lock"
  flock 8
  # The test requirements with transformers 5.2.x in place of 4.57.x.
  reqs5=$(mktemp)
  sed "s/^transformers==.*/transformers==$tf5/" "$reqs" >"$reqs5"
  grep -q "^transformers==$tf5\$" "$reqs5"
  ensure_venv "$venv5" "$reqs5" "$reqs with transformers==$tf5"
  rm -f "$reqs5"
fi
# The package as a user installs it (pip install .), built incrementally in build-pip,
# by the venv's meson (pyproject.toml asks >= 1.1; meson-python would otherwise take the
# first on PATH, Debian's 1.0.1, which mistakes a venv whose path starts with the source
# tree's, such as /tmp/ci-pyvenv beside /tmp/ci, for a directory inside it).
export MESON="${MESON:-$venv/bin/meson}"
# pip builds the wheel `pip install .` would (once, for both venvs), then installs it.
echo "test-python: pip install . (build dir build-pip)" >&2
wheels=$(mktemp -d)
"$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -Cbuild-dir=build-pip \
  -w "$wheels" .
"$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$wheels"/kvgc-*.whl
[ "${KVGC_TF5:-1}" = 0 ] ||
  "$venv5/bin/python" -m pip install -q --no-deps --force-reinstall "$wheels"/kvgc-*.whl
rm -rf "$wheels"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# From a directory outside the tree: `import kvgc` must find the installed package.
root=$PWD
cd "$(mktemp -d)"
status=0
tf_version() { "$1/bin/python" -c 'import transformers; print(transformers.__version__)'; }
t0=$SECONDS
tf=$(tf_version "$venv")
echo "test-python: transformers $tf ($venv)" >&2
"$venv/bin/python" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} \
  "$root/python/tests/test_binding.py" "$root/python/tests/torch" || status=$?
echo "test-python: the transformers $tf run took $((SECONDS - t0)) s" >&2
if [ "${KVGC_TF5:-1}" != 0 ]; then
  t0=$SECONDS
  tf=$(tf_version "$venv5")
  echo "test-python: transformers $tf ($venv5)" >&2
  "$venv5/bin/python" -m pytest -q -p no:cacheprovider -k "not test_evaluate_py_through_runner" \
    ${PYTEST_ARGS:-} "$root/python/tests/torch" || status=$?
  echo "test-python: the transformers $tf run took $((SECONDS - t0)) s" >&2
fi
exit $status
