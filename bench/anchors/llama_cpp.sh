#!/usr/bin/env bash
# kvgc-run beside llama.cpp on the same GGUF, the same prompt token ids (kvgc's tokenizer;
# llama.cpp is fed ids, not text) and the same threads. llama.cpp is llama-cpp-python from
# PyPI, compiled from its sdist for this CPU by bench/anchors/venv.sh (never vendored).
# Not part of `make test`.
#
#   bench/anchors/llama_cpp.sh [speed]  prefill and decode rates and peak RSS, each engine in
#       a fresh process per repetition, the two interleaved (alternating which goes first);
#       RESULT line with the kvgc/llama.cpp ratios first (the median of each repetition's
#       ratio), then the median rates.
#   bench/anchors/llama_cpp.sh ppl      full-cache perplexity over the first PPL_TOKENS ids of
#       PPL_TEXT: kvgc-run (f16 and f32 K/V, q8 and exact matmuls) and llama.cpp (f16 and
#       f32 cache, logits for every position).
#
# Environment (defaults in brackets):
#   BUILD [build]  THREADS [CPUs in the affinity mask]  REPS [3]  GEN [128 decode steps]
#   PROMPT_BYTES [5200: bytes of bench/quality_data/gpl-3.txt, 1,138 tokens]
#   PPL_TEXT [bench/quality_data/jargon-intro.txt]  PPL_TOKENS [1024]
#   KVGC_MODEL [~/.cache/kvgc/SmolLM2-135M-Instruct.Q4_1.gguf]
#
# Peak RSS is each child's ru_maxrss (getrusage of the waited-for process). llama.cpp runs
# inside a Python interpreter; the interpreter's own peak with llama_cpp and numpy imported
# and no model loaded is measured the same way and subtracted ("net"), so the ratio is
# against llama.cpp's own memory (the raw figure is printed too).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
mode="${1:-speed}"
build="${BUILD:-build}"
run="$root/$build/tools/kvgc-run"
[ -x "$run" ] || { echo "llama_cpp.sh: $run not built (make build)" >&2; exit 1; }
model="${KVGC_MODEL:-$HOME/.cache/kvgc/SmolLM2-135M-Instruct.Q4_1.gguf}"
[ -f "$model" ] || { echo "llama_cpp.sh: model $model not found (tools/fetch-model.sh)" >&2; exit 1; }
threads="${THREADS:-$(nproc)}"
py="$("$root/bench/anchors/venv.sh" llama)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cat > "$work/anchor.py" <<'PYEOF'
import json, os, re, statistics, subprocess, sys

def run_measured(cmd, env=None):
    """Runs cmd; (stdout, stderr, peak RSS in KiB of that child alone, from wait4)."""
    with open(os.path.join(WORK, "out"), "w+") as out, open(os.path.join(WORK, "err"), "w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if p.returncode != 0:
        sys.exit(f"llama_cpp.sh: {' '.join(cmd[:3])} ... failed ({p.returncode}):\n{stderr[-2000:]}")
    return stdout, stderr, usage.ru_maxrss

LLAMA_CHILD = r'''
import os, sys, time, json
import numpy as np
import llama_cpp
from llama_cpp import Llama
mode, model, ids_path, threads, gen, type_k = sys.argv[1:7]
ids = [int(x) for x in open(ids_path).read().split(",")]
threads, gen = int(threads), int(gen)
if mode == "baseline":
    print(json.dumps({})); sys.exit(0)
kv = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[type_k]
if mode == "speed":
    n_ctx = (len(ids) + gen + 255) // 256 * 256  # the context the run needs, as llama.cpp pads it
    llm = Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=512, type_k=kv, type_v=kv, verbose=False)
    n_vocab = llm.n_vocab()
    last = lambda: int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))))
    t0 = time.perf_counter(); llm.eval(ids); t1 = time.perf_counter()
    token = last()
    t2 = time.perf_counter()
    for _ in range(gen):  # gen forward steps after the prompt, greedy
        llm.eval([token])
        token = last()
    t3 = time.perf_counter()
    print(json.dumps({"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": gen / (t3 - t2)}))
else:  # ppl: logits at every position
    n = gen
    llm = Llama(model_path=model, n_ctx=(n + 255) // 256 * 256, n_threads=threads,
                n_threads_batch=threads, n_batch=512, logits_all=True, type_k=kv, type_v=kv,
                verbose=False)
    llm.eval(ids[:n])
    scores = np.asarray(llm.scores[:n], dtype=np.float64)
    top = scores.max(axis=1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(scores - top).sum(axis=1))
    nll = logz - scores[np.arange(n), ids[1:n + 1]]
    print(json.dumps({"ppl": float(np.exp(nll.mean()))}))
'''

WORK = sys.argv[5]

def main():
    mode, run, model, threads, work = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    child = os.path.join(work, "llama_child.py")
    open(child, "w").write(LLAMA_CHILD)
    env = dict(os.environ, KVGC_POLICY="full")
    if mode == "speed":
        reps, gen = int(os.environ.get("REPS", 3)), int(os.environ.get("GEN", 128))
        prompt = os.path.join(work, "prompt.txt")
        data = open(os.path.join(os.environ["ROOT"], "bench/quality_data/gpl-3.txt"), "rb").read()
        open(prompt, "wb").write(data[: int(os.environ.get("PROMPT_BYTES", 5200))])
        ids_out, _, _ = run_measured([run, "--model", model, "--prompt-file", prompt, "--print-prompt-ids"], env)
        ids_path = os.path.join(work, "ids.txt")
        open(ids_path, "w").write(ids_out.strip())
        n_prompt = len(ids_out.strip().split(","))
        _, _, base_kb = run_measured([sys.executable, child, "baseline", model, ids_path, threads, "0", "f16"])
        kvgc, llama = [], []
        def run_kvgc():
            _, err, kb = run_measured([run, "--model", model, "--prompt-file", prompt, "--threads", threads,
                                       "--max-tokens", str(gen + 1), "--ignore-eos"], env)
            # kvgc-run's closing statistics, e.g. "  prefill   540.0 tok/s (2.10 s)".
            get = lambda key, unit: float(re.search(r"^\s+" + key + r"\s+([0-9.]+)" + unit, err, re.M).group(1))
            kvgc.append({"prefill_tok_s": get("prefill", " tok/s"), "decode_tok_s": get("decode", " tok/s"),
                         "kvgc_pct": get("time in kvgc", "%"), "rss_kb": kb})
        def run_llama():
            out, _, kb = run_measured([sys.executable, child, "speed", model, ids_path, threads, str(gen), "f16"])
            r = json.loads(out); r["rss_kb"] = kb; llama.append(r)
        for rep in range(reps):
            order = (run_kvgc, run_llama) if rep % 2 == 0 else (run_llama, run_kvgc)
            for f in order: f()
            print(f"rep {rep + 1}/{reps}: kvgc prefill {kvgc[-1]['prefill_tok_s']:.1f} decode {kvgc[-1]['decode_tok_s']:.1f} "
                  f"tok/s rss {kvgc[-1]['rss_kb']/1024:.0f} MiB | llama.cpp prefill {llama[-1]['prefill_tok_s']:.1f} "
                  f"decode {llama[-1]['decode_tok_s']:.1f} tok/s rss {llama[-1]['rss_kb']/1024:.0f} MiB", flush=True)
        med = lambda rows, k: statistics.median(r[k] for r in rows)
        # Ratios per repetition (the two runs of a repetition are adjacent in time, so load
        # from other processes hits both alike), then their median.
        ratio = lambda k: statistics.median(a[k] / b[k] for a, b in zip(kvgc, llama))
        kp, kd, kr = med(kvgc, "prefill_tok_s"), med(kvgc, "decode_tok_s"), med(kvgc, "rss_kb") / 1024
        lp, ld, lr = med(llama, "prefill_tok_s"), med(llama, "decode_tok_s"), med(llama, "rss_kb") / 1024
        base = base_kb / 1024
        print(f"RESULT decode_vs_llama={ratio('decode_tok_s'):.2f} prefill_vs_llama={ratio('prefill_tok_s'):.2f} "
              f"rss_vs_llama={kr / (lr - base):.2f} kvgc_decode_tok_s={kd:.1f} llama_decode_tok_s={ld:.1f} "
              f"kvgc_prefill_tok_s={kp:.1f} llama_prefill_tok_s={lp:.1f} kvgc_rss_mib={kr:.0f} "
              f"llama_rss_mib={lr - base:.0f} llama_rss_raw_mib={lr:.0f} python_baseline_mib={base:.0f} "
              f"kvgc_time_in_kvgc_pct={med(kvgc, 'kvgc_pct'):.1f} threads={threads} prompt_tokens={n_prompt} "
              f"decode_steps={os.environ.get('GEN', 128)} reps={reps}")
    else:
        n = int(os.environ.get("PPL_TOKENS", 1024))
        text = os.environ.get("PPL_TEXT", os.path.join(os.environ["ROOT"], "bench/quality_data/jargon-intro.txt"))
        ids_out, _, _ = run_measured([run, "--model", model, "--prompt-file", text, "--print-prompt-ids"], env)
        ids_path = os.path.join(work, "ids.txt")
        open(ids_path, "w").write(ids_out.strip())
        res = {}
        for kv in ("f16", "f32"):
            out, _, _ = run_measured([sys.executable, child, "ppl", model, ids_path, threads, str(n), kv])
            res[f"llama_{kv}"] = json.loads(out)["ppl"]
            for mm in ("q8", "exact"):
                out, _, _ = run_measured([run, "--model", model, "--prompt-file", text, "--threads", threads,
                                          "--perplexity", str(n), "--kv-dtype", kv, "--matmul", mm], env)
                res[f"kvgc_{mm}_{kv}"] = float(re.search(r"perplexity ([0-9.]+)", out).group(1))
        for k, v in res.items(): print(f"{k:16s} {v:.4f}")
        print(f"RESULT kvgc_f16_vs_llama_f16={res['kvgc_q8_f16'] / res['llama_f16']:.4f} "
              f"kvgc_f32_vs_llama_f32={res['kvgc_q8_f32'] / res['llama_f32']:.4f} "
              + " ".join(f"ppl_{k}={v:.4f}" for k, v in res.items()) + f" tokens={n}")

main()
PYEOF
ROOT="$root" "$py" "$work/anchor.py" "$mode" "$run" "$model" "$threads" "$work"
