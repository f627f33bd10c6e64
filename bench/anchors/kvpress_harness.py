#!/usr/bin/env python3
"""kvgc inside kvpress's own evaluation harness, beside the presses.

kvpress's harness (``evaluation/``: evaluate.py, its registries, the benchmarks' scorers)
ships in its PyPI sdist, not in the wheel. This runner:

1. locates or downloads that sdist (``pip download --no-deps --no-binary :all:
   kvpress==<installed version>``) into a cache dir and unpacks it there; nothing of it is
   copied into this repository;
2. writes local datasets in the harness's own formats (bench/anchors/harness_data.py);
3. runs the sdist's evaluate.py, unmodified, once per cell (method, compression ratio), in
   a fresh process (``--inner``): the wrapper only adds entries to its PRESS_REGISTRY
   (``kvgc``: kvgc's defaults under a byte budget; ``kvgc_mass``: an
   ObservedAttention-style press scored by kvgc's kernel; ``quanto_int4``/``quanto_int2``: HF's
   quantized cache, when optimum-quanto is installed) and points DATASET_REGISTRY at the
   local parquet files, then runs evaluate.py as ``__main__`` with its own CLI;
4. reads back evaluate.py's predictions.csv / metrics.json, re-scores each row with the
   harness's own metric function (so per-row hits give Wilson intervals), and prints
   tables and one ``RESULT key=value ...`` line.

Equal bytes: a press at compression_ratio r keeps (1-r) of the context's tokens, i.e. a
share 1-r of an f16 cache (nominal for AdaKV-style presses, which mask); kvgc's press
maps compression_ratio r to byte_budget = 1-r of the f16 full cache and reports the bytes
its heap really holds after the prefill (pages incl. slot metadata) over the raw f16 K/V
of the context, logged per sample to a side file (KVGC_KVPRESS_LOG).

  bench/anchors/kvpress_harness.sh --tasks niah_multikey_1 --rows 8 \\
      --methods no_press:0 kvgc:0.9 kvgc:0.8 snapkv:0.9 snapkv:0.8
"""
import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CACHE = os.path.expanduser("~/.cache/kvgc")

# The presses compared at equal shares (names as in kvpress's PRESS_REGISTRY).
DEFAULT_PRESSES = ["snapkv", "streaming_llm", "keydiff", "knorm", "tova", "expected_attention", "adakv_snapkv"]


# ----------------------------------------------------------------------------- the sdist

def locate_sdist(cache_dir, version):
    """The unpacked sdist's root (kvpress-<version>/, holding evaluation/), downloading it
    with pip on first use. Raises RuntimeError (with pip's message) when it cannot."""
    root = os.path.join(cache_dir, f"kvpress-{version}")
    if os.path.isfile(os.path.join(root, "evaluation", "evaluate.py")):
        return root
    os.makedirs(cache_dir, exist_ok=True)
    tarball = os.path.join(cache_dir, f"kvpress-{version}.tar.gz")
    if not os.path.exists(tarball):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"kvpress=={version}", "-d", cache_dir]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(tarball):
            raise RuntimeError(f"cannot download the kvpress {version} sdist: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    with tarfile.open(tarball) as t:
        t.extractall(cache_dir, filter="data")  # "data": no absolute paths, links out, devices
    if not os.path.isfile(os.path.join(root, "evaluation", "evaluate.py")):
        raise RuntimeError(f"{tarball} has no evaluation/evaluate.py")
    return root


# ----------------------------------------------------------------- inside one evaluation

def register(reg, data_root, kvgc_options):
    """The wrapper's whole intervention: registry entries (nothing in evaluate.py changes)."""
    reg.DATASET_REGISTRY["ruler"] = os.path.join(data_root, "ruler")
    reg.DATASET_REGISTRY["needle_in_haystack"] = os.path.join(data_root, "needle_in_haystack")
    import torch
    try:
        from kvgc.kvpress import KvgcPress, KvgcMassPress, QuantizedCachePress
    except ImportError as e:  # the binding is not built: the presses still run
        print(f"kvpress_harness: kvgc.kvpress unavailable ({e}); kvgc cells cannot run", file=sys.stderr)
        return
    reg.PRESS_REGISTRY["kvgc"] = KvgcPress(kv_dtype=torch.float16, **kvgc_options)
    reg.PRESS_REGISTRY["kvgc_mass"] = KvgcMassPress()
    for bits in (4, 2):
        reg.PRESS_REGISTRY[f"quanto_int{bits}"] = QuantizedCachePress(backend="quanto", nbits=bits)


def inner(args, rest):
    """Runs the sdist's evaluate.py as __main__ with `rest` as its command line."""
    import runpy
    import torch
    torch.set_num_threads(args.threads)
    evaluation = os.path.join(args.sdist, "evaluation")
    sys.path.insert(0, evaluation)  # evaluate.py imports benchmarks.* and evaluate_registry from here
    os.chdir(evaluation)
    import evaluate_registry as reg
    register(reg, args.data, json.loads(args.kvgc_options))
    sys.argv = [os.path.join(evaluation, "evaluate.py")] + rest
    runpy.run_path(sys.argv[0], run_name="__main__")


# ------------------------------------------------------------------------------ scoring

def wilson(k, n, z=1.959964):
    """Wilson score interval for k successes in n trials (95% by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def row_scores(sdist, dataset, df):
    """Per-row scores in [0, 100] by the harness's own metric for that dataset."""
    sys.path.insert(0, os.path.join(sdist, "evaluation"))
    if dataset == "ruler":
        import re
        from benchmarks.ruler.calculate_metrics import string_match_all, string_match_part
        clean = re.compile(r"[\x00-\x1f]")  # as its calculate_metrics cleans predictions
        out = []
        for _, r in df.iterrows():
            pred = clean.sub("", str(r["predicted_answer"]).strip()).strip()
            ref = r["answer"]
            ref = list(ref) if not isinstance(ref, str) else eval_list(ref)
            fn = string_match_part if r["task"].split("_")[0] == "qa" else string_match_all
            out.append(fn([pred], [ref]))
        return out
    if dataset == "needle_in_haystack":
        from benchmarks.needle_in_haystack.calculate_metrics import calculate_metrics
        return [100 * s["rouge-l"]["r"] for s in calculate_metrics(df)]
    raise ValueError(dataset)


def eval_list(text):
    """predictions.csv stores the answer list as numpy's repr (e.g. "['a' 'b']")."""
    import re
    return re.findall(r"'((?:[^'\\]|\\.)*)'", text) or [text]


def results_dir(out, dataset, data_dir, model, press, ratio, extra=""):
    """evaluate.py's own naming (EvaluationConfig.get_results_dir)."""
    parts = [dataset, data_dir or "", model.replace("/", "--"), press, f"{ratio:.2f}"]
    return os.path.join(out, "__".join(p for p in parts if p) + extra)


# -------------------------------------------------------------------------------- outer

def run_cell(args, method, ratio, data_root, log_path):
    """One evaluate.py run (fresh process); returns its results dir (evaluate.py skips a
    cell whose predictions.csv and metrics.json exist, so a rerun resumes)."""
    import yaml
    res = os.path.join(args.out, "results")
    cfg = {
        "output_dir": res, "model": args.model, "dataset": args.dataset, "data_dir": args.data_dir,
        "press_name": method, "compression_ratio": ratio, "device": "cpu", "fraction": 1.0,
        "max_new_tokens": args.max_new_tokens, "log_level": "INFO", "seed": args.seed,
        "model_kwargs": {"dtype": "float32"},
    }
    if args.dataset == "needle_in_haystack":
        cfg.update(needle_depth=args.needle_depth, max_context_length=int(args.data_dir))
        cfg["data_dir"] = None
    os.makedirs(args.out, exist_ok=True)
    extra = f"__max_context{args.data_dir}__needle_depth{args.needle_depth}" if args.dataset == "needle_in_haystack" else ""
    d = results_dir(res, args.dataset, cfg["data_dir"], args.model, method, 0.0 if method == "no_press" else ratio, extra)
    # evaluate.py's own skip never fires (get_results_dir makes a fresh d/<i>/ before it
    # checks), so resuming is done here: a cell with stored predictions is not rerun.
    if _finished(d) or args.report:
        return _finished(d) or d, 0.0
    cfg_path = os.path.join(args.out, f"config-{method}-{ratio:.2f}.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    cmd = [sys.executable, os.path.abspath(__file__), "--inner", "--sdist", args.sdist, "--data", data_root,
           "--threads", str(args.threads), "--kvgc-options", args.kvgc_options, "--",
           f"--config_file={cfg_path}"]
    env = dict(os.environ, KVGC_KVPRESS_LOG=log_path, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(args.threads))
    # The built binding (build/python: the package's sources beside the compiled _kvgc).
    build = os.path.join(os.environ.get("KVGC_BUILD", os.path.join(REPO, "build")), "python")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [build, env.get("PYTHONPATH", "")] if p)
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    with open(os.path.join(args.out, f"log-{method}-{ratio:.2f}.txt"), "w") as f:
        f.write(r.stdout + r.stderr)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-15:])
        print(f"kvpress_harness: {method}@{ratio:.2f} failed (rc {r.returncode}):\n{tail}", file=sys.stderr)
        return None, wall
    return _finished(d) or d, wall


def _finished(d):
    """The newest of d, d/<i>/ holding predictions.csv and metrics.json (evaluate.py
    writes into d/<i>/ when d exists), or None."""
    done = [x for x in [d] + sorted(glob.glob(os.path.join(d, "[0-9]*")), key=os.path.getmtime)
            if os.path.exists(os.path.join(x, "predictions.csv")) and os.path.exists(os.path.join(x, "metrics.json"))]
    return done[-1] if done else None


def kvgc_shares(log_path, cell):
    """Mean KV share (held bytes / f16 full bytes of the context) logged by KvgcPress."""
    if not os.path.exists(log_path):
        return None
    shares = []
    with open(log_path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("cell") == cell:
                shares.append(rec["share"])
    return sum(shares) / len(shares) if shares else None


def nominal_share(method, ratio):
    if method == "no_press":
        return 1.0
    if method.startswith("quanto_int"):
        # HF QuantizedCache after a prefill: every token quantized (its residual, at most
        # 128 full-precision tokens, fills during the decode).
        import anchor_common
        return anchor_common.quantized_cache_share(int(method[len("quanto_int"):]))
    return 1.0 - ratio


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sdist", default=None, help="the unpacked kvpress sdist (default: locate/download)")
    p.add_argument("--sdist-cache", default=os.path.join(CACHE, "kvpress-sdist"))
    p.add_argument("--data", default=None, help="dataset root (default OUT/data)")
    p.add_argument("--out", default=os.path.join(CACHE, "kvpress-harness"))
    p.add_argument("--model", default=os.path.join(CACHE, "smollm2-hf"))
    p.add_argument("--dataset", default="ruler", choices=["ruler", "needle_in_haystack"])
    p.add_argument("--data-dir", default="4096", help="context length (ruler's data_dir)")
    p.add_argument("--tasks", nargs="+", default=["niah_multikey_1"])
    p.add_argument("--rows", type=int, default=8, help="rows per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--needle-depth", type=int, nargs="+", default=[10, 50, 90])
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--methods", nargs="+", default=None,
                   help="METHOD:RATIO cells (default: no_press, kvgc and the presses at 0.9 and 0.8)")
    # harvest "immediate": the GC's page results are applied within the step that made
    # them (kvgc's default, "deferred", applies them one step later so as not to stall a
    # GPU stream; on CPU there is nothing to overlap, and the bytes held right after the
    # prefill would then read one GC behind). Every other option is kvgc's default.
    p.add_argument("--kvgc-options", default='{"harvest": "immediate"}',
                   help="JSON: KvgcPress/heap options for the 'kvgc' entry")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--report", action="store_true", help="only tabulate stored cells (run nothing)")
    args, rest = p.parse_known_args()
    if args.inner:
        return inner(args, rest[1:] if rest[:1] == ["--"] else rest)

    from importlib.metadata import version
    args.sdist = args.sdist or locate_sdist(args.sdist_cache, version("kvpress"))  # the harness of the installed wheel
    data_root = args.data or os.path.join(args.out, "data", f"seed{args.seed}-rows{args.rows}-" + "-".join(sorted(args.tasks)))
    marker = os.path.join(data_root, "ruler", args.data_dir, "test-00000-of-00001.parquet")
    if not os.path.exists(marker):
        sys.path.insert(0, HERE)
        import harness_data
        harness_data.generate(data_root, args.model, args.sdist, [int(args.data_dir)], args.rows, args.seed, args.tasks)
    methods = args.methods or (["no_press:0"] + [f"{m}:{r}" for r in (0.9, 0.8) for m in ["kvgc"] + DEFAULT_PRESSES])
    log_path = os.path.join(args.out, "kvgc-shares.jsonl")

    import pandas as pd
    rows, result = [], []
    for cell in methods:
        method, ratio = cell.split(":")
        ratio = float(ratio)
        d, wall = run_cell(args, method, ratio, data_root, log_path)
        if d is None or not os.path.exists(os.path.join(d, "predictions.csv")):
            rows.append(dict(method=method, ratio=ratio, status="failed", wall=wall))
            continue
        df = pd.read_csv(os.path.join(d, "predictions.csv"), keep_default_na=False)
        df["score"] = row_scores(args.sdist, args.dataset, df)
        metrics = json.load(open(os.path.join(d, "metrics.json")))
        share = kvgc_shares(log_path, f"{method}:{ratio:.2f}") if method.startswith("kvgc") else None
        groups = df.groupby("task") if "task" in df else [("needle", df)]
        for task, g in groups:
            hits, n = int((g["score"] >= 100 - 1e-9).sum()), len(g)
            lo, hi = wilson(hits, n)
            rows.append(dict(method=method, ratio=ratio, task=task, n=n, hits=hits, acc=hits / n, lo=lo, hi=hi,
                             harness=float(g["score"].mean()), share=share if share is not None else nominal_share(method, ratio),
                             measured=share is not None, wall=wall, dir=d, status="ok"))
        print(f"kvpress_harness: {method}@{ratio:.2f}: {wall:.0f} s, metrics {json.dumps(metrics)[:200]}", file=sys.stderr)

    print(f"\n{args.dataset} {args.data_dir}, model {args.model}, seed {args.seed}")
    print("| task | method | compression_ratio | KV share of f16 | rows | full-credit rows | accuracy (Wilson 95%) | harness score | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| - | {r['method']} | {r['ratio']:.2f} | - | - | - | run failed (see log) | - | {r['wall']:.0f} |")
            continue
        star = "" if r["measured"] or r["method"] == "no_press" else " (nominal)"
        print(f"| {r['task']} | {r['method']} | {r['ratio']:.2f} | {100 * r['share']:.1f}%{star} | {r['n']} | {r['hits']} | "
              f"{r['acc']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}] | {r['harness']:.1f} | {r['wall']:.0f} |")
        key = f"{r['task']}_{r['method']}_{round(100 * (1 - r['ratio'])) if r['method'] != 'no_press' else 100}"
        result.append(f"{key}={r['hits']}/{r['n']}")
        if r["measured"]:
            result.append(f"{key}_kv={r['share']:.3f}")
    print("RESULT kvpress_harness " + f"dataset={args.dataset} len={args.data_dir} " + " ".join(result))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
