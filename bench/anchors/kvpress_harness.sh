#!/usr/bin/env bash
# kvgc inside kvpress's own evaluation harness (bench/anchors/kvpress_harness.py) with the
# project's Python venv and the built binding (build/python). Arguments go to the runner:
#   bench/anchors/kvpress_harness.sh --tasks niah_multikey_1 --rows 10 \
#       --methods no_press:0 kvgc:0.9 snapkv:0.9
#   KVGC_PYVENV   the venv (default ~/.cache/kvgc/pyvenv: torch, transformers 4.57,
#                 kvpress 0.5.5 and its eval extras: rouge nltk scipy bert-score jieba fuzzywuzzy)
#   KVGC_BUILD    the meson build dir holding python/kvgc (default: <repo>/build)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${KVGC_PYVENV:-$HOME/.cache/kvgc/pyvenv}"
build="${KVGC_BUILD:-$repo/build}"
[ -x "$venv/bin/python" ] || { echo "kvpress_harness: no venv at $venv (set KVGC_PYVENV)" >&2; exit 2; }
# evaluate.py imports every benchmark's scorer: its eval extras must be importable.
"$venv/bin/python" -c "import rouge, nltk, bert_score, jieba, fuzzywuzzy, fire, yaml" 2>/dev/null || {
  echo "kvpress_harness: installing kvpress's eval extras into $venv" >&2
  "$venv/bin/python" -m pip install -q "rouge>=1.0.1,<2" "nltk>=3.9.1,<4" "scipy>=1.13.1,<2" \
      "bert-score>=0.3.13,<0.4" "jieba>=0.42.1" "fuzzywuzzy>=0.18.0" >&2
}
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec "$venv/bin/python" "$here/kvpress_harness.py" "$@"
