"""kvgc.kvpress: the reference check against kvpress's ObservedAttentionPress, the press in
kvpress's pipeline, and kvpress's own evaluate.py (from its sdist) run through
bench/anchors/kvpress_harness.py.

What is comparable (the reference check). ObservedAttentionPress scores token i of an
n-token prefill, per KV head h, as the mean over the query heads g of h and over the
queries that can see i of the eager attention weight: sum_{g in h, q >= i} A[g, q, i] /
(n - i) / group. kvgc accumulates, per token, the attention mass it receives from every
query head: sum_{g, q >= i} A[g, q, i], one number for all KV heads. So
(a) kvgc's accumulated score after a prefill where every query scores (policy "full",
    prefill="stream") must equal the eager weights summed over query heads and queries,
    token by token (f32, 1e-4 relative);
(b) with ONE KV head the two reductions coincide up to the factor (n - i) * n_q_heads, so a
    press scoring mass_i / (n - i) / n_q_heads (KvgcMassPress) must keep exactly
    ObservedAttentionPress's tokens and generate exactly its answer.
With several KV heads ObservedAttentionPress keeps different tokens per head and kvgc
cannot (one score per token): no equality is claimed there.
"""

import json
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

import kvgc  # noqa: E402
import kvgc.transformers as kt  # noqa: E402
from kvgc.kvpress import KvgcMassPress, KvgcPress, kvgc_mass  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RUNNER = os.path.join(REPO, "bench", "anchors", "kvpress_harness.py")


def _eager_attentions(model, ids):
    """Per layer, the eager attention weights [H, n, n] of one prefill (float32)."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation("sdpa")
    return [a[0].float() for a in out.attentions]


# ------------------------------------------------------------------- (a) scores = weights

@pytest.mark.parametrize("kv_heads", [2, 1])
def test_kvgc_scores_equal_eager_weights_summed(make_tiny, kv_heads):
    """(a): KvgcCache(policy="full", prefill="stream") scores == eager weights summed over
    query heads and queries, per token and layer. Fails if kvgc skipped the diagonal,
    scored per KV head, dropped any query row, or normalised differently."""
    model = make_tiny(layers=2, heads=4, kv_heads=kv_heads, head_dim=16, seed=3)
    torch.manual_seed(0)
    n = 57  # not a multiple of the page size: a partly filled last page
    ids = torch.randint(2, model.config.vocab_size, (1, n))
    expected = [a.sum(dim=(0, 1)) for a in _eager_attentions(model, ids)]

    cache = kt.KvgcCache(model.config, kv_dtype=torch.float32, prefill="stream", policy="full",
                         harvest="immediate", ignore_env=True)
    kt.use_kvgc(model)
    try:
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
    finally:
        model.set_attn_implementation("sdpa")
    seq = cache._seqs[0]
    for layer, want in enumerate(expected):
        scores, _ = cache.heap.read_scores(seq, layer)
        _, _, pos = cache.heap.read(seq, layer)
        got = torch.zeros(n)
        got[torch.as_tensor(pos, dtype=torch.long)] = torch.as_tensor(scores)
        assert len(scores) == n  # policy "full": nothing evicted
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"layer {layer}: kvgc mass != eager weights: {m}")
        # The sum of all mass is the number of (query, head) rows: a normalisation check.
        assert abs(float(got.sum()) - n * model.config.num_attention_heads) < 1e-3 * n
    cache.close()


def test_kvgc_mass_helper_equals_eager(make_tiny):
    """kvgc_mass (the scratch-heap scorer KvgcMassPress uses) against eager weights, through
    the model's own K and Q: the same quantity as (a), by the press's own path."""
    model = make_tiny(layers=1, heads=4, kv_heads=2, head_dim=16, seed=5)
    n = 40
    ids = torch.randint(2, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    want = _eager_attentions(model, ids)[0].sum(dim=(0, 1))
    captured = {}

    def hook(module, args, kwargs, output):
        from kvpress.utils import get_prerope_query_states
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        h = kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        q = get_prerope_query_states(module, h)
        k = module.k_proj(h).view(1, n, -1, module.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        captured["m"] = kvgc_mass(k[0].transpose(0, 1), q[0].transpose(0, 1), module.scaling)

    handle = model.model.layers[0].self_attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(ids, use_cache=False)
    handle.remove()
    torch.testing.assert_close(captured["m"], want, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------- (b) same kept tokens, same answer

def _press_prefill(model, press, ids):
    """The pipeline's prefill (model.model under the press into a DynamicCache) plus the
    kept tokens' positions per layer, recovered from the kept keys."""
    from transformers import DynamicCache
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache


def _greedy(model, cache, ids_len, first_ids, steps):
    """The pipeline's generate_answer: positions continue from the context length."""
    out_ids = []
    pos = torch.arange(ids_len, ids_len + first_ids.shape[1])[None]
    with torch.no_grad():
        logits = model(input_ids=first_ids, past_key_values=cache, position_ids=pos).logits
        for i in range(steps):
            nxt = logits[0, -1].argmax()
            out_ids.append(int(nxt))
            p = torch.tensor([[ids_len + first_ids.shape[1] + i]])
            logits = model(input_ids=nxt.view(1, 1), past_key_values=cache, position_ids=p).logits
    return out_ids


def _kept_sets(cache, full_keys):
    """Positions kept per layer: each kept key row matched to the full prefill's row."""
    sets = []
    for layer, fk in zip(cache.layers, full_keys):
        k = layer.keys[0, 0]  # one KV head
        d = torch.cdist(k, fk[0, 0])
        sets.append(sorted(d.argmin(dim=1).tolist()))
    return sets


@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_mass_press_matches_observed_attention(make_tiny, ratio):
    """(b): one KV head: KvgcMassPress (kvgc's kernel, SDPA model) keeps the same tokens in
    every layer as ObservedAttentionPress (eager weights) and decodes the same ids."""
    from transformers import DynamicCache
    model = make_tiny(layers=3, heads=4, kv_heads=1, head_dim=16, seed=11)
    # Random init attends almost uniformly (so both presses would just keep the earliest
    # tokens, which the scores' 1/(n-i) favours); sharper Q/K make the choice data-driven.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    n = 96
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, model.config.vocab_size, (1, n), generator=g)
    question = torch.randint(2, model.config.vocab_size, (1, 5), generator=g)

    full = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=full)
    full_keys = [layer.keys.clone() for layer in full.layers]

    model.set_attn_implementation("eager")
    ref = _press_prefill(model, kvpress.ObservedAttentionPress(compression_ratio=ratio), ids)
    ref_sets = _kept_sets(ref, full_keys)
    ref_ids = _greedy(model, ref, n, question, 8)
    model.set_attn_implementation("sdpa")
    got = _press_prefill(model, KvgcMassPress(compression_ratio=ratio), ids)
    got_sets = _kept_sets(got, full_keys)
    got_ids = _greedy(model, got, n, question, 8)

    kept = int(n * (1 - ratio))
    assert all(len(s) == kept for s in ref_sets)
    assert got_sets == ref_sets, "kvgc's mass kept other tokens than ObservedAttentionPress"
    assert got_ids == ref_ids
    # Not vacuous: the press kept a non-trivial subset (not just the first/last tokens).
    assert any(s != list(range(kept)) and s != list(range(n - kept, n)) for s in ref_sets)


# -------------------------------------------------------------- the press in the pipeline

def _pipe(model, tok):
    from transformers import pipeline
    return pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")


def test_kvgc_press_in_pipeline(smollm2):
    """KvgcPress through kvpress's own pipeline: the cache it decodes from is a KvgcCache,
    several questions roll back to the prefill's checkpoint (each answer equals the answer
    to that question alone), and the bytes held respect the byte budget."""
    model, tok = smollm2
    pipe = _pipe(model, tok)
    ctx = "The pass key is 71432. Remember it. " + "The grass is green. The sky is blue. " * 40
    qs = ["What is the pass key?", "What colour is the grass?"]
    try:
        press = KvgcPress(0.0, kv_dtype=torch.float32, harvest="immediate")
        both = pipe(ctx, questions=qs, press=press, max_new_tokens=10)["answers"]
        assert isinstance(press._cache, kt.KvgcCache)
        assert press.last["share"] > 1.0  # the whole context, plus slot metadata
        alone = [pipe(ctx, question=q, press=press, max_new_tokens=10)["answer"] for q in qs]
        assert both == alone, "the second question saw the first one's tokens (no roll-back)"
        # The press leaves the model on "kvgc" attention (the pipeline decodes after the
        # press exits); back to SDPA for the reference run, so that the reference does not
        # depend on the "kvgc" attention's SDPA fallback (tested in test_transformers.py).
        model.set_attn_implementation("sdpa")
        plain = pipe(ctx, questions=qs, max_new_tokens=10)["answers"]
        assert both == plain, "kvgc with no budget (f32 K/V) answered differently from SDPA"
        assert "71432" in both[0]

        press = KvgcPress(0.8, harvest="immediate")  # f16 K/V, 20% of the f16 bytes
        pipe(ctx, questions=qs, press=press, max_new_tokens=10)
        assert press._cache.key_prior == 2.0  # the question comes after the context here
        assert "key_prior=2.0" in repr(press)
        assert press.last["share"] <= 0.2 + 1e-9, press.last
        assert press.last["live_tokens_layer0"] < press.last["context_tokens"]
    finally:
        model.set_attn_implementation("sdpa")


# ----------------------------------------------------- kvpress's evaluate.py via the runner

def _sdist_or_skip():
    sys.path.insert(0, os.path.dirname(RUNNER))
    import kvpress_harness
    from importlib.metadata import version
    try:
        return kvpress_harness.locate_sdist(os.path.expanduser("~/.cache/kvgc/kvpress-sdist"), version("kvpress"))
    except RuntimeError as e:
        if os.environ.get("KVGC_REQUIRE_MODEL") == "1":
            pytest.fail(f"kvpress sdist unavailable and KVGC_REQUIRE_MODEL=1: {e}")
        pytest.skip(f"kvpress sdist (its evaluation harness) unavailable: {str(e)[:300]}")


def test_evaluate_py_through_runner(smollm2, tmp_path):
    """kvpress's unmodified evaluate.py (sdist) on a 4-row qa dataset (one context, four
    questions: the pipeline's roll-back runs three times) for no_press, kvgc at 20% of
    the f16 bytes and SnapKV at the same share; 1K tokens to stay fast on 2 cores."""
    sdist = _sdist_or_skip()
    for mod in ("rouge", "nltk", "bert_score", "jieba", "fuzzywuzzy", "fire", "yaml"):
        try:
            __import__(mod)
        except ImportError:
            why = f"kvpress's eval extras (evaluate.py imports every scorer): {mod} is missing"
            if os.environ.get("KVGC_REQUIRE_MODEL") == "1":
                pytest.fail(why + " (python/requirements-test.txt installs it)")
            pytest.skip(why)
    out = tmp_path / "h"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, RUNNER, "--sdist", sdist, "--out", str(out), "--data-dir", "1024",
                        "--tasks", "qa_1", "--rows", "4", "--threads", "1",
                        "--methods", "no_press:0", "kvgc:0.8", "snapkv:0.8"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "failed" not in r.stdout, r.stdout + r.stderr[-3000:]
    result = [line for line in r.stdout.splitlines() if line.startswith("RESULT kvpress_harness")]
    assert len(result) == 1, r.stdout
    cells = dict(re.findall(r"(\S+?)=(\S+)", result[0]))
    for key in ("qa_1_no_press_100", "qa_1_kvgc_20", "qa_1_snapkv_20"):
        hits, n = cells[key].split("/")
        assert int(n) == 4 and 0 <= int(hits) <= 4, (key, cells[key])
    assert float(cells["qa_1_kvgc_20_kv"]) <= 0.2 + 1e-9  # kvgc's own held bytes, logged by the press
    summary = json.load(open(out / "summary.json"))
    kvgc_dir = [s["dir"] for s in summary if s["method"] == "kvgc"][0]
    config = open(os.path.join(kvgc_dir, "config.yaml")).read()
    assert "KvgcPress(compression_ratio=0.8" in config  # evaluate.py set the ratio and saved the press
