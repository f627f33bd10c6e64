#!/usr/bin/env bash
# Mutation testing (not run in CI): plants one-line bugs, one at a time, in compaction,
# scrubbing, demotion, the deferred harvest and the page pool, and runs the unit suite
# and the stress tests against each. A mutant is "caught" when some test fails.
# The working tree is never touched: the tracked files are copied to a scratch tree,
# built there once (CPU backend), and each mutant is applied to, rebuilt in and
# reverted from that copy.
#
#   tests/mutation/run.sh [SCRATCH_DIR]     (default /tmp/kvgc-mutation)
#
# Prints one line per mutant: "caught unit=FAIL stress=FAIL ..." or "MISSED", and a
# RESULT line. docs/RELIABILITY.md records the last run. (A mutant that changes nothing
# observable is no finding: the first run's "alloc forgets to reset used" was one,
# since free already resets it; it was replaced.)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-/tmp/kvgc-mutation}
mkdir -p "$work"
rm -rf "$work/src"
mkdir -p "$work/src"
(cd "$root" && git ls-files -z | xargs -0 tar -cf - 2>/dev/null) | tar -xf - -C "$work/src"
src="$work/src"
build="$work/build"
[ -f "$build/build.ninja" ] || meson setup "$build" "$src" -Dcuda=disabled -Dbench=false \
  -Dtools=false >"$work/setup.log" 2>&1 || { echo "mutation: meson setup failed"; exit 1; }
targets=(tests/kvgc-unit-tests tests/kvgc-stress)
ninja -C "$build" -j2 "${targets[@]}" >"$work/build.log" 2>&1 || { echo "mutation: build failed"; exit 1; }

# file | the exact line (must occur once) | its replacement | what the bug is
mutants=(
"kernels/cpu/gc.cpp|      score_at(mv.dst, L, d) = score_at(mv.src, L, s);|      score_at(mv.dst, L, d) = 0.f;|compaction zeroes the moved slot's score"
"kernels/cpu/gc.cpp|      gen_at(mv.dst, L, d) = gen_at(mv.src, L, s);|      (void)0;|compaction leaves the moved slot's generation behind"
"kernels/cpu/gc.cpp|      set_live(mv.src, L, s, false);|      (void)s;|compaction leaves the source slot live (a duplicate)"
"gc/compaction.cpp|    plan.moves.push_back({dst, src, n});|    plan.moves.push_back({dst, src, n > 1 ? n - 1 : n});|compaction plan moves one slot fewer than it counts"
"kernels/cpu/copy.cpp|        std::memset(page + L.k_off + at, 0, rest * L.slot_stride);|        (void)at;|append does not zero K past its run (scrub)"
"kernels/cpu/copy.cpp|      std::memset(page, 0, L.k_off);|      std::memset(page, 0, 4 * size_t(PageLayout::live_words(L.page_tokens)));|append zeroes only the live mask of the metadata (scrub)"
"kernels/cpu/copy.cpp|      std::memset(page + L.v_off + payload, 0, L.bytes - (L.v_off + payload));|      (void)payload;|append leaves the padding after V (scrub)"
"kernels/cpu/gc.cpp|        std::memset(op.demote_dst[c][i].page, 0, op.layout[c].bytes);|        (void)i;|demotion does not zero a fresh destination page (scrub)"
"kernels/cpu/gc.cpp|  score_at(dst, Lq, d) = score_at(src, Lf, s);|  score_at(dst, Lq, d) = 0.f;|demotion drops the score"
"kernels/cpu/gc.cpp|  pos_at(dst, Lq, d) = pos_at(src, Lf, s);|  pos_at(dst, Lq, d) = pos_at(src, Lf, s) + 1;|demotion shifts the position"
"runtime/harvest.cpp|    tail.live = uint16_t(tail.live + (tail.used - p.tail_used));|    (void)tail;|harvest forgets tokens appended to the tail since the GC"
"runtime/harvest.cpp|    d.used = uint16_t(d.used - (runs[i].count - n));|    (void)d;|harvest keeps unfilled demotion slots reserved"
"runtime/harvest.cpp|  free_empty_pages(tenant, q);  // includes demotion pages nothing was written to|  (void)q;|harvest keeps emptied int4 pages"
"allocator/page_pool.cpp|  d.owner = owner;|  (void)owner;|page pool hands out a page without recording its owner"
"allocator/page_pool.cpp|    arena_.release(s);|    (void)0;|page pool never gives an emptied slab back to the arena"
"allocator/page_pool.cpp|  if (s.full()) partial.pop_front();|  (void)0;|page pool keeps a full slab on the partial list"
"allocator/page_pool.cpp|  ++counts_[cls].pages_free;|  counts_[cls].pages_free += 2;|page pool miscounts a freed page"
)

run() {  # name, command...: PASS or FAIL
  local name=$1; shift
  if timeout 600 "$@" >"$work/$name.log" 2>&1; then echo PASS; else echo FAIL; fi
}

caught=0
missed=0
i=0
for m in "${mutants[@]}"; do
  IFS='|' read -r file old new what <<<"$m"
  i=$((i + 1))
  cp "$src/$file" "$work/orig"
  if ! python3 - "$src/$file" "$old" "$new" <<'PY'
import sys
path, old, new = sys.argv[1:4]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"mutant line found {text.count(old)} times in {path}")
open(path, "w").write(text.replace(old, new))
PY
  then
    echo "mutant $i: NOT APPLIED ($what)"
    continue
  fi
  if ! ninja -C "$build" -j2 "${targets[@]}" >"$work/build.log" 2>&1; then
    result="caught (does not compile)"
  else
    unit=$(run unit "$build/tests/kvgc-unit-tests")
    stress=$(run stress "$build/tests/kvgc-stress" 4 8 300)
    stress2=$(run stress-threads "$build/tests/kvgc-stress" 4 8 300 2)
    if [ "$unit$stress$stress2" = PASSPASSPASS ]; then result="MISSED"
    else result="caught unit=$unit stress=$stress stress-threads=$stress2"; fi
  fi
  [ "$result" = MISSED ] && missed=$((missed + 1)) || caught=$((caught + 1))
  echo "mutant $i: $result: $what ($file)"
  cp "$work/orig" "$src/$file"
done
ninja -C "$build" -j2 "${targets[@]}" >/dev/null 2>&1
echo "RESULT caught=$caught missed=$missed mutants=${#mutants[@]}"
[ "$missed" = 0 ]
