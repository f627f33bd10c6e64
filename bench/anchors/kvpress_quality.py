#!/usr/bin/env python3
"""NVIDIA kvpress presses on kvgc-bench-quality's tasks: kvpress (PyPI, 0.5.5) on HF
transformers (CPU, float32), reading the same GGUF (transformers' gguf_file= loader), fed
kvgc's token ids (kvgc-bench-quality --export; transformers' GGUF tokenizer drops SmolLM2's
digit pre-splitter, so its own ids would differ).

As in kvgc's observe prefill, the question is compressed with the context: the whole
prompt is prefilled under the press (the press compresses each layer's cache after its
prefill attention), the first answer token comes from that prefill's logits, and the rest
is decoded greedily from the compressed cache, positions continuing from the prompt's
length (as kvpress's own pipeline does). A prompt exported with "question_at"
(kinds-after) is kvpress's own setting instead: only the context (tokens[:question_at])
is prefilled under the press, the question (tokens[question_at:]) then runs with no
press, appended to the compressed cache at the positions that follow, and the first answer
token comes from its last logits. Perplexity tasks: the prefix is prefilled under the
press, then the continuation is scored teacher-forced with no press.

kv_fraction is the share of the prompt's tokens (with question_at, of the context's) the
press kept (at f16, an engine's K/V dtype: the same as its share of an f16 full cache's
bytes); AdaKV and KVzip keep the full tensors and mask the evicted entries, so their
figure is their nominal share.

--quantized adds HF's quantized cache (transformers' QuantizedCache, KIVI-style: every
token quantized at the prefill, a full-precision residual of up to 128 tokens during the
decode, groups of 64 with a scale and a zero-point), no press: configs quanto_int4 and
quanto_int2 (optimum-quanto) or hqq_int4 ... (hqq). Its kv_fraction is its bytes' share of
an f16 cache after the prefill (anchor_common.quantized_cache_share: scales at f16).

  python=$(bench/anchors/venv.sh kvpress)
  $python bench/anchors/kvpress_quality.py --tasks /tmp/tasks.jsonl --out /tmp/kvpress.jsonl
"""
import os

# Quiet: no download or conversion progress bars in the run's log.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TQDM_DISABLE", "1")

import anchor_common as ac  # noqa: E402

PRESSES = ["streaming_llm", "snapkv", "observed_attention", "tova", "knorm", "keydiff",
           "expected_attention", "adakv_snapkv", "kvzip"]


def make_press(name, ratio):
    import kvpress
    r = ratio
    if name == "streaming_llm":
        return kvpress.StreamingLLMPress(compression_ratio=r)
    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=r)
    if name == "observed_attention":
        return kvpress.ObservedAttentionPress(compression_ratio=r)
    if name == "tova":
        return kvpress.TOVAPress(compression_ratio=r)
    if name == "knorm":
        return kvpress.KnormPress(compression_ratio=r)
    if name == "keydiff":
        return kvpress.KeyDiffPress(compression_ratio=r)
    if name == "expected_attention":
        return kvpress.ExpectedAttentionPress(compression_ratio=r)
    if name == "adakv_snapkv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=r))
    if name == "kvzip":
        return kvpress.KVzipPress(compression_ratio=r)
    raise SystemExit(f"--presses: unknown press {name!r} (known: {', '.join(PRESSES)})")


def load_model(path, eager):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
        attn_implementation="eager" if eager else "sdpa")
    model.eval()
    return model


def kept_fraction(cache, n):
    if hasattr(cache, "layers"):
        lens = [layer.keys.shape[-2] for layer in cache.layers]
    else:
        lens = [k.shape[-2] for k in cache.key_cache]
    return sum(lens) / len(lens) / n


def make_cache(model, quantized):
    """A DynamicCache, or (quantized = (backend, bits)) HF's QuantizedCache."""
    from transformers import DynamicCache
    if quantized is None:
        return DynamicCache()
    from transformers import QuantizedCache
    return QuantizedCache(backend=quantized[0], config=model.config, nbits=quantized[1])


def quantized_fraction(cache, bits):
    """A QuantizedCache's share of an f16 cache's bytes (the mean over its layers)."""
    shares = []
    for layer in cache.layers:
        residual = layer.keys.shape[-2] if layer.keys is not None and layer.keys.dim() == 4 else 0
        quantized = layer.cumulative_length - residual
        shares.append(ac.quantized_cache_share(bits, quantized, residual))
    return sum(shares) / len(shares)


def held_share(name, k, q, cache, n):
    """The share of an f16 cache's bytes a configuration holds after an n-token prefill."""
    if q:
        return quantized_fraction(cache, q[1])
    return k if name in ("adakv_snapkv", "kvzip") else kept_fraction(cache, n)


def budget_fields(k, q, frac):
    """A result's budget and fraction: HF's quantized cache is a byte share, a press a
    share of the tokens, no press none."""
    if q:
        return {"budget": "bytes", "fraction": frac}
    return {"budget": "none", "fraction": 1.0} if k is None else {"budget": "tokens", "fraction": k}


def parse_quantized(spec):
    """--quantized "quanto:4,quanto:2" -> [("quanto", 4), ("quanto", 2)]."""
    out = []
    for item in (x for x in spec.split(",") if x):
        backend, _, bits = item.partition(":")
        if backend not in ("quanto", "hqq") or not bits.isdigit():
            raise SystemExit(f"--quantized: {item!r} is not BACKEND:BITS (backend quanto or hqq)")
        out.append((backend, int(bits)))
    return out


def prefill(model, press, ids, quantized=None):
    """The prompt through the model under the press; (last logits, cache)."""
    import torch
    cache = make_cache(model, quantized)
    x = torch.tensor([ids])
    with torch.no_grad():
        if press is None:
            out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        else:
            with press(model):
                out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1], cache


def question(model, cache, ids, n):
    """ids[n:] (the question) appended to the compressed cache with no press, at positions
    n...; its last logits."""
    import torch
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids[n:]]), past_key_values=cache,
                    position_ids=torch.arange(n, len(ids)).unsqueeze(0), use_cache=True,
                    logits_to_keep=1)
    return out.logits[0, -1]


def answer(model, logits, cache, n, t):
    import torch
    generated, text = [], ""
    pos = n
    with torch.no_grad():
        for _ in range(t["answer_tokens"]):
            token = int(torch.argmax(logits))
            if token in t["stop"]:
                break
            generated.append(token)
            text = DECODE(generated)
            if ac.contains(text, t["expect"], t.get("match")):
                break
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                        position_ids=torch.tensor([[pos]]), use_cache=True)
            pos += 1
            logits = out.logits[0, -1]
    return text


def continuation_nll(model, cache, ids, prefix, first):
    import torch
    cont = ids[prefix:len(ids) - 1]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([cont]), past_key_values=cache,
                    position_ids=torch.arange(prefix, prefix + len(cont)).unsqueeze(0),
                    use_cache=True)
    targets = ids[prefix + 1:]
    return ac.nll_of(out.logits[0].float().numpy(), targets), len(targets)


DECODE = None


def main():
    global DECODE
    p = ac.common_args(__doc__)
    p.add_argument("--presses", default=",".join(PRESSES))
    p.add_argument("--kept", default="0.1,0.2,0.5",
                   help="shares of the prompt's tokens kept (compression_ratio = 1 - kept)")
    p.add_argument("--no-full", action="store_true", help="skip the no-press baseline")
    p.add_argument("--quantized", default="",
                   help="HF's quantized cache, no press: BACKEND:BITS,... (e.g. quanto:4,quanto:2)")
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    from gguf import GGUFReader  # noqa: F401  (the loader needs it; fail early and clearly)
    tasks = ac.load_tasks(args)
    out = ac.Results(args.out, "kvpress")
    presses = [x for x in args.presses.split(",") if x]
    kept = [float(x) for x in args.kept.split(",") if x]
    models = {}

    def model_for(name):
        eager = name == "observed_attention"
        if eager not in models:
            models[eager] = load_model(args.model, eager)
        return models[eager]

    # Detokenization of answers only (ids never come from this tokenizer).
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.dirname(args.model),
                                        gguf_file=os.path.basename(args.model))
    DECODE = lambda ids: tok.decode(ids)  # noqa: E731
    # KVzip reads the tokenizer (for the chat template) from model.config.name_or_path:
    # the GGUF's, saved as tokenizer files.
    import tempfile
    tok_dir = tempfile.mkdtemp(prefix="kvgc-anchors-tok-")
    tok.save_pretrained(tok_dir)
    quant = {f"{b}_int{n}": (b, n) for b, n in parse_quantized(args.quantized)}
    configs = ([] if args.no_full else [("no_press", None)]) + \
        [(name, None) for name in quant] + [(name, k) for name in presses for k in kept]
    for name, k in configs:
        q = quant.get(name)
        model = model_for(name if k is not None else "")
        model.config.name_or_path = tok_dir
        for t in tasks:
            timer = ac.Timer()
            ids = t["tokens"]
            try:
                press = None if k is None else make_press(name, 1.0 - k)
                if t["kind"] == "retrieval":
                    n = t.get("question_at", len(ids))  # the press sees ids[:n] only
                    logits, cache = prefill(model, press, ids[:n], q)
                    frac = held_share(name, k, q, cache, n)
                    if n < len(ids):
                        logits = question(model, cache, ids, n)
                    text = answer(model, logits, cache, len(ids), t)
                    ok = ac.contains(text, t["expect"], t.get("match"))
                    out.write(task=t["task"], id=t["id"], context=t["context"],
                              depth=t["depth"], mode="observe", config=name,
                              **budget_fields(k, q, frac), correct=ok, kv_fraction=frac, answer=text)
                    ac.progress(f"  kvpress {name} {k} {t['id']}: {'ok  ' if ok else 'MISS'} "
                                f"kv {frac:.3f} ({timer():.1f} s) {text!r}")
                else:
                    if t["task"] != "ppl-prefix":
                        continue  # streaming perplexity: presses compress prefills only
                    prefix = t["prefix"]
                    _, cache = prefill(model, press, ids[:prefix], q)
                    frac = held_share(name, k, q, cache, prefix)
                    nll, n = continuation_nll(model, cache, ids, prefix, t["score_from"])
                    out.write(task=t["task"], id=t["id"], context=prefix, mode="observe",
                              config=name, **budget_fields(k, q, frac), nll_sum=nll, scored=n,
                              perplexity=ac.ppl(nll, n), kv_fraction=frac)
                    ac.progress(f"  kvpress {name} {k} {t['id']}: perplexity "
                                f"{ac.ppl(nll, n):.3f} kv {frac:.3f} ({timer():.1f} s)")
            except Exception as e:  # a press that cannot run here: say so, go on
                ac.progress(f"  kvpress {name} {k} {t['id']}: FAILED: {type(e).__name__}: {e}")
                out.write(task=t["task"], id=t["id"], config=name, fraction=k,
                          error=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
