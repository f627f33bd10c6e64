#!/usr/bin/env python3
"""llama.cpp's quantized K/V caches on kvgc-bench-quality's tasks, through llama-cpp-python
(PyPI), same GGUF, same token ids (kvgc-bench-quality --export). Caches: f16 (llama.cpp's
default, the 100% of every byte share), q8_0 and q4_0 for K and V (a quantized V cache
needs flash attention, so every cache type runs with it). Logits at every position.

Each run writes one JSON line: kv_fraction is the cache type's bytes per element over
f16's (q8_0: 34 bytes per 32 elements = 0.531, q4_0: 18/32 = 0.281), for every token.

  python=$(bench/anchors/venv.sh llama)
  build/tools/kvgc-bench-quality --export /tmp/tasks.jsonl
  $python bench/anchors/llama_quality.py --tasks /tmp/tasks.jsonl --out /tmp/llama.jsonl
"""
import numpy as np

import anchor_common as ac

# cache type: (ggml type name, bytes per element / f16's)
CACHES = {"f16": ("GGML_TYPE_F16", 1.0), "q8_0": ("GGML_TYPE_Q8_0", 34 / 32 / 2),
          "q4_0": ("GGML_TYPE_Q4_0", 18 / 32 / 2)}


def open_model(path, cache, n_ctx, threads):
    import llama_cpp
    ggml_type = getattr(llama_cpp, CACHES[cache][0])
    kwargs = dict(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                  n_threads_batch=threads, type_k=ggml_type, type_v=ggml_type,
                  logits_all=True, verbose=False, seed=0)
    try:
        return llama_cpp.Llama(flash_attn=True, **kwargs)
    except TypeError:  # newer releases name it flash_attn_type
        return llama_cpp.Llama(flash_attn_type=1, **kwargs)


def main():
    p = ac.common_args(__doc__)
    p.add_argument("--caches", default="f16,q8_0,q4_0")
    args = p.parse_args()
    tasks = ac.load_tasks(args)
    out = ac.Results(args.out, "llama.cpp")
    n_ctx = max(len(t["tokens"]) + t.get("answer_tokens", 0) + 8 for t in tasks)
    n_ctx = (n_ctx + 255) // 256 * 256
    for cache in args.caches.split(","):
        if cache not in CACHES:
            raise SystemExit(f"--caches: unknown cache type {cache!r} (known: {', '.join(CACHES)})")
        llm = open_model(args.model, cache, n_ctx, args.threads)
        kv = CACHES[cache][1]
        for t in tasks:
            timer = ac.Timer()
            llm.reset()
            ids = t["tokens"]
            if t["kind"] == "retrieval":
                llm.eval(ids)
                generated = []
                text = ""
                for _ in range(t["answer_tokens"]):
                    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                    if token in t["stop"]:
                        break
                    generated.append(token)
                    text = llm.detokenize(generated).decode("utf-8", "replace")
                    if ac.contains(text, t["expect"], t.get("match")):
                        break
                    llm.eval([token])
                ok = ac.contains(text, t["expect"], t.get("match"))
                out.write(task=t["task"], id=t["id"], context=t["context"], depth=t["depth"],
                          mode="observe", config=cache, budget="dtype", fraction=kv,
                          correct=ok, kv_fraction=kv, answer=text)
                ac.progress(f"  llama.cpp {cache} {t['id']}: {'ok  ' if ok else 'MISS'} "
                            f"({timer():.1f} s) {text!r}")
            else:
                llm.eval(ids)
                first = t["score_from"]
                rows = llm.scores[first - 1:len(ids) - 1]
                nll = ac.nll_of(rows, np.asarray(ids[first:]))
                n = len(ids) - first
                out.write(task=t["task"], id=t["id"], context=t["prefix"], mode="observe",
                          config=cache, budget="dtype", fraction=kv, nll_sum=nll, scored=n,
                          perplexity=ac.ppl(nll, n), kv_fraction=kv)
                ac.progress(f"  llama.cpp {cache} {t['id']}: perplexity {ac.ppl(nll, n):.3f} "
                            f"({timer():.1f} s)")
        del llm


if __name__ == "__main__":
    main()
