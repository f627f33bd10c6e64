#!/usr/bin/env bash
# make test-python: installs the package with pip into a venv of its own (torch,
# transformers 4.57.x, kvpress 0.5.5, gguf: about 6 GB, created once and reused; installed by
# uv, which fetches and unpacks the wheels in parallel: 40 s on a 2-core machine, where pip
# goes one wheel at a time; pip if uv cannot be had), then runs
# the binding's tests against the installed package and the transformers and kvpress tests
# (python/tests/torch). Not part of `make test`: torch is too heavy for it.
#   KVGC_PY_VENV       the venv (default ~/.cache/kvgc/pyvenv)
#   KVGC_REQUIRE_MODEL=1  the SmolLM2 tests fail instead of skipping when the model is missing
#   PYTEST_ARGS        extra pytest arguments (e.g. -k batch)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVGC_PY_VENV:-$HOME/.cache/kvgc/pyvenv}"
reqs=python/requirements-test.txt
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -x "$venv/bin/python" ]; then
  echo "test-python: creating $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
if [ ! -f "$venv/.installed" ] || ! cmp -s "$reqs" "$venv/.installed"; then
  echo "test-python: installing $reqs into $venv (first time: about a minute with uv, ~6 GB)" >&2
  [ -x "$venv/bin/uv" ] || "$venv/bin/python" -m pip install -q uv ||
    echo "test-python: no uv; pip installs instead" >&2
  if [ -x "$venv/bin/uv" ]; then
    "$venv/bin/uv" pip install -q --python "$venv/bin/python" -r "$reqs"
  else
    "$venv/bin/python" -m pip install -q -r "$reqs"
  fi
  cp "$reqs" "$venv/.installed"
fi
# The package as a user installs it (pip install .), built incrementally in build-pip,
# by the venv's meson (pyproject.toml asks >= 1.1; meson-python would otherwise take the
# first on PATH, Debian's 1.0.1, which mistakes a venv whose path starts with the source
# tree's, such as /tmp/ci-pyvenv beside /tmp/ci, for a directory inside it).
export MESON="${MESON:-$venv/bin/meson}"
echo "test-python: pip install . (build dir build-pip)" >&2
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation --force-reinstall \
  -Cbuild-dir=build-pip .
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# From a directory outside the tree: `import kvgc` must find the installed package.
cd "$(mktemp -d)"
status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} \
  "$OLDPWD/python/tests/test_binding.py" "$OLDPWD/python/tests/torch" || status=$?
exit $status
