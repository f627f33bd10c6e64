"""kvgc.transformers: KvgcCache + attn_implementation="kvgc" against transformers' own path.

Equality tests run policy="full" (nothing evicted) with kv_dtype=float32, where kvgc's
attention must reproduce DynamicCache + SDPA: the same greedy tokens, logits within 1e-3.
Budget tests check what the GC keeps through the heap itself (positions, bytes).
"""

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig

import kvgc
import kvgc.transformers as kt
from kvgc import _hf_compat

PROMPT_LENS = (5, 31, 33, 64, 150)  # around observe_tokens=32: no split, split by 1, ...


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, n), generator=g)


def gen(model, ids, cache, n=12, **kw):
    out = model.generate(ids, attention_mask=torch.ones_like(ids) if ids.dim() == 2 and
                         "attention_mask" not in kw else kw.pop("attention_mask"),
                         past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def chat_ids(tok, text):
    """A one-message chat's prompt ids [1, n] (transformers 5 returns a BatchEncoding by
    default where 4.57 returned the tensor: ask for the dict on both)."""
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]


def full_cache(model, **kw):
    kw.setdefault("kv_dtype", torch.float32)
    return kt.KvgcCache(model.config, policy="full", **kw)


def attention_opts(prefill_attention):
    """KvgcCache keywords: None = the cache's default prefill ("sdpa"); "kvgc" = every
    prefill query through kvgc's own kernel."""
    return {} if prefill_attention is None else {"prefill_attention": prefill_attention}


# ---- equality with DynamicCache + SDPA ---------------------------------------------------
@pytest.mark.parametrize("prefill,prefill_attention",
                         [("observe", "kvgc"), ("stream", "kvgc"), ("observe", None)])
def test_full_policy_matches_dynamic_cache(tiny, attn, prefill, prefill_attention):
    for i, n in enumerate(PROMPT_LENS):
        ids = prompt(n, i)
        ref_tok, ref_logits = gen(attn(tiny, "sdpa"), ids, DynamicCache())
        cache = full_cache(tiny, prefill=prefill, **attention_opts(prefill_attention))
        tok, logits = gen(attn(tiny, "kvgc"), ids, cache)
        assert torch.equal(tok, ref_tok), f"prompt {n}: {tok} != {ref_tok}"
        assert (logits - ref_logits).abs().max().item() < 1e-3
        assert cache.get_seq_length() == n + 11  # the last token is never fed
        assert cache.live_tokens() == [n + 11]


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_llama_families_match(attn, family):
    import transformers as tf

    cfg_cls, model_cls = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                          "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[family]
    cfg = cfg_cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, sliding_window=None, eos_token_id=None)
    torch.manual_seed(1)
    model = model_cls(cfg).eval()
    model.generation_config.pad_token_id = 0
    ids = prompt(45, 9)
    ref, ref_logits = gen(attn(model, "sdpa"), ids, DynamicCache())
    got, logits = gen(attn(model, "kvgc"), ids, full_cache(model))
    assert torch.equal(got, ref)
    assert (logits - ref_logits).abs().max().item() < 1e-3


def test_plain_forward_loop_matches(tiny, attn):
    ids = prompt(40, 7)
    outs = {}
    for name, cache in (("sdpa", DynamicCache()), ("kvgc", full_cache(tiny))):
        m = attn(tiny, name)
        with torch.no_grad():
            logits = m(ids, past_key_values=cache).logits[:, -1:]
            steps = [logits]
            for _ in range(5):
                nxt = steps[-1].argmax(-1)
                steps.append(m(nxt, past_key_values=cache).logits)
        outs[name] = torch.cat(steps, 1)
    assert (outs["kvgc"] - outs["sdpa"]).abs().max().item() < 1e-3


def test_smollm2_greedy_matches(smollm2, attn):
    model, tok = smollm2
    for text in ("What is the capital of France?", "Write a haiku about memory."):
        ids = chat_ids(tok, text)
        ref, _ = gen(attn(model, "sdpa"), ids, DynamicCache(), n=16)
        got, _ = gen(attn(model, "kvgc"), ids, full_cache(model), n=16)
        assert torch.equal(got, ref), (tok.decode(got[0]), tok.decode(ref[0]))


SHORT_CHATS = (  # the README's prompt and five other short chats (under 100 tokens)
    "Write a short story about a lighthouse keeper.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for a good night's sleep.",
    "Write a haiku about autumn leaves.",
    "Translate 'good morning' and 'thank you' into French and Spanish.",
    "I am planning a week in Italy in May. I like museums, food and long walks, but not "
    "crowds, and my budget is moderate. Which two cities would you suggest, what should I "
    "see in each, and how should I travel between them? Please keep it short.")


def test_smollm2_short_chats_keep_their_meaning_under_a_budget(smollm2, attn):
    # KVGC_MIN_LENGTH (0.14): a sequence under 256 tokens is never pruned, so at 25% of the
    # bytes a short chat answers as DynamicCache does for its first 32 tokens. With the rule
    # off the same budget changes some answer: otherwise this test could not fail.
    model, tok = smollm2
    changed_without_rule = 0
    for text in SHORT_CHATS:
        ids = chat_ids(tok, text)
        assert ids.shape[1] < 200
        ref, _ = gen(attn(model, "sdpa"), ids, DynamicCache(), n=32)
        got, _ = gen(attn(model, "kvgc"), ids,
                     kt.KvgcCache(model.config, kv_dtype=torch.float32, byte_budget=0.25), n=32)
        assert torch.equal(got, ref), (text, tok.decode(got[0]), tok.decode(ref[0]))
        off, _ = gen(attn(model, "kvgc"), ids,
                     kt.KvgcCache(model.config, kv_dtype=torch.float32, byte_budget=0.25,
                                  min_length=0), n=32)
        changed_without_rule += not torch.equal(off, ref)
    assert changed_without_rule > 0


# ---- no dense copy ---------------------------------------------------------------------
def test_no_copy_pointers(tiny, attn):
    cache = full_cache(tiny)
    cache._trace = []
    gen(attn(tiny, "kvgc"), prompt(40, 1), cache, n=4)
    assert cache._trace
    for kind, layer, ptr, seen, src in cache._trace:
        assert seen == ptr, f"kvgc reads {kind}@{layer} at {seen:#x}, tensor at {ptr:#x}"
    # f32 model, f32 cache: K rows and queries are the model's own tensors (views), both in
    # prefill and decode; only rows after left padding would start further in.
    assert all(ptr == src for kind, _, ptr, _, src in cache._trace)


def test_update_returns_new_rows_only(tiny):
    cache = full_cache(tiny)
    k = torch.randn(1, 2, 5, 16)
    rk, rv = cache.update(k, k.clone(), 0)
    assert rk.shape[2] == 5 and rk is k  # the new rows, no concatenation
    with pytest.raises(RuntimeError, match="attn_implementation='kvgc'"):
        cache.update(k, k.clone(), 1)  # layer 0 was never attended: not the kvgc attention


def test_sdpa_model_with_kvgc_cache_errors(tiny, attn):
    with pytest.raises(RuntimeError, match="attn_implementation='kvgc'"):
        attn(tiny, "sdpa")(prompt(8, 0), past_key_values=full_cache(tiny))


# ---- the GC under budgets ----------------------------------------------------------------
def test_byte_budget_keeps_sinks_and_window(attn, make_tiny):
    model = make_tiny(layers=2)
    attn(model, "kvgc")
    cache = kt.KvgcCache(model.config, kv_dtype=torch.float32, policy="generational",
                         byte_budget=0.25, demote="off")
    gen(model, prompt(400, 3), cache, n=40)
    length = cache.get_seq_length()
    assert length == 439
    opts = cache.heap.options
    sinks, window, page = opts["sinks"], opts["window"], opts["page_tokens"]
    full_bytes = kvgc.kv_bytes(1, 2, 16, "float32", length)  # one layer, raw K/V
    for layer in range(2):
        live = cache.live_tokens(layer)[0]
        assert live < length
        pos = cache.positions(0, layer)
        assert len(pos) == live and len(np.unique(pos)) == live
        assert set(range(sinks)) <= set(pos.tolist()), "sinks evicted"
        # 0.9: under a byte budget the window scales with it, never below window_min
        young = set(range(length - min(window, opts["window_min"]), length))
        assert young <= set(pos.tolist()), "young window evicted"
        # physical length within the budget (a page of slack: the GC runs per page)
        assert live <= 0.25 * length + page
    # bytes: the pages held, all layers, within the budget plus a page per segment
    page_bytes = kvgc.kv_bytes(1, 2, 16, "float32", page, page_tokens=page)
    assert cache.kv_bytes() <= 2 * (0.25 * full_bytes + 2 * page_bytes)


def test_smollm2_passkey_under_byte_budget(smollm2, attn):
    model, tok = smollm2
    filler = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
              "There and back again. ") * 12
    text = ("There is an important pass key hidden inside a lot of irrelevant text. Find it "
            "and memorize it. " + filler + "The pass key is 71432. Remember it. 71432 is the "
            "pass key. " + filler + "What is the pass key?")
    ids = chat_ids(tok, text)
    cache = kt.KvgcCache(model.config, kv_dtype=torch.float16, byte_budget=0.25,
                         prefill_attention="sdpa")  # generational, the int8/int4 ladder
    out, _ = gen(attn(model, "kvgc"), ids, cache, n=10)
    assert "71432" in tok.decode(out[0])
    n, cfg = cache.get_seq_length(), model.config
    full = kvgc.kv_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, "float16", n)
    # whole pages, slot metadata included; plus the page a segment's tokens appended since
    # its last GC may have opened (kvgc.h: "plus what was appended since")
    page = kvgc.kv_bytes(1, cfg.num_key_value_heads, 64, "float16", 16, page_tokens=16)
    assert cache.kv_bytes() <= 0.25 * full + cfg.num_hidden_layers * page
    assert max(cache.live_tokens(layer)[0] for layer in range(cfg.num_hidden_layers)) < n
    opts = cache.heap.options
    for layer in (0, cfg.num_hidden_layers - 1):
        kept = set(cache.positions(0, layer).tolist())
        assert set(range(opts["sinks"])) <= kept
        assert set(range(n - opts["window"], n)) <= kept


def test_ladder_stores_int8_int4(attn, make_tiny):
    model = make_tiny(layers=2)
    attn(model, "kvgc")
    cache = kt.KvgcCache(model.config, kv_dtype=torch.float32, byte_budget=0.3)
    toks, logits = gen(model, prompt(300, 4), cache, n=20)
    assert torch.isfinite(logits).all()
    classes = cache.heap.read_classes(cache._seqs[0], 0)
    # (since 0.9's smaller window under a byte budget, 30% may keep every token, demoted)
    assert cache.live_tokens()[0] <= cache.get_seq_length()
    assert len(set(classes.tolist())) > 1, "no token demoted under the ladder"


def test_sampling_runs(tiny, attn):
    cache = kt.KvgcCache(tiny.config, token_budget=48, min_length=0)  # 120 tokens: prune them
    out = attn(tiny, "kvgc").generate(prompt(100, 5), attention_mask=torch.ones(1, 100,
                                      dtype=torch.long), past_key_values=cache,
                                      max_new_tokens=20, do_sample=True, top_k=20,
                                      temperature=0.9)
    assert out.shape == (1, 120)
    assert cache.live_tokens()[0] < cache.get_seq_length()


def test_sampling_several_return_sequences(tiny, attn):
    # generate expands the prompt to 3 rows before the first forward: a batch of 3 that
    # decodes through kvgc.Batch.
    cache = kt.KvgcCache(tiny.config, byte_budget=0.5, min_length=0)  # 70 tokens: prune them
    out = attn(tiny, "kvgc").generate(prompt(60, 8), attention_mask=torch.ones(1, 60,
                                      dtype=torch.long), past_key_values=cache,
                                      max_new_tokens=10, do_sample=True,
                                      num_return_sequences=3)
    assert out.shape == (3, 70) and len(cache.live_tokens()) == 3
    assert cache.lengths() == [69] * 3


def test_observe_scores_only_last_queries(tiny, attn):
    # Each query head's probabilities sum to 1, so a segment's total score is
    # (scoring queries) x n_q_heads: observe scores the last 32 rows, stream all of them.
    for prefill, scoring, pa in (("observe", 32, "kvgc"), ("stream", 100, "kvgc"),
                                 ("observe", 32, None)):
        cache = full_cache(tiny, prefill=prefill, pool_radius=0, **attention_opts(pa))
        with torch.no_grad():
            attn(tiny, "kvgc")(prompt(100, 6), past_key_values=cache)
        for layer in range(2):
            scores, _ = cache.heap.read_scores(cache._seqs[0], layer)
            assert abs(float(scores.sum()) - scoring * 4) < 1e-2 * scoring


def test_key_prior_adds_key_diversity(tiny, attn):
    # key_prior=w adds, to each prefilled token, its key's diversity (1 - cosine to its
    # head's mean direction, summed over KV heads) scaled to total w x the observed mass.
    ids = prompt(100, 6)
    got = {}
    for w in (0.0, 0.5):
        cache = full_cache(tiny, pool_radius=0, key_prior=w)
        with torch.no_grad():
            attn(tiny, "kvgc")(ids, past_key_values=cache)
        got[w] = [(cache.heap.read_scores(cache._seqs[0], layer)[0].copy(),
                   cache.heap.read(cache._seqs[0], layer)) for layer in range(2)]
    for layer in range(2):
        (base, (k, _, pos)), (with_prior, _) = got[0.0][layer], got[0.5][layer]
        k = torch.from_numpy(np.asarray(k, dtype=np.float32))
        unit = k / k.norm(dim=-1, keepdim=True)
        mean = unit.mean(0) / unit.mean(0).norm(dim=-1, keepdim=True)
        diversity = (1 - (unit * mean).sum(-1)).sum(-1).numpy()
        expect = 0.5 * 32 * 4 * diversity / diversity.sum()  # 32 queries x 4 heads of mass
        np.testing.assert_allclose(with_prior - base, expect, rtol=1e-4, atol=1e-4)
        assert abs(float((with_prior - base).sum()) - 0.5 * float(base.sum())) < 1e-2
    # A second multi-token forward adds the prior to its own tokens only.
    cache = full_cache(tiny, pool_radius=0, key_prior=1.0)
    with torch.no_grad():
        m = attn(tiny, "kvgc")
        m(ids, past_key_values=cache)
        before = float(cache.heap.read_scores(cache._seqs[0], 0)[0].sum())
        m(prompt(40, 7), past_key_values=cache, cache_position=torch.arange(100, 140))
    after, _ = cache.heap.read_scores(cache._seqs[0], 0)
    _, _, pos = cache.heap.read(cache._seqs[0], 0)
    old = np.asarray(pos) < 100
    # The old tokens gain only part of the new queries' mass (32 queries x 4 heads), no
    # prior; the new ones gain their prior, the new mass (1.0 x 128) in all.
    gained = float(after[old].sum()) - before
    assert 0 < gained < 32 * 4
    assert abs(float(after[~old].sum()) - (32 * 4 - gained) - 32 * 4) < 1e-2


def _scores_by_position(cache):
    out = []
    for layer in range(cache.n_layers):
        scores, _ = cache.heap.read_scores(cache._seqs[0], layer)
        _, _, pos = cache.heap.read(cache._seqs[0], layer)
        out.append(np.asarray(scores)[np.argsort(np.asarray(pos))].copy())
    return out


def test_default_prefill_scores_equal_kvgc_prefill(tiny, attn, monkeypatch):
    # The default prefill computes the queries that add no mass with SDPA; the observe
    # window (the last 32 queries) still goes through kvgc's kernel. So the GC's scores
    # after a first prompt and after a second multi-token forward into the same sequence
    # (SDPA over its live rows) equal those of prefill_attention="kvgc" token by token: a
    # scored tail that went through SDPA would leave them zero.
    used = []
    for name in ("_causal_sdpa", "_chunk_sdpa"):
        fn = getattr(kt, name)
        monkeypatch.setattr(kt, name, lambda *a, fn=fn, name=name: used.append(name) or fn(*a))
    m = attn(tiny, "kvgc")
    for n, more in ((33, 0), (64, 40), (150, 100)):
        ids, chunk = prompt(n, 50 + n), prompt(more, 60 + n)
        got = {}
        for pa in (None, "kvgc"):
            cache = full_cache(tiny, **attention_opts(pa))
            with torch.no_grad():
                m(ids, past_key_values=cache)
                first = _scores_by_position(cache)
                if more:
                    m(chunk, past_key_values=cache, cache_position=torch.arange(n, n + more))
            got[pa] = first, _scores_by_position(cache)
        for (a, b) in zip(got[None], got["kvgc"]):
            for layer in range(2):
                assert b[layer].sum() > 0
                np.testing.assert_allclose(a[layer], b[layer], rtol=1e-4, atol=1e-5)
    assert used.count("_causal_sdpa") == 3 * 2 and used.count("_chunk_sdpa") == 2 * 2


@pytest.mark.parametrize("prefill_attention", ["kvgc", None])
def test_chunked_prefill_matches_dynamic_cache(tiny, attn, prefill_attention):
    # A prompt fed in chunks (each one a multi-token forward into a sequence that holds
    # tokens): the same logits and greedy continuation as DynamicCache + SDPA.
    ids = prompt(190, 70)
    outs = []
    for name, cache in (("sdpa", DynamicCache()),
                        ("kvgc", full_cache(tiny, **attention_opts(prefill_attention)))):
        m = attn(tiny, name)
        with torch.no_grad():
            logits = [m(ids[:, lo:lo + 64], past_key_values=cache,
                        cache_position=torch.arange(lo, min(lo + 64, 190))).logits
                      for lo in range(0, 190, 64)]
        outs.append(torch.cat(logits, 1))
        got, _ = gen(m, torch.cat([ids, outs[-1][:, -1:].argmax(-1)], 1), cache, n=6)
        outs.append(got)
    assert (outs[0] - outs[2]).abs().max().item() < 1e-3
    assert torch.equal(outs[1], outs[3])


def test_default_prefill_after_eviction_matches_kvgc_prefill(attn, make_tiny):
    # A second prompt into a sequence the GC has pruned and demoted (int8/int4 rows): the
    # default reads the live rows (dequantised) for SDPA; the same tokens, classes and
    # continuation as kvgc's own kernel.
    model = attn(make_tiny(layers=2, seed=3), "kvgc")
    first, second = prompt(300, 80), prompt(120, 81)
    got = {}
    for pa in (None, "kvgc"):
        cache = kt.KvgcCache(model.config, kv_dtype=torch.float32, byte_budget=0.15, min_length=0,
                             **attention_opts(pa))
        t1, _ = gen(model, first, cache, n=8)
        assert cache.live_tokens()[0] < cache.get_seq_length()
        ids = torch.cat([first, t1, second], 1)
        t2, logits = gen(model, ids, cache, n=8)
        got[pa] = (t1, t2, logits, [cache.positions(0, layer).tolist() for layer in range(2)],
                   sorted(cache.heap.read_classes(cache._seqs[0], 0).tolist()))
    a, b = got[None], got["kvgc"]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (a[2] - b[2]).abs().max().item() < 1e-3
    assert a[3] == b[3] and a[4] == b[4]
    assert len(set(a[4])) > 1, "nothing demoted: the dequantised read is not exercised"


def test_pool_delta_matches_window_max():
    rng = np.random.default_rng(0)
    pos = rng.permutation(np.r_[0:50, 60:80, 200:205]).astype(np.int32)
    scores = rng.random(len(pos)).astype(np.float32)
    delta = kt._pool_delta(scores, pos, 3)
    for i in range(len(pos)):
        near = np.abs(pos.astype(int) - int(pos[i])) <= 3
        assert np.isclose(delta[i], scores[near].max() - scores[i])


# ---- batches and padding ---------------------------------------------------------------
@pytest.mark.parametrize("prefill_attention", ["kvgc", None])
def test_batch_left_padding_equals_alone(tiny, attn, prefill_attention):
    attn(tiny, "kvgc")
    lens = (9, 40, 23)
    prompts = [prompt(n, 10 + i)[0] for i, n in enumerate(lens)]
    width = max(lens)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    cache = full_cache(tiny, **attention_opts(prefill_attention))
    toks, logits = gen(tiny, ids, cache, attention_mask=mask)
    for i, p in enumerate(prompts):
        alone = full_cache(tiny, **attention_opts(prefill_attention))
        t, lg = gen(tiny, p[None], alone)
        assert torch.equal(toks[i], t[0]), f"row {i}"
        assert (logits[i] - lg[0]).abs().max().item() < 1e-3
    # pads never cached: live == appended == real tokens (prompt + all but the last new)
    real = [n + 11 for n in lens]
    assert cache.live_tokens() == real and cache.lengths() == real
    for layer in range(2):
        for i in range(3):
            assert cache.positions(i, layer).tolist() == list(range(real[i]))


def test_padding_token_in_decode_is_skipped(tiny, attn):
    m = attn(tiny, "kvgc")
    ids = torch.cat([prompt(12, 40), prompt(12, 41)])
    cache, alone = full_cache(tiny), full_cache(tiny)
    mask = torch.ones(2, 12, dtype=torch.long)
    with torch.no_grad():
        m(ids, attention_mask=mask, past_key_values=cache)
        m(ids[:1], past_key_values=alone)
        mask = torch.cat([mask, torch.tensor([[1], [0]])], 1)  # row 1's new token: padding
        got = m(torch.tensor([[5], [6]]), attention_mask=mask, past_key_values=cache).logits
        ref = m(torch.tensor([[5]]), past_key_values=alone).logits
    assert cache.lengths() == [13, 12] and cache.live_tokens() == [13, 12]
    assert (got[0] - ref[0]).abs().max().item() < 1e-4


# ---- turns, checkpoints, errors --------------------------------------------------------
@pytest.mark.parametrize("second_len", [20, 70])  # 70: more than observe_tokens' 32
@pytest.mark.parametrize("prefill_attention", ["kvgc", None])
def test_second_multi_token_turn(tiny, attn, prefill_attention, second_len):
    first, second = prompt(50, 20), prompt(second_len, 21)
    results = []
    for name, cache in (("sdpa", DynamicCache()),
                        ("kvgc", full_cache(tiny, **attention_opts(prefill_attention)))):
        m = attn(tiny, name)
        t1, _ = gen(m, first, cache, n=6)
        ids = torch.cat([first, t1, second], 1)
        t2, lg = gen(m, ids, cache, n=6)
        results.append((t1, t2, lg))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert (results[0][2] - results[1][2]).abs().max().item() < 1e-3


def test_checkpoint_and_crop_back(tiny, attn):
    m = attn(tiny, "kvgc")
    ctx, q1, q2 = prompt(60, 30), prompt(8, 31), prompt(8, 32)

    def answer(cache, q):
        with torch.no_grad():
            out = [m(q, past_key_values=cache).logits[:, -1].argmax(-1)]
            for _ in range(4):
                out.append(m(out[-1][:, None], past_key_values=cache).logits[:, -1].argmax(-1))
        return torch.stack(out, 1)

    cache = kt.KvgcCache(m.config, auto_checkpoint=True, token_budget=40, min_length=0)  # prune 60
    with torch.no_grad():
        m(ctx, past_key_values=cache)
    assert cache.get_seq_length() == 60
    a1 = answer(cache, q1)
    cache.crop(60)  # back to the context, as kvpress's pipeline does between questions
    assert cache.get_seq_length() == 60
    a2 = answer(cache, q2)
    fresh = kt.KvgcCache(m.config, token_budget=40, min_length=0)
    with torch.no_grad():
        m(ctx, past_key_values=fresh)
    assert torch.equal(answer(fresh, q2), a2)
    assert a1.shape == a2.shape
    with pytest.raises(kvgc.Unsupported, match="cannot crop"):
        cache.crop(61)


def test_kvpress_pipeline_runs_unchanged(smollm2, attn):
    pytest.importorskip("kvpress")
    from transformers import pipeline

    model, tok = smollm2
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    context = "Alice keeps the red key. Bob keeps the blue key. Carol keeps no key. " * 4
    questions = ["Who keeps the red key?", "Which key does Bob keep?"]
    attn(model, "sdpa")
    ref = pipe(context, questions=questions, max_new_tokens=8)["answers"]
    attn(model, "kvgc")
    cache = full_cache(model, auto_checkpoint=True)
    got = pipe(context, questions=questions, cache=cache, max_new_tokens=8)["answers"]
    assert got == ref
    assert cache.get_seq_length() == cache._checkpoint[1][0]  # rolled back to the context


def test_dense_access_errors(tiny, attn):
    cache = full_cache(tiny)
    gen(attn(tiny, "kvgc"), prompt(10, 0), cache, n=2)
    keys = cache.layers[0].keys  # a stand-in: any use as a tensor raises
    for access in (lambda: keys.shape, lambda: keys + 1, lambda: torch.cat([keys, keys]),
                   lambda: cache.layers[1].values.to("cpu"), lambda: keys[0],
                   lambda: keys[..., :3], lambda: np.asarray(keys),
                   lambda: cache[0], lambda: list(cache), cache.to_legacy_cache):
        with pytest.raises(kvgc.Unsupported, match="kvgc pages"):
            access()
    with pytest.raises(kvgc.Unsupported):
        cache.layers[0].keys = torch.zeros(1)
    k, v, pos = cache.read(0)  # the explicit, documented copy
    assert k.shape == (11, 2, 16) and sorted(pos.tolist()) == list(range(11))
    with pytest.raises(kvgc.Unsupported, match="cannot crop"):
        cache.crop(5)


def test_beam_search_errors(tiny, attn):
    with pytest.raises(kvgc.Unsupported, match="beam search"):
        attn(tiny, "kvgc").generate(prompt(10, 0), past_key_values=full_cache(tiny),
                                    num_beams=2, max_new_tokens=4)


def test_constructor_errors(tiny):
    with pytest.raises(ValueError, match="kv_dtype"):
        kt.KvgcCache(tiny.config, kv_dtype=torch.int8)
    with pytest.raises(ValueError, match="prefill"):
        kt.KvgcCache(tiny.config, prefill="eager")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="key_prior"):
            kt.KvgcCache(tiny.config, key_prior=bad)
    with pytest.raises(ValueError, match="unknown heap option"):
        kt.KvgcCache(tiny.config, polcy="full")
    with pytest.raises(ValueError, match="policy"):
        kt.KvgcCache(tiny.config, policy="lru")
    sliding = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                          layer_types=["sliding_attention"])
    with pytest.raises(kvgc.Unsupported, match="full attention"):
        kt.KvgcCache(sliding)


def test_arena_full_says_how_to_fix(tiny, attn):
    # One 2 MiB slab holds ~7K tokens of this model's layer pages: 9000 cannot fit.
    cache = full_cache(tiny, budget_bytes=2 << 20, prefill_attention="sdpa")
    with pytest.raises(kvgc.OutOfMemory) as err, torch.no_grad():
        attn(tiny, "kvgc")(torch.randint(3, 128, (1, 9000)), past_key_values=cache)
    assert "max_tokens=" in "".join(getattr(err.value, "__notes__", [])) + str(err.value)
    cache.reset()
    with torch.no_grad():
        tiny(prompt(10, 0), past_key_values=cache)  # usable again at a length that fits
    assert cache.live_tokens() == [10]


def test_batch_size_change_errors(tiny, attn):
    m, cache = attn(tiny, "kvgc"), full_cache(tiny)
    with torch.no_grad():
        m(prompt(8, 0), past_key_values=cache)
        with pytest.raises(ValueError, match="batch of 2"):
            m(torch.ones(2, 1, dtype=torch.long), past_key_values=cache)


def test_fallback_without_kvgc_cache(tiny, attn):
    ids, more = prompt(20, 3), prompt(7, 4)
    pad = torch.ones(2, 27, dtype=torch.long)
    pad[1, :5] = 0
    both = torch.cat([ids, more], 1).repeat(2, 1)
    outs = []
    for name in ("sdpa", "kvgc"):
        m = attn(tiny, name)
        with torch.no_grad():
            plain = m(ids, use_cache=False).logits
            dyn = DynamicCache()  # a chunk after cached tokens: causal, bottom-right aligned
            m(ids, past_key_values=dyn)
            chunk = m(more, past_key_values=dyn).logits
            padded = m(both, attention_mask=pad, use_cache=False).logits[:, 5:]
        outs.append((plain, chunk, padded))
    for ref, got in zip(*outs):
        assert (ref - got).abs().max().item() < 1e-5


def test_bf16_and_f16_storage(tiny, attn):
    ids = prompt(30, 2)
    _, ref = gen(attn(tiny, "sdpa"), ids, DynamicCache(), n=4)
    for dt in (torch.float16, "bfloat16"):
        _, lg = gen(attn(tiny, "kvgc"), ids, kt.KvgcCache(tiny.config, policy="full",
                                                          kv_dtype=dt), n=4)
        assert (lg - ref).abs().max().item() < 0.05


# ---- version gate ------------------------------------------------------------------------
def test_version_gate():
    assert _hf_compat.parse_version("4.57.6") == (4, 57, 6)
    assert _hf_compat.parse_version("5.0.0rc1") == (5, 0, 0)
    assert _hf_compat.check_version("4.56.0") == (4, 56, 0)
    assert _hf_compat.check_version("5.2.1") == (5, 2, 1)
    for bad in ("4.55.4", "4.40.0", "6.0.0"):
        with pytest.raises(kvgc.Unsupported, match="transformers"):
            _hf_compat.check_version(bad)
    with pytest.raises(ValueError):
        _hf_compat.parse_version("main")

    class Old:
        def get_mask_sizes(self, cache_position): ...

    class New:
        def get_mask_sizes(self, query_length): ...

    assert _hf_compat.mask_sizes_arg(Old) == "cache_position"
    assert _hf_compat.mask_sizes_arg(New) == "query_length"
    assert _hf_compat.query_length(torch.arange(7)) == 7 == _hf_compat.query_length(7)
    import transformers

    prof = _hf_compat.profile()
    # The suite runs on 4.57.x and 5.2.x (tools/test-python.sh): both pass cache_position.
    assert prof.version == _hf_compat.parse_version(transformers.__version__)
    assert prof.version[:2] in ((4, 57), (5, 2)) and prof.tested
    assert prof.mask_sizes_arg == "cache_position"
    assert kt.register() == "kvgc" and kt.register() == "kvgc"  # idempotent
