"""Shared pieces of the anchor scripts (bench/anchors/*_quality.py): the tasks file that
kvgc-bench-quality --export writes (kvgc's token ids, so every side reads the same ids),
greedy answers, scoring, and the results file (JSON lines, the format kvgc-bench-quality
--results writes; bench/anchors/report.py reads them all)."""
import argparse
import json
import math
import os
import re
import sys
import time

DEFAULT_MODEL = os.path.expanduser("~/.cache/kvgc/SmolLM2-135M-Instruct.Q4_1.gguf")


def common_args(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tasks", required=True,
                   help="kvgc-bench-quality --export FILE: the prompts as kvgc's token ids")
    p.add_argument("--out", required=True, help="results, one JSON line per run")
    p.add_argument("--model", default=os.environ.get("KVGC_MODEL", DEFAULT_MODEL))
    p.add_argument("--only", action="append", default=[],
                   help="task names to run (passkey, needle, ppl-prefix, ppl-stream, ...)")
    p.add_argument("--contexts", default="", help="only prompts of these contexts, e.g. 1024")
    p.add_argument("--limit", type=int, default=0, help="at most this many prompts per task")
    p.add_argument("--threads", type=int, default=2)
    return p


def load_tasks(args):
    """The exported prompts, filtered by --only / --contexts / --limit."""
    if not os.path.exists(args.tasks):
        sys.exit(f"{args.tasks}: not found (write it with kvgc-bench-quality --export FILE)")
    contexts = {int(c) for c in args.contexts.split(",") if c}
    per_task, out = {}, []
    with open(args.tasks) as f:
        for n, line in enumerate(f, 1):
            try:
                t = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{args.tasks}:{n}: not JSON: {e}")
            if args.only and t["task"] not in args.only:
                continue
            ctx = t.get("context", t.get("prefix", 0))
            if contexts and ctx not in contexts and t["task"] != "ppl-stream":
                continue
            per_task[t["task"]] = per_task.get(t["task"], 0) + 1
            if args.limit and per_task[t["task"]] > args.limit:
                continue
            out.append(t)
    if not out:
        sys.exit(f"{args.tasks}: no prompt matches the selection")
    return out


class Results:
    def __init__(self, path, side):
        self.f = open(path, "a")
        self.side = side

    def write(self, **fields):
        self.f.write(json.dumps({"side": self.side, **fields}) + "\n")
        self.f.flush()


def contains(text, expect, match=None):
    """Whether an answer holds the key, as kvgc-bench-quality scores it: case-insensitive
    containment; match "words" (hyphenated word keys): any run of hyphens and blanks in the
    answer reads as one hyphen."""
    text = text.lower()
    if match == "words":
        text = re.sub(r"[-\s]+", "-", text)
    return expect in text


def nll_of(logits_rows, targets):
    """Sum of -log softmax(row)[target] (rows: numpy or torch float32 [n][vocab])."""
    import numpy as np
    rows = np.asarray(logits_rows, dtype=np.float64)
    m = rows.max(axis=1, keepdims=True)
    lse = np.log(np.exp(rows - m).sum(axis=1)) + m[:, 0]
    return float((lse - rows[np.arange(len(targets)), targets]).sum())


def progress(msg):
    print(msg, file=sys.stderr, flush=True)


class Timer:
    def __init__(self):
        self.t = time.monotonic()

    def __call__(self):
        return time.monotonic() - self.t


def ppl(nll, n):
    return math.exp(nll / n) if n else float("nan")


def quantized_cache_share(bits, quantized=1, residual=0, group=64, scale_bits=16):
    """HF QuantizedCache's share of an f16 cache's bytes: `bits` per element plus a scale
    and a zero-point per group of `group` elements for its quantized tokens, its residual
    tokens (at most residual_length, full precision) at 16 bits. Scales are counted at f16,
    as an f16 engine stores them (quanto keeps the model's dtype: f32 on the CPU runs)."""
    n = quantized + residual
    if n == 0:
        return 1.0
    return ((bits + 2 * scale_bits / group) / 16 * quantized + residual) / n
