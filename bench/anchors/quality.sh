#!/usr/bin/env bash
# kvgc and its anchors on the same prompts and token ids, then the tables at equal bytes.
# Not part of `make test` (needs the model, the anchors' venv and time).
#   bench/anchors/quality.sh [--full] [--only TASK]... [--contexts N,N] [--limit N]
#     1. build/tools/kvgc-bench-quality --export: every prompt as kvgc's token ids
#     2. llama_quality.py (llama.cpp f16 / q8_0 / q4_0 K/V) and kvpress_quality.py
#        (the presses) on those ids, each writing JSON lines
#     3. report.py: kvgc's results (KVGC_RESULTS, a kvgc-bench-quality --results file of
#        the same mode) beside theirs, markdown tables and Pareto plots in $OUT
# Environment: BUILD (default build), OUT (default $BUILD/anchors-out), KVGC_RESULTS,
# PRESSES / KEPT / CACHES (passed to the scripts), ANCHORS (default "llama kvpress").
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
BUILD="${BUILD:-$root/build}"
OUT="${OUT:-$BUILD/anchors-out}"
ANCHORS="${ANCHORS:-llama kvpress}"
mode=quick export_args=() script_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --full) mode=full; export_args+=(--full) ;;
    --only) export_args+=(--only "$2"); script_args+=(--only "$2"); shift ;;
    --contexts) export_args+=(--contexts "$2"); script_args+=(--contexts "$2"); shift ;;
    --limit) script_args+=(--limit "$2"); shift ;;
    *) echo "quality.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
tasks="$OUT/$mode-tasks.jsonl"
"$BUILD/tools/kvgc-bench-quality" "${export_args[@]}" --export "$tasks"
results=()
for a in $ANCHORS; do
  case "$a" in
    llama)
      py="$("$here/venv.sh" llama)"
      rm -f "$OUT/$mode-llama.jsonl"
      "$py" "$here/llama_quality.py" --tasks "$tasks" --out "$OUT/$mode-llama.jsonl" \
        ${CACHES:+--caches "$CACHES"} "${script_args[@]}"
      results+=("$OUT/$mode-llama.jsonl") ;;
    kvpress)
      py="$("$here/venv.sh" kvpress)"
      rm -f "$OUT/$mode-kvpress.jsonl"
      "$py" "$here/kvpress_quality.py" --tasks "$tasks" --out "$OUT/$mode-kvpress.jsonl" \
        ${PRESSES:+--presses "$PRESSES"} ${KEPT:+--kept "$KEPT"} "${script_args[@]}"
      results+=("$OUT/$mode-kvpress.jsonl") ;;
    *) echo "quality.sh: unknown anchor '$a' (llama, kvpress)" >&2; exit 2 ;;
  esac
done
[ -n "${KVGC_RESULTS:-}" ] && results+=("$KVGC_RESULTS")
python3 "$here/report.py" --out "$OUT" --prefix "$mode-anchors" "${results[@]}"
