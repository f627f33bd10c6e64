#!/usr/bin/env python3
"""Does per-head bit allocation pay? (issue 23, item 4)

kvgc decides a token's storage class once for all KV heads of its layer (a page holds
every head), by the attention mass the prompt's last queries paid it, summed over heads.
Per-head allocation would let each KV head keep its own tokens. It can only pay if the
heads want different tokens; this measures how much, on the real model (SmolLM2-135M,
HF transformers, eager attention, f32), with the mass the *continuation* pays as the
truth, since that is what a kept token is for.

For each prefix of the exported ppl-prefix prompts (kvgc-bench-quality --only ppl-prefix
--export FILE) and each layer:
  observed[g, t]  = attention mass the prefix's last 32 queries (kvgc's observation
                    window) pay token t, summed over the query heads of KV head g;
  future[g, t]    = the same, paid by the 512 continuation queries.
At a keep fraction f of the prefix's evictable tokens (all but the first 4 and the last 32,
which kvgc keeps anyway), two selections of equal size (tokens x heads):
  shared:   the top f by observed summed over heads, the same tokens in every head (kvgc);
  per head: each head's top f by its own observed mass.
Each is scored by the share of future mass (over evictable tokens, all heads) it keeps.
An oracle (each head's top f by future mass) bounds what any selection could keep.

Then the perplexity each selection gives: the continuation teacher-forced with every
evicted prefix token masked out of its head's attention (the prefix itself computed with
every token, as kvgc's prefill is), all in f32, so the selection is the only difference:
kvgc's shared choice against per-head choices at equal tokens x heads.

Usage: python bench/per_head_mass.py TASKS.jsonl [--model DIR] [--fractions 0.1,0.3]
(--model: a Llama-architecture checkpoint; the masks hook its eager attention.)
Prints a table and one `RESULT` line (per-head minus shared recall, the gain).
"""
import argparse
import collections
import json
import math
import os
import sys

import torch
import transformers.models.llama.modeling_llama as llama
from transformers import AutoModelForCausalLM

SINKS, WINDOW = 4, 32


def recall(sel_mask, future):
    """Share of `future` mass (heads x tokens) inside the boolean mask (heads x tokens)."""
    total = future.sum()
    return float((future * sel_mask).sum() / total) if total > 0 else 1.0


def top_mask(score, k):
    """Per row of `score` (heads x tokens), a mask of its k largest entries."""
    mask = torch.zeros_like(score, dtype=torch.bool)
    idx = score.topk(k, dim=-1).indices
    mask.scatter_(-1, idx, True)
    return mask


def selections(observed, k):
    """kvgc's shared choice (the top k by mass summed over heads, in every head) and the
    per-head one (each head's own top k), as masks (heads x tokens)."""
    return {"shared": top_mask(observed.sum(0, keepdim=True), k).expand_as(observed),
            "per head": top_mask(observed, k)}


# layer -> [kv heads, prefix] bool: which prefix tokens the continuation may attend to.
KEEP = {}


def masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention, plus: queries past the prefix see only their head's kept tokens."""
    key_states = llama.repeat_kv(key, module.num_key_value_groups)
    value_states = llama.repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask[:, :, :, : key_states.shape[-2]]
    keep = KEEP.get(module.layer_idx)
    if keep is not None:
        n = keep.shape[-1]
        heads = keep.repeat_interleave(module.num_key_value_groups, dim=0)  # [heads, n]
        drop = torch.where(heads, 0.0, float("-inf")).to(w.dtype)
        w[:, :, n:, :n] = w[:, :, n:, :n] + drop[None, :, None, :]
    w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(w, value_states).transpose(1, 2).contiguous()
    return out, w


def continuation_nll(model, ids, n):
    """Sum of -log p of the continuation's tokens n..T-1, each predicted from the position
    before it."""
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0]
    logp = torch.log_softmax(logits[n - 1:-1].float(), dim=-1)
    target = ids[0, n:]
    return float(-logp.gather(1, target[:, None]).sum()), int(target.numel())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tasks")
    p.add_argument("--model", default=os.path.expanduser("~/.cache/kvgc/smollm2-hf"))
    p.add_argument("--fractions", default="0.1,0.3")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fractions = [float(x) for x in args.fractions.split(",")]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    prompts = [json.loads(line) for line in open(args.tasks)]
    prompts = [t for t in prompts if t.get("task") == "ppl-prefix"]
    if not prompts:
        sys.exit(f"{args.tasks}: no ppl-prefix prompts (export them with kvgc-bench-quality)")
    # sums[f][which] over layers and prefixes; nll[(which, f)] = [sum, tokens]
    sums = {f: {"shared": 0.0, "per head": 0.0, "oracle": 0.0, "overlap": 0.0} for f in fractions}
    cells = 0
    nll = collections.defaultdict(lambda: [0.0, 0])
    llama.eager_attention_forward = masked_attention
    for t in prompts:
        n = t["prefix"]
        ids = torch.tensor([t["tokens"]])
        with torch.no_grad():
            out = model(ids, output_attentions=True, use_cache=False)
        ev = slice(SINKS, n - WINDOW)  # the evictable prefix tokens
        ks = {f: max(1, round(f * (n - WINDOW - SINKS))) for f in fractions}
        chosen = {f: [] for f in fractions}  # per layer, selections()
        for att in out.attentions:  # [1, heads, T, T]
            a = att[0].reshape(cfg.num_key_value_heads, group, *att.shape[-2:]).sum(1)
            observed = a[:, n - WINDOW:n, :n].sum(1)[:, ev]
            future = a[:, n:, :n].sum(1)[:, ev]
            for f, k in ks.items():
                sel = selections(observed, k)
                chosen[f].append(sel)
                for which, mask in sel.items():
                    sums[f][which] += recall(mask, future)
                sums[f]["oracle"] += recall(top_mask(future, k), future)
                # how alike the heads' own choices are: mean pairwise overlap of their sets
                h = sel["per head"].float()
                shared = (h @ h.T) / k
                pairs = h.shape[0] * (h.shape[0] - 1)
                sums[f]["overlap"] += float((shared.sum() - shared.diagonal().sum()) / max(1, pairs))
            cells += 1
        del out
        KEEP.clear()
        x, m = continuation_nll(model, ids, n)
        nll["full"][0] += x
        nll["full"][1] += m
        for f in fractions:
            for which in ("shared", "per head"):
                for layer, sel in enumerate(chosen[f]):
                    keep = torch.ones(sel[which].shape[0], n, dtype=torch.bool)
                    keep[:, ev] = sel[which]
                    KEEP[layer] = keep
                x, m = continuation_nll(model, ids, n)
                nll[(which, f)][0] += x
                nll[(which, f)][1] += m
        KEEP.clear()
        print(f"  {t['id']}: done", file=sys.stderr, flush=True)
    print(f"future-mass recall of a {WINDOW}-query observed selection, {len(prompts)} prefixes "
          f"x {cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} KV heads:")
    print(f"{'keep':>6} {'shared (kvgc)':>14} {'per head':>9} {'oracle':>7} {'head overlap':>13}")
    result = []
    for f in fractions:
        s = {k: v / cells for k, v in sums[f].items()}
        print(f"{f:6.2f} {s['shared']:14.3f} {s['per head']:9.3f} {s['oracle']:7.3f} {s['overlap']:13.3f}")
        tag = f"{f:g}".replace(".", "_")
        result += [f"gain_{tag}={s['per head'] - s['shared']:+.3f}", f"shared_{tag}={s['shared']:.3f}",
                   f"per_head_{tag}={s['per head']:.3f}", f"oracle_{tag}={s['oracle']:.3f}",
                   f"overlap_{tag}={s['overlap']:.3f}"]
    full = math.exp(nll["full"][0] / nll["full"][1])
    print(f"\ncontinuation perplexity over the full cache's ({full:.3f}), f32, no quantization:")
    print(f"{'keep':>6} {'shared (kvgc)':>14} {'per head':>9}")
    for f in fractions:
        ppl = {w: math.exp(nll[(w, f)][0] / nll[(w, f)][1]) / full for w in ("shared", "per head")}
        print(f"{f:6.2f} {ppl['shared']:13.3f}x {ppl['per head']:8.3f}x")
        tag = f"{f:g}".replace(".", "_")
        result += [f"ppl_gain_{tag}={ppl['shared'] - ppl['per head']:+.4f}",
                   f"ppl_shared_{tag}={ppl['shared']:.4f}", f"ppl_per_head_{tag}={ppl['per head']:.4f}"]
    gains = [r for r in result if "gain" in r]
    print("RESULT " + " ".join(gains + [r for r in result if "gain" not in r]))


if __name__ == "__main__":
    main()
