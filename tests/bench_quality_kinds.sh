#!/bin/sh
# kvgc-bench-quality's kinds task (bench/quality_kinds.cpp), smoke-sized: its exported
# prompts (every cell, each prompt its own key, the word keys marked for the anchors), then
# one prompt a cell answered by the full cache and the default policy, down to the RESULT
# line. Skipped (77) without the model, unless KVGC_REQUIRE_MODEL=1 (CI).
# Usage: bench_quality_kinds.sh BUILD/tools/kvgc-bench-quality
set -eu
bench=$1
model=${KVGC_MODEL:-$HOME/.cache/kvgc/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ ! -f "$model" ]; then
  if [ "${KVGC_REQUIRE_MODEL:-0}" = 1 ]; then
    echo "FAIL: no model at $model (tools/fetch-model.sh)"
    exit 1
  fi
  echo "skipped: no model at $model (tools/fetch-model.sh)"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# 3 texts x 3 formats x 4 prompts, each its own key; a third of them word keys.
"$bench" --model "$model" --only kinds --contexts 256 --prompts 4 --export "$out/kinds.jsonl"
[ "$(wc -l < "$out/kinds.jsonl")" -eq 36 ] || fail "expected 36 exported prompts"
keys=$(sed 's/.*"expect":"\([^"]*\)".*/\1/' "$out/kinds.jsonl" | sort -u | wc -l)
[ "$keys" -eq 36 ] || fail "expected 36 distinct keys, got $keys"
[ "$(grep -c '"match":"words"' "$out/kinds.jsonl")" -eq 12 ] || fail "expected 12 word keys"
grep -q '"id":"kinds/ninja-manual/id/256/03"' "$out/kinds.jsonl" || fail "missing a cell's prompt"

# One prompt a cell, answered.
"$bench" --model "$model" --only kinds --contexts 256 --prompts 1 --configs default@bytes \
  --fractions 0.5 --jobs 1 --no-plots --out "$out" --results "$out/results.jsonl" > "$out/log"
cat "$out/log"
grep -q '^ninja-manual/words @256 ' "$out/log" || fail "no per-cell table"
result=$(grep '^RESULT ' "$out/log") || fail "no RESULT line"
# Ratios first: the default's share of the full cache's answers leads the line.
case "$result" in
  "RESULT kinds_default_bytes_50_vs_full="*" kinds_default_bytes_50_kept="*) ;;
  *) fail "RESULT line out of order: $result" ;;
esac
full=$(echo "$result" | sed -n 's/.* kinds_full=\([0-9]*\)\/9 .*/\1/p')
[ -n "$full" ] || fail "no kinds_full=K/9 in the RESULT line"
# A full cache that answers no short prompt means broken prompts or scoring.
[ "$full" -gt 0 ] || fail "the full cache answered none of 9 short prompts"
[ "$(grep -c '"task":"kinds"' "$out/results.jsonl")" -eq 18 ] || fail "expected 18 result records"

# kinds-after: the same prompts (same keys), the question read after the compressed
# context, answered by the full cache and the reconstruction row (its own prefill, the
# repeat on forks of it).
"$bench" --model "$model" --only kinds-after --contexts 256 --prompts 4 --export "$out/after.jsonl"
[ "$(grep -c '"question_at":[1-9]' "$out/after.jsonl")" -eq 36 ] || fail "expected 36 split prompts"
sed 's/.*"expect":"\([^"]*\)".*/\1/' "$out/kinds.jsonl" > "$out/keys"
sed 's/.*"expect":"\([^"]*\)".*/\1/' "$out/after.jsonl" | cmp -s - "$out/keys" ||
  fail "kinds-after does not ask for kinds' keys"
"$bench" --model "$model" --only kinds-after --contexts 256 --prompts 1 \
  --configs default+recon8@bytes --fractions 0.5 --jobs 1 --no-plots \
  --out "$out" --results "$out/after-results.jsonl" > "$out/after-log"
cat "$out/after-log"
grep -q '^RESULT kinds_after_default_recon8_bytes_50_vs_full=' "$out/after-log" ||
  fail "no kinds-after RESULT line"
[ "$(grep -c '"task":"kinds-after"' "$out/after-results.jsonl")" -eq 18 ] ||
  fail "expected 18 kinds-after result records"
echo "ok: kinds_full=$full/9"
