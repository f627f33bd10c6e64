"""Runs vLLM's offline LLM in this process on a JSON spec and writes a JSON result.

    python run_llm.py SPEC.json OUT.json

SPEC: {"env": {...}, "llm": {LLM keywords}, "prompts": [token id lists],
       "sampling": {SamplingParams keywords}, "engine_steps": bool, "one_by_one": bool}
The environment (KVGC_VLLM, KVGC_*) must be set before vLLM picks its platform, so each
configuration runs in a process of its own. With engine_steps the requests are added to
LLMEngine and stepped one by one; after every step the kvgc heap (when the plugin is on)
is checked: every sequence's bytes against its byte budget, and the heap's invariants.
OUT: {"tokens": [[ids]...], "stats_after": {...} | null, "checks": {...}}
Under torchrun (tensor parallelism through vLLM's external launcher) every rank runs this
and writes OUT.<rank>.
"""
import json
import os
import sys


def _seq_bytes(heap, seq):
    """KV payload bytes a sequence holds (each live token at its storage class), and
    the bytes its full cache of `length` tokens would take in fp16."""
    import kvgc
    held = full = 0
    names = {int(c): c.name.lower() for c in kvgc.StorageClass if c.name != "INT2"}
    per = {c: kvgc.kv_bytes(1, heap.n_kv_heads, heap.head_dim, heap.dtype, 1, c)
           for c in names.values()}
    for layer in range(heap.n_layers):
        live, length = heap.tokens(seq, layer)
        if live:
            classes = heap.read_classes(seq, layer)
            for c, name in names.items():
                held += int((classes == c).sum()) * per[name]
        full += length * per["fp16"]
    return held, full


def main():
    spec = json.load(open(sys.argv[1]))
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(**spec["llm"])
    sp = SamplingParams(**spec["sampling"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    checks = {"steps": 0, "max_budget_ratio": 0.0, "max_running": 0}
    plugin = os.environ.get("KVGC_VLLM") == "1"
    budget = float(spec.get("byte_budget", 0) or 0)
    if spec.get("engine_steps"):
        from kvgc import _vllm_state
        engine = llm.llm_engine
        one_by_one = spec.get("one_by_one", False)   # each request after the last ended
        queue = list(enumerate(prompts))
        while queue and not (one_by_one and engine.has_unfinished_requests()):
            i, p = queue.pop(0)
            engine.add_request(str(i), p, sp)
            if one_by_one:
                break
        done = {}
        abort_after = spec.get("abort_after_steps")
        while engine.has_unfinished_requests() or queue:
            if not engine.has_unfinished_requests():
                i, p = queue.pop(0)
                engine.add_request(str(i), p, sp)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            checks["steps"] += 1
            if abort_after is not None and checks["steps"] == abort_after:
                engine.abort_request(spec.get("abort_ids", []))
            if plugin:
                state = _vllm_state.get()
                state.heap.stats()  # applies pending GC results (KVGC_HARVEST=deferred)
                state.heap.check()
                checks["max_running"] = max(checks["max_running"], len(state.requests))
                for r in state.requests.values():
                    held, full = _seq_bytes(state.heap, r.seq)
                    if budget and r.length >= r.target and full and r.length >= 256:
                        checks["max_budget_ratio"] = max(checks["max_budget_ratio"],
                                                         held / full)
                        # The minor GC runs once per page of new tokens: between two,
                        # up to a page of decoded tokens waits in fp16 in every layer.
                        page = state.page_tokens * full / r.length
                        checks["max_pages_over"] = max(checks.get("max_pages_over", -1.0),
                                                       (held - budget * full) / page)
        tokens = [done.get(str(i)) for i in range(len(prompts))]
    else:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        checks["all_outputs"] = [[list(c.token_ids) for c in o.outputs] for o in outs]
    stats = None
    if plugin:
        import kvgc.vllm
        checks["counters"] = kvgc.vllm.counters()
        stats = kvgc.vllm.stats().as_dict()
        stats.pop("device", None)
        stats.pop("classes", None)
        stats.pop("cls_header", None)
    out = sys.argv[2]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        out += "." + os.environ["RANK"]
    json.dump({"tokens": tokens, "stats_after": stats, "checks": checks},
              open(out, "w"), default=str)


if __name__ == "__main__":
    main()
