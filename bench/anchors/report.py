#!/usr/bin/env python3
"""kvgc beside its anchors at equal bytes: reads the per-run results (JSON lines) that
kvgc-bench-quality --results, llama_quality.py and kvpress_quality.py write, keeps the
prompts every side ran (same ids), and prints, per task, markdown tables: every
configuration's cells (KV bytes / f16 full cache, accuracy with its 95% Wilson interval or
perplexity, ratio to the same side's full cache), then the best cell of each configuration
at or under 2.5 / 5 / 10 / 12.5 / 20 / 30 / 50% of the bytes, then whether any
configuration's accuracy drops, as its budget grows, by more than its interval (the larger
budget's upper bound under the smaller budget's accuracy). With --paired A B, for a
perplexity task, the two cells compared prompt by prompt: each prompt's perplexity over
its own side's full cache, the mean of A's minus B's with a 95% t interval, and the
prompts where each is ahead (a cell is SIDE:CONFIG:FRACTION, e.g. kvgc:default@bytes:0.1
or llama.cpp:q4_0:0.28125, the share its rows record). Writes gnuplot data
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


# Student's t, 0.975 quantile, for 1..30 degrees of freedom.
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df):
    """The 0.975 quantile of Student's t with df degrees of freedom: the table to 30, then
    its Cornish-Fisher expansion (within 0.01% there)."""
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def paired_stats(rows, task, a, b):
    """Prompt-by-prompt comparison of cells a and b (side, config, fraction) on a perplexity
    task, each prompt's perplexity over its own side's full cache on that prompt. None when
    they share fewer than two prompts; else the prompts, the mean of a's minus b's ratios,
    its 95% t interval, and on how many prompts a is lower (better) and higher."""
    def cell(spec):
        side, config, fraction = spec
        out, base = {}, {}
        for r in rows:
            if r["task"] != task or r["side"] != side:
                continue
            ppl = math.exp(r["nll_sum"] / r["scored"])
            if r["config"] == BASELINE.get(side):
                base[r["id"]] = ppl
            if r["config"] == config and abs(r.get("fraction", 1.0) - fraction) < 5e-4:
                out[r["id"]] = ppl
        return {i: v / base[i] for i, v in out.items() if i in base}
    ra, rb = cell(a), cell(b)
    ids = sorted(set(ra) & set(rb))
    if len(ids) < 2:
        return None
    d = [ra[i] - rb[i] for i in ids]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    half = t975(len(d) - 1) * sd / math.sqrt(len(d))
    return {"prompts": len(ids), "diff": mean, "lo": mean - half, "hi": mean + half,
            "a_lower": sum(x < 0 for x in d), "a_higher": sum(x > 0 for x in d),
            "a_mean": sum(ra[i] for i in ids) / len(ids), "b_mean": sum(rb[i] for i in ids) / len(ids)}


def paired(rows, task, a, b):
    name = lambda s: f"{s[0]} {s[1]} at {s[2]:g}"
    st = paired_stats(rows, task, a, b)
    if st is None:
        print(f"paired {task}: {name(a)} and {name(b)} share fewer than 2 prompts\n")
        return
    print(f"Paired, {task}, {st['prompts']} prompts: {name(a)} minus {name(b)}, each over its "
          f"own full cache: mean {st['diff']:+.4f}, 95% interval [{st['lo']:+.4f}, {st['hi']:+.4f}]; "
          f"{name(a)} lower on {st['a_lower']}, higher on {st['a_higher']} (means "
          f"{st['a_mean']:.4f}x and {st['b_mean']:.4f}x)\n")
    print(f"RESULT paired_{task.replace('-', '_')}_diff={st['diff']:+.4f} lo={st['lo']:+.4f} "
          f"hi={st['hi']:+.4f} prompts={st['prompts']} a_lower={st['a_lower']}\n")


def parse_cell(text):
    parts = text.rsplit(":", 2)
    if len(parts) != 3:
        sys.exit(f"--paired: {text!r} is not SIDE:CONFIG:FRACTION")
    side, config, fraction = parts
    try:
        return side, config, float(fraction)
    except ValueError:
        sys.exit(f"--paired: {text!r}: the fraction {fraction!r} is not a number")


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
    p.add_argument("--paired", nargs=2, metavar=("A", "B"), action="append", default=[],
                   help="compare two perplexity cells prompt by prompt (SIDE:CONFIG:FRACTION)")
    args = p.parse_args()
    rows = load(args.results)
    pairs = [(parse_cell(a), parse_cell(b)) for a, b in args.paired]
    for a, b in pairs:
        for task in sorted({r["task"] for r in rows if r["task"].startswith("ppl")}):
            paired(rows, task, a, b)
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
