"""Decode speed: KvgcCache + kvgc attention vs DynamicCache + SDPA, same model, same run.

    PYTHONPATH=build/python python bench/python_decode.py [--context 4096] [--new 32]

SmolLM2-135M-Instruct (float32, from the GGUF `make model` fetches; see
python/tests/torch/conftest.py) gets a ~4K-token context, then both caches decode the
same greedy tokens through a plain forward loop (no generate() overhead on either side).
Reported: the median decode step of each side as tokens/s, and their ratio (kvgc/SDPA).
kvgc runs policy="full" (nothing evicted, the same attention work as SDPA) unless
--policy says otherwise. The last line is machine-readable:

    RESULT ratio=... kvgc_tok_s=... sdpa_tok_s=...
"""

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# python/kvgc here is the source tree without the built _kvgc: import kvgc from PYTHONPATH.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.join(HERE, "tests", "torch"))


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch and kvgc CPU threads")
    ap.add_argument("--policy", default="full")
    ap.add_argument("--kv-dtype", default="float32")
    ap.add_argument("--byte-budget", type=float, default=None,
                    help="kvgc byte_budget (a fraction of the full cache, e.g. 0.25)")
    ap.add_argument("--prefill-attention", default="kvgc", choices=["kvgc", "sdpa"],
                    help="KvgcCache(prefill_attention=): who attends the unscored prefill")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    import kvgc.transformers as kt
    from conftest import load_smollm2

    model, tok = load_smollm2()
    ids = context_ids(tok, args.context)

    model.set_attn_implementation("sdpa")
    sdpa_toks, sdpa_t, sdpa_pre = decode(model, DynamicCache(), ids, args.new)
    kt.use_kvgc(model)
    cache = kt.KvgcCache(model.config, policy=args.policy, kv_dtype=args.kv_dtype,
                         max_tokens=args.context + args.new + 16, cpu_threads=args.threads,
                         prefill_attention=args.prefill_attention,
                         byte_budget=args.byte_budget)
    kvgc_toks, kvgc_t, kvgc_pre = decode(model, cache, ids, args.new)

    sdpa_s, kvgc_s = 1 / statistics.median(sdpa_t), 1 / statistics.median(kvgc_t)
    same = torch.equal(sdpa_toks, kvgc_toks)
    print(f"context {args.context} tokens, {args.new} decode steps, {args.threads} threads, "
          f"kvgc policy={args.policy} byte_budget={args.byte_budget} kv_dtype={args.kv_dtype} "
          f"prefill_attention={args.prefill_attention}")
    print(f"prefill: sdpa {sdpa_pre:.2f} s, kvgc {kvgc_pre:.2f} s")
    print(f"decode:  sdpa {sdpa_s:.2f} tok/s, kvgc {kvgc_s:.2f} tok/s; same tokens: {same}")
    print(f"kvgc: live {cache.live_tokens()} of {cache.get_seq_length()}, "
          f"{cache.kv_bytes() / 2**20:.1f} MiB of pages")
    print(f"RESULT ratio={kvgc_s / sdpa_s:.3f} kvgc_tok_s={kvgc_s:.2f} sdpa_tok_s={sdpa_s:.2f}")


if __name__ == "__main__":
    main()
