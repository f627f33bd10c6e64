#!/usr/bin/env python3
"""kvgc beside its anchors at equal bytes: reads the per-run results (JSON lines) that
kvgc-bench-quality --results, llama_quality.py and kvpress_quality.py write, keeps the
prompts every side ran (same ids), and prints, per task, markdown tables: every
configuration's cells (KV bytes / f16 full cache, accuracy with its 95% Wilson interval or
perplexity, ratio to the same side's full cache), then the best cell of each configuration
at or under 2.5 / 5 / 10 / 12.5 / 20 / 30 / 50% of the bytes, then whether any
configuration's accuracy drops, as its budget grows, by more than its interval (the larger
budget's upper bound under the smaller budget's accuracy). Writes gnuplot data
(OUT/anchors-pareto-TASK.dat) and, with gnuplot, the Pareto plots
(bench/quality_plots.gp). Standard library only.

  bench/anchors/report.py --out docs/quality kvgc.jsonl llama.jsonl kvpress.jsonl
"""
import argparse
import collections
import json
import math
import os
import subprocess
import sys

BASELINE = {"kvgc": "full", "kvpress": "no_press", "llama.cpp": "f16"}
TARGETS = [0.025, 0.05, 0.10, 0.125, 0.20, 0.30, 0.50]


def wilson(k, n, z=1.96):
    """The 95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def drops(points):
    """(smaller share, larger share) pairs of one configuration's (kv, ok, n) cells, in
    share order, where the larger's upper bound is under the smaller's accuracy."""
    out = []
    pts = sorted(points)
    for i, (kv_a, ok_a, n_a) in enumerate(pts):
        for kv_b, ok_b, n_b in pts[i + 1:]:
            if kv_b > kv_a and wilson(ok_b, n_b)[1] < ok_a / n_a:
                out.append(((kv_a, ok_a, n_a), (kv_b, ok_b, n_b)))
    return out


def load(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(f"{path}:{n}: not JSON: {e}")
                if "error" in r:
                    print(f"note: {path}:{n}: {r['side']} {r.get('config')} {r.get('id')}: "
                          f"{r['error']}", file=sys.stderr)
                    continue
                if r.get("mode", "observe") != "observe" or r["task"] == "privacy":
                    continue
                rows.append(r)
    return rows


def series_name(r):
    if r["side"] == "kvgc":
        b = r.get("budget", "none")
        return f"kvgc {r['config']}" + ("" if b in ("none", "tokens") else "")
    return f"{r['side']} {r['config']}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+")
    p.add_argument("--out", default=".", help="where the data files and plots go")
    p.add_argument("--prefix", default="anchors", help="their names' prefix")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args()
    rows = load(args.results)
    by_task = collections.defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r)
    here = os.path.dirname(os.path.abspath(__file__))
    plotted = []
    for task in sorted(by_task):
        rs = by_task[task]
        sides = sorted({r["side"] for r in rs})
        # Same prompts: the ids every side's baseline ran.
        ids = None
        for s in sides:
            base = {r["id"] for r in rs if r["side"] == s and r["config"] == BASELINE.get(s)}
            if not base:
                print(f"note: {task}: {s} has no baseline ({BASELINE.get(s)}) run; left out",
                      file=sys.stderr)
                continue
            ids = base if ids is None else ids & base
        if not ids:
            continue
        rs = [r for r in rs if r["id"] in ids and (r["side"] in BASELINE)]
        is_ppl = task.startswith("ppl")
        cells = collections.defaultdict(lambda: {"n": 0, "ok": 0, "nll": 0.0, "scored": 0, "kv": 0.0})
        for r in rs:
            key = (r["side"], r["config"], r.get("budget", "none"), round(r.get("fraction", 1.0), 4))
            c = cells[key]
            c["n"] += 1
            c["kv"] += r["kv_fraction"]
            if is_ppl:
                c["nll"] += r["nll_sum"]
                c["scored"] += r["scored"]
            else:
                c["ok"] += bool(r["correct"])
        def value(c):
            return math.exp(c["nll"] / c["scored"]) if is_ppl else c["ok"] / c["n"]
        base = {}
        for (side, config, _, _), c in cells.items():
            if config == BASELINE.get(side):
                base[side] = value(c)
        n_prompts = len(ids)
        print(f"### {task}: {n_prompts} prompts, the same token ids on every side\n")
        unit = "perplexity" if is_ppl else "accuracy"
        print(f"| side | configuration | budget | fraction | KV / f16 full | {unit} | vs its full cache |")
        print("|---|---|---|---|---|---|---|")
        table = []
        for key, c in cells.items():
            side, config, budget, fraction = key
            kv = c["kv"] / c["n"]
            v = value(c)
            ratio = v / base[side] if base.get(side) else float("nan")
            table.append((side, config, budget, fraction, kv, v, ratio, c))
        table.sort(key=lambda t: (t[0], t[1], t[4]))
        for side, config, budget, fraction, kv, v, ratio, c in table:
            lo, hi = wilson(c["ok"], c["n"])
            shown = f"{v:.3f}" if is_ppl else f"{c['ok']}/{c['n']} [{100 * lo:.0f}-{100 * hi:.0f}%]"
            print(f"| {side} | {config} | {budget} | {fraction:g} | {100 * kv:.1f}% | {shown} | {ratio:.3f} |")
        print()
        # At equal bytes: each configuration's best cell at or under each share.
        print(f"At equal bytes ({'lower' if is_ppl else 'higher'} is better; each configuration's "
              f"best cell holding at most the share, its KV share in brackets):\n")
        series = collections.defaultdict(list)
        for side, config, budget, fraction, kv, v, ratio, c in table:
            series[(side, config)].append((kv, ratio, v, c))
        print("| side | configuration | " + " | ".join(f"<= {100 * t:g}%" for t in TARGETS) + " |")
        print("|---|---|" + "---|" * len(TARGETS))
        for (side, config), pts in sorted(series.items()):
            cols = []
            for t in TARGETS:
                ok = [q for q in pts if q[0] <= t * 1.005]
                if not ok:
                    cols.append("-")
                    continue
                best = min(ok, key=lambda q: q[1]) if is_ppl else max(ok, key=lambda q: q[1])
                cols.append(f"{best[1]:.3f} ({100 * best[0]:.1f}%)")
            print(f"| {side} | {config} | " + " | ".join(cols) + " |")
        print()
        if not is_ppl:
            found = []
            for (side, config), pts in sorted(series.items()):
                for a, b in drops([(kv, c["ok"], c["n"]) for kv, ratio, v, c in pts]):
                    found.append(f"{side} {config}: {a[1]}/{a[2]} at {100 * a[0]:.1f}% but "
                                 f"{b[1]}/{b[2]} at {100 * b[0]:.1f}%")
            print("Drops beyond the interval as the budget grows: " +
                  ("; ".join(found) if found else "none") + "\n")
        # Pareto data: one block per configuration.
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{args.prefix}-pareto-{task}.dat")
        with open(path, "w") as f:
            for (side, config), pts in sorted(series.items()):
                f.write(f"\"{side} {config}\" value\n")
                for kv, ratio, v, c in sorted(pts):
                    f.write(f"{kv:.5f} {ratio if is_ppl else v:.5f}\n")
                f.write("\n\n")
        plotted.append(task)
    if plotted and not args.no_plots:
        gp = os.path.join(os.path.dirname(here), "quality_plots.gp")
        prefix = os.path.join(args.out, args.prefix)
        cmd = ["gnuplot", "-e", f"prefix='{prefix}'; mode='anchors'; parts='{' '.join(plotted)}'", gp]
        try:
            subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
            print(f"plots: {prefix}-pareto-{{{','.join(plotted)}}}.png")
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"plots: gnuplot failed ({e}); data in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
