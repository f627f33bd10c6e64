"""Prefill and decode through transformers: KvgcCache against DynamicCache + SDPA, same run.

    ~/.cache/kvgc/pyvenv/bin/python bench/python_decode.py [--contexts 1024,4096,8192] [--reps 3]
    ~/.cache/kvgc/pyvenv/bin/python bench/python_decode.py --contexts 4096,8192 --chunk 1024
    ~/.cache/kvgc/pyvenv/bin/python bench/python_decode.py --decode [--context 4096] [--new 32]

The venv is the one `make test-python` creates, with the package installed (pip install .);
any Python with torch, transformers and kvgc installed runs it. SmolLM2-135M-Instruct
(float32, from the GGUF `make model` fetches; see python/tests/torch/conftest.py).

Prefill (default): for each context length, one forward of the prompt (logits of its last
token only; --chunk N: N-token forwards, a chunked prefill) into a fresh cache, three
ways: DynamicCache + SDPA, KvgcCache with its default prefill (prefill_attention="sdpa")
and KvgcCache(prefill_attention="kvgc") (every query through kvgc's kernel). The three
are interleaved, --reps times, in a rotating order; the median of each is reported with
its speed against SDPA (SDPA's time / kvgc's: 1.0 is level, above 1 faster) and whether
the next token agrees. The last line:

    RESULT ratio_1k=... ratio_4k=... ratio_8k=... kvgc_ratio_1k=... ... sdpa_1k_s=...

--decode: a --context prompt, then both caches (DynamicCache + SDPA, KvgcCache) decode the
same greedy tokens through a plain forward loop (no generate() overhead on either side);
the median decode step of each as tokens/s and their ratio (kvgc/SDPA). The last line:

    RESULT ratio=... kvgc_tok_s=... sdpa_tok_s=...

kvgc runs policy="full" (nothing evicted, the same attention work as SDPA) unless
--policy says otherwise.
"""

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# The model loader (load_smollm2) is the tests' own; kvgc itself is the installed package.
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests", "torch"))


def context_ids(tok, n):
    text = ("The kvgc heap pages the key-value cache of a language model and ranks every "
            "token by the attention it receives. ")
    ids = tok(text * (n // 10 + 1), return_tensors="pt").input_ids[:, :n]
    assert ids.shape[1] == n, ids.shape
    return ids


def decode(model, cache, ids, new, warmup=3):
    """Prefill, then `new` greedy steps; returns (tokens, step seconds, prefill seconds)."""
    with torch.no_grad():
        t0 = time.perf_counter()
        nxt = model(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1].argmax(-1)
        prefill = time.perf_counter() - t0
        toks, times = [nxt], []
        for i in range(new + warmup):
            t0 = time.perf_counter()
            nxt = model(nxt[:, None], past_key_values=cache).logits[:, -1].argmax(-1)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            toks.append(nxt)
    return torch.stack(toks, 1), times, prefill


def kvgc_cache(args, config, n, prefill_attention=None):
    """A KvgcCache for an n-token prompt (+ --new steps); prefill_attention None: its default."""
    import kvgc.transformers as kt

    opts = {} if prefill_attention is None else {"prefill_attention": prefill_attention}
    return kt.KvgcCache(config, policy=args.policy, kv_dtype=args.kv_dtype,
                        max_tokens=n + args.new + 16, cpu_threads=args.threads,
                        byte_budget=args.byte_budget, **opts)


def prefill_once(model, make_cache, attn, ids, chunk=0):
    """One timed prefill into a fresh cache, in one forward or in `chunk`-token forwards:
    (seconds, next token id)."""
    import kvgc.transformers as kt

    if attn == "kvgc":
        kt.use_kvgc(model)
    else:
        model.set_attn_implementation("sdpa")
    cache = make_cache()
    n = ids.shape[1]
    step = chunk or n
    with torch.no_grad():
        t0 = time.perf_counter()
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            logits = model(ids[:, lo:hi], past_key_values=cache, logits_to_keep=1,
                           cache_position=torch.arange(lo, hi)).logits
        dt = time.perf_counter() - t0
    if hasattr(cache, "close"):
        cache.close()
    return dt, int(logits[0, -1].argmax())


def bench_prefill(args, model, tok):
    from transformers import DynamicCache

    sides = [("sdpa", "sdpa", lambda n: DynamicCache()),
             ("default", "kvgc", lambda n: kvgc_cache(args, model.config, n)),
             ("kvgc", "kvgc", lambda n: kvgc_cache(args, model.config, n, "kvgc"))]
    contexts = [int(c) for c in args.contexts.split(",")]
    warm = context_ids(tok, min(contexts))
    for _, attn, make in sides:  # first-call costs (thread pools, allocator) out of the way
        prefill_once(model, lambda: make(warm.shape[1]), attn, warm, args.chunk)
    how = f"in {args.chunk}-token forwards" if args.chunk else "one forward"
    print(f"prefill ({how}): {args.reps} interleaved repetitions (median), {args.threads} threads, "
          f"kvgc policy={args.policy} byte_budget={args.byte_budget} kv_dtype={args.kv_dtype}")
    print(f"{'tokens':>6}  {'SDPA s':>7}  {'default s':>9}  {'ratio':>5}  {'kvgc s':>7}  "
          f"{'ratio':>5}  same next token")
    ratios, extra = [], []
    for n in contexts:
        ids = context_ids(tok, n)
        times = {name: [] for name, _, _ in sides}
        tokens = set()
        for r in range(args.reps):
            for name, attn, make in sides[r % 3:] + sides[:r % 3]:  # rotate the order
                dt, nxt = prefill_once(model, lambda: make(n), attn, ids, args.chunk)
                times[name].append(dt)
                tokens.add(nxt)
        med = {name: statistics.median(t) for name, t in times.items()}
        ratio, kvgc_ratio = med["sdpa"] / med["default"], med["sdpa"] / med["kvgc"]
        same = len(tokens) == 1
        print(f"{n:>6}  {med['sdpa']:>7.2f}  {med['default']:>9.2f}  {ratio:>5.2f}  "
              f"{med['kvgc']:>7.2f}  {kvgc_ratio:>5.2f}  {'yes' if same else 'NO'}", flush=True)
        key = f"{n // 1024}k" if n % 1024 == 0 else str(n)
        ratios += [f"ratio_{key}={ratio:.3f}", f"kvgc_ratio_{key}={kvgc_ratio:.3f}"]
        extra += [f"sdpa_{key}_s={med['sdpa']:.3f}", f"default_{key}_s={med['default']:.3f}",
                  f"kvgc_{key}_s={med['kvgc']:.3f}", f"same_{key}={int(same)}"]
    print("RESULT " + " ".join(ratios + extra))


def bench_decode(args, model, tok):
    from transformers import DynamicCache

    import kvgc.transformers as kt

    ids = context_ids(tok, args.context)
    model.set_attn_implementation("sdpa")
    sdpa_toks, sdpa_t, sdpa_pre = decode(model, DynamicCache(), ids, args.new)
    kt.use_kvgc(model)
    cache = kvgc_cache(args, model.config, args.context, args.prefill_attention)
    kvgc_toks, kvgc_t, kvgc_pre = decode(model, cache, ids, args.new)

    sdpa_s, kvgc_s = 1 / statistics.median(sdpa_t), 1 / statistics.median(kvgc_t)
    same = torch.equal(sdpa_toks, kvgc_toks)
    print(f"context {args.context} tokens, {args.new} decode steps, {args.threads} threads, "
          f"kvgc policy={args.policy} byte_budget={args.byte_budget} kv_dtype={args.kv_dtype} "
          f"prefill_attention={cache.prefill_attention}")
    print(f"prefill: sdpa {sdpa_pre:.2f} s, kvgc {kvgc_pre:.2f} s")
    print(f"decode:  sdpa {sdpa_s:.2f} tok/s, kvgc {kvgc_s:.2f} tok/s; same tokens: {same}")
    print(f"kvgc: live {cache.live_tokens()} of {cache.get_seq_length()}, "
          f"{cache.kv_bytes() / 2**20:.1f} MiB of pages")
    print(f"RESULT ratio={kvgc_s / sdpa_s:.3f} kvgc_tok_s={kvgc_s:.2f} sdpa_tok_s={sdpa_s:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decode", action="store_true", help="measure decode steps, not prefill")
    ap.add_argument("--contexts", default="1024,4096,8192", help="prefill lengths (tokens)")
    ap.add_argument("--reps", type=int, default=3, help="prefill repetitions of each side")
    ap.add_argument("--chunk", type=int, default=0,
                    help="prefill in forwards of this many tokens (a chunked prefill: each "
                    "forward after the first attends what the earlier ones cached)")
    ap.add_argument("--context", type=int, default=4096, help="--decode: the prompt's length")
    ap.add_argument("--new", type=int, default=32, help="--decode: greedy steps timed")
    ap.add_argument("--threads", type=int, default=2, help="torch and kvgc CPU threads")
    ap.add_argument("--policy", default="full")
    ap.add_argument("--kv-dtype", default="float32")
    ap.add_argument("--byte-budget", type=float, default=None,
                    help="kvgc byte_budget (a fraction of the full cache, e.g. 0.25)")
    ap.add_argument("--prefill-attention", default=None, choices=["kvgc", "sdpa"],
                    help="--decode: KvgcCache(prefill_attention=) (default: the cache's own)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from conftest import load_smollm2

    model, tok = load_smollm2()
    if args.decode:
        bench_decode(args, model, tok)
    else:
        bench_prefill(args, model, tok)


if __name__ == "__main__":
    main()
