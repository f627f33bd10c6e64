"""The binding's own tests: numpy and the package only (run by `make test`, suite python).

The C library is tested by its own suites; these check what the binding adds: arrays
cross without copies and are refused (heap unchanged) when their dtype, shape, layout or
device is wrong, statuses become the right exception classes with kvgc_errmsg, every
option keyword reaches the C struct, and the calls compute what kvgc.h says (attention
against a numpy reference, batch calls equal to per-sequence calls, pages decoded
through the documented layout equal to read()).
"""
import ctypes
import os
import threading

import numpy as np
import pytest

import kvgc

L, QH, KVH, D = 2, 8, 2, 32


def make_heap(**kw):
    kw.setdefault("budget", "16M")
    kw.setdefault("ignore_env", True)
    kw.setdefault("min_length", 0)  # budgets from the first token: these sequences are short
    return kvgc.Heap(L, QH, KVH, D, kw.pop("dtype", "float32"), **kw)


def rand(*shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def fill(heap, seq, n, seed=1):
    k, v = rand(n, KVH, D, seed=seed), rand(n, KVH, D, seed=seed + 100)
    for layer in range(heap.n_layers):
        heap.append(seq, layer, k, v)
    return k, v


def reference_attention(q, k, v, scale=None):
    """Causal attention of the last len(q) positions over k/v ([n, KVH, D]), GQA; and the
    mass each key received, summed over query heads and queries."""
    n, nq = len(k), len(q)
    scale = scale or 1.0 / np.sqrt(D)
    out = np.zeros((nq, QH, D), np.float64)
    mass = np.zeros(n, np.float64)
    for i in range(nq):
        pos = n - nq + i
        for h in range(QH):
            kv = h // (QH // KVH)
            logits = k[: pos + 1, kv].astype(np.float64) @ q[i, h].astype(np.float64) * scale
            p = np.exp(logits - logits.max())
            p /= p.sum()
            out[i, h] = p @ v[: pos + 1, kv]
            mass[: pos + 1] += p
    return out, mass


def test_version_and_help():
    assert kvgc.__version__ == kvgc.version() == kvgc._kvgc.HEADER_VERSION
    assert "KV cache" in kvgc.__doc__
    assert "byte_budget" in kvgc.Heap.__doc__ and "plan" in kvgc.Batch.__doc__
    assert kvgc.Heap.attend.__doc__ and kvgc.Heap.new_sequence.__doc__


def test_attend_matches_reference_and_feeds_scores():
    with make_heap(policy="full") as heap:
        seq = heap.new_sequence()
        k, v = fill(heap, seq, 40)
        q = rand(3, QH, D, seed=7)
        out = heap.attend(seq, 0, q)
        ref, mass = reference_attention(q, k, v)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
        scores, gens = heap.read_scores(seq, 0)
        np.testing.assert_allclose(scores, mass, rtol=1e-4, atol=1e-6)
        assert gens.dtype == np.uint8 and len(gens) == 40
        # scores=False leaves them alone; a given scale is used.
        out2 = heap.attend(seq, 0, q, scores=False, scale=0.5)
        ref2, _ = reference_attention(q, k, v, scale=0.5)
        np.testing.assert_allclose(out2, ref2, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(heap.read_scores(seq, 0)[0], scores)


def test_no_copy_in_or_out():
    with make_heap(policy="full") as heap:
        seq = heap.new_sequence()
        k, v = fill(heap, seq, 10)
        assert kvgc._kvgc.data_pointer(k) == k.ctypes.data
        q = rand(1, QH, D)
        out = np.empty((1, QH, D), np.float32)
        assert heap.attend(seq, 0, q, out) is out
        k_out = np.zeros((10, KVH, D), np.float32)
        v_out = np.zeros((10, KVH, D), np.float32)
        pos = np.zeros(10, np.int32)
        kr, vr, pr = heap.read(seq, 0, k_out, v_out, pos)
        assert kr.base is k_out or kr is k_out  # a view of the caller's array, filled in place
        np.testing.assert_array_equal(k_out, k)
        np.testing.assert_array_equal(v_out, v)
        np.testing.assert_array_equal(pos, np.arange(10))


@pytest.mark.parametrize("bad, what", [
    (lambda k: k.astype(np.float16), "dtype float16"),
    (lambda k: k[:, :1], "shape"),
    (lambda k: k.reshape(-1, D), "shape"),
    (lambda k: np.asfortranarray(k), "C-contiguous"),
    (lambda k: k[:, :, ::2], "shape"),
    (lambda k: np.ascontiguousarray(np.swapaxes(k, 0, 1)), "shape"),
])
def test_bad_arrays_refused_before_any_c_call(bad, what):
    with make_heap() as heap:
        seq = heap.new_sequence()
        k, v = fill(heap, seq, 5)
        before = heap.stats()
        with pytest.raises(kvgc.InvalidArgument, match=what) as e:
            heap.append(seq, 0, bad(k), v)
        assert e.value.status == kvgc.Status.EINVAL and e.value.status_name == "KVGC_EINVAL"
        assert "k " in str(e.value) or str(e.value).startswith("k ")
        after = heap.stats()
        assert (after.live_tokens, after.appends) == (before.live_tokens, before.appends)
        heap.check()


def test_bad_arguments_name_themselves():
    with make_heap() as heap:
        seq = heap.new_sequence()
        fill(heap, seq, 4)
        with pytest.raises(kvgc.InvalidArgument, match="q has dtype"):
            heap.attend(seq, 0, rand(1, QH, D, dtype=np.float64))
        with pytest.raises(kvgc.InvalidArgument, match="out has shape"):
            heap.attend(seq, 0, rand(2, QH, D), np.empty((1, QH, D), np.float32))
        with pytest.raises(kvgc.InvalidArgument, match="layer"):
            heap.append(seq, 5, rand(1, KVH, D), rand(1, KVH, D))
        with pytest.raises(kvgc.InvalidArgument, match="mass"):
            heap.observe(seq, 0, np.ones(4, np.float64))
        with pytest.raises(kvgc.InvalidArgument, match="stream"):
            heap.step(seq, stream="default")
        with pytest.raises(TypeError):
            heap.append(seq, 0, [[0.0]], [[0.0]])
        with pytest.raises(kvgc.NotFound, match="not a live sequence"):
            heap.step(seq + 1000)
        with pytest.raises(kvgc.InvalidArgument, match="outputs hold 2 rows"):
            heap.read(seq, 0, np.empty((2, KVH, D), np.float32))
        heap.check()


@pytest.mark.parametrize("kw, what", [
    (dict(policy="lru"), "policy='lru'"),
    (dict(token_budget=1.5), "token_budget=1.5"),
    (dict(byte_budget=-3), "byte_budget=-3"),
    (dict(sinks=-1), "sinks=-1"),
    (dict(demote="int2"), "demote='int2'"),
    (dict(budget="12Q"), "budget='12Q'"),
    (dict(windw=3), "unknown heap option 'windw'"),
    (dict(page_tokens=0), "page_tokens"),
    (dict(recent_decay=2.0), "recent_decay"),
    (dict(prefix_charge="heap"), "prefix_charge='heap'"),
])
def test_bad_options(kw, what):
    with pytest.raises(kvgc.InvalidArgument, match=what.replace("(", r"\(")):
        make_heap(**kw)


def test_every_option_reaches_the_heap():
    heap = make_heap(policy="h2o", token_budget=0.5, sinks=2, window=8, page_tokens=8,
                     compact_threshold=0.5, demote="int4", layer_budget="pyramid",
                     score_noise=0.25, seed=42, harvest="immediate", cpu_threads=2,
                     recent_decay=0.9, verbose=False, prefix_charge="view", window_min=3)
    o = heap.options
    assert o["window_min"] == 3
    assert o["policy"] == kvgc.Policy.H2O and o["token_budget_fraction"] == 0.5
    assert (o["sinks"], o["window"], o["page_tokens"], o["seed"]) == (2, 8, 8, 42)
    assert o["demote"] == kvgc.Demote.INT4 and o["layer_budget"] == kvgc.LayerBudget.PYRAMID
    assert o["harvest"] == kvgc.Harvest.IMMEDIATE and o["cpu_threads"] == 2
    assert o["compact_threshold"] == 0.5 and o["score_noise"] == 0.25 and o["recent_decay"] == 0.9
    assert o["budget_bytes"] == 16 << 20 and o["prefix_charge"] == kvgc.PrefixCharge.VIEW
    heap.close()
    with make_heap() as heap:
        assert heap.options["prefix_charge"] == kvgc.PrefixCharge.SHRINK  # the default (0.15)
    with make_heap(prefix_charge="prune") as heap:  # 0.8; retired into shrink in 0.15
        assert heap.options["prefix_charge"] == kvgc.PrefixCharge.SHRINK
    with make_heap(prefix_charge="shrink") as heap:  # 0.13
        assert heap.options["prefix_charge"] == kvgc.PrefixCharge.SHRINK
    heap = make_heap(byte_budget="10%", token_budget=100, budget=0.01,
                     layer_budget="entropy", layer_weights=[1.0, 3.0])
    o = heap.options
    assert o["byte_budget_fraction"] == pytest.approx(0.1) and o["token_budget"] == 100
    heap.close()


def test_environment_overrides_unless_ignored(monkeypatch):
    monkeypatch.setenv("KVGC_WINDOW", "7")
    with kvgc.Heap(L, QH, KVH, D, "float32", budget="8M", window=3) as heap:
        assert heap.options["window"] == 7
    with kvgc.Heap(L, QH, KVH, D, "float32", budget="8M", window=3, ignore_env=True) as heap:
        assert heap.options["window"] == 3
    monkeypatch.setenv("KVGC_POLICY", "lru")
    with pytest.raises(kvgc.InvalidArgument, match="KVGC_POLICY"):
        kvgc.Heap(L, QH, KVH, D, "float32", budget="8M")


def test_dtypes():
    for name, np_dtype in (("float16", np.float16), (np.float32, np.float32)):
        with kvgc.Heap(1, 2, 1, 8, name, budget="4M", ignore_env=True, policy="full") as heap:
            seq = heap.new_sequence()
            k = rand(3, 1, 8, dtype=np_dtype)
            heap.append(seq, 0, k, k)
            np.testing.assert_array_equal(heap.read(seq, 0)[0], k)
    with pytest.raises(kvgc.InvalidArgument, match="dtype='int8'"):
        kvgc.Heap(1, 2, 1, 8, "int8")
    with pytest.raises(kvgc.InvalidArgument, match="head_dim"):
        kvgc.Heap(1, 2, 1, 0, "float32")


def test_closed_heap_and_batch():
    heap = make_heap()
    seq = heap.new_sequence()
    batch = heap.batch()
    heap.close()
    heap.close()  # idempotent
    assert heap.closed and batch.closed and "closed" in repr(heap)
    with pytest.raises(kvgc.InvalidArgument, match="heap is closed"):
        heap.append(seq, 0, rand(1, KVH, D), rand(1, KVH, D))
    with pytest.raises(kvgc.InvalidArgument, match="batch is closed"):
        batch.plan([seq], [1])


def test_out_of_memory_changes_nothing():
    # Two slabs of 64 KiB: a handful of pages.
    with make_heap(budget=128 << 10, slab_bytes=64 << 10, policy="full") as heap:
        seq = heap.new_sequence()
        chunk = rand(16, KVH, D)
        appended = 0
        with pytest.raises(kvgc.OutOfMemory) as e:
            for _ in range(1000):
                heap.append(seq, 0, chunk, chunk)
                appended += 16
        assert isinstance(e.value, MemoryError) and "KVGC_ENOMEM" == e.value.status_name
        assert heap.tokens(seq, 0) == (appended, appended)
        assert heap.stats().enomem == 1
        heap.check()


def test_tenant_quota_is_budget_exceeded():
    with make_heap(policy="full") as heap:
        seq = heap.new_sequence(tenant=3)
        fill(heap, seq, 16)
        used, limit = heap.tenant_usage(3)
        assert used > 0 and limit == 0
        heap.tenant_limit(3, used)
        with pytest.raises(kvgc.BudgetExceeded):
            fill(heap, seq, 16)
        assert heap.tenant_usage(3) == (used, used)


def test_step_meets_a_byte_budget_with_the_ladder():
    with make_heap(byte_budget=0.3, window=8, sinks=2, harvest="immediate") as heap:
        seq = heap.new_sequence()
        for t in range(256):
            fill(heap, seq, 1, seed=t)
            for layer in range(L):
                heap.attend(seq, layer, rand(1, QH, D, seed=1000 + t))
            heap.step(seq)
        s = heap.stats()
        assert s.tokens_evicted > 0 and s.tokens_demoted > 0
        classes = heap.read_classes(seq, 0)
        assert set(np.unique(classes)) <= {0, 1, 2} and (classes != 0).any()
        _, _, pos = heap.read(seq, 0)
        assert {0, 1} <= set(pos.tolist())          # sinks kept
        assert set(range(248, 256)) <= set(pos.tolist())  # the young window kept
        # bytes held per layer within the budget (+ what one step appends)
        full = kvgc.kv_bytes(1, KVH, D, "float32", 256)
        assert s.used_bytes / L <= 0.3 * full + kvgc.kv_bytes(1, KVH, D, "float32", 1, page_tokens=16)


def test_the_int2_rung_is_opt_in_and_holds_the_budget():
    # demote="int8,int4,int2" (0.10): the ladder's fourth rung, below int4. A 1024-token
    # prompt with heavy-tailed mass, one step at 5% of its f32 bytes.
    # f16 and head_dim 64 (two groups of 32), where int2 rows cost 24 bytes to int4's 40.
    n, d = 1024, 64
    mass = (1.0 / (0.002 + np.random.default_rng(5).random(n) ** 3)).astype(np.float32)
    with kvgc.Heap(L, QH, KVH, d, "float16", budget="16M", ignore_env=True, byte_budget=0.05,
                   harvest="immediate", demote="int8,int4,int2") as heap:
        seq = heap.new_sequence()
        k, v = rand(n, KVH, d, dtype=np.float16, seed=3), rand(n, KVH, d, dtype=np.float16, seed=4)
        for layer in range(L):
            heap.append(seq, layer, k, v)
            heap.observe(seq, layer, mass)
        heap.step(seq)
        s = heap.stats()
        classes = heap.read_classes(seq, 0)
        assert (classes == kvgc.StorageClass.INT2).any()
        assert s.classes["int2"]["pages_used"] > 0 and s.tokens_demoted_to[kvgc.StorageClass.INT2] > 0
        assert s.used_bytes / L <= 0.05 * kvgc.kv_bytes(1, KVH, d, "float16", n)

def test_fork_and_observe():
    with make_heap(policy="h2o") as heap:
        a = heap.new_sequence()
        fill(heap, a, 20)
        heap.observe(a, 0, np.arange(20, dtype=np.float32))
        b = heap.fork(a, tenant=1)
        for x, y in zip(heap.read(a, 0), heap.read(b, 0)):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(heap.read_scores(b, 0)[0], np.arange(20, dtype=np.float32))
        heap.free_sequence(a)
        assert heap.tokens(b, 1) == (20, 20)
        with pytest.raises(kvgc.NotFound):
            heap.tokens(a, 0)


def batch_step(heap, seqs, rows, k, v, q, **plan):
    """One engine step through a kvgc.Batch: plan, append + attend every layer, step."""
    with heap.batch() as batch:
        batch.plan(seqs, rows, **plan)
        outs = []
        for layer in range(heap.n_layers):
            batch.append(layer, k, v)
            outs.append(batch.attend(layer, q))
        batch.step()
    return outs


def test_batch_equals_per_sequence_calls():
    lengths = [5, 40, 1]
    rows = [1, 3, 2]
    results = []
    for batched in (False, True):
        heap = make_heap(policy="h2o", token_budget=24, window=4)
        seqs = [heap.new_sequence() for _ in lengths]
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            fill(heap, s, n, seed=10 * i)
        for step in range(6):
            k = rand(sum(rows), KVH, D, seed=step)
            v = rand(sum(rows), KVH, D, seed=step + 50)
            q = rand(sum(rows), QH, D, seed=step + 99)
            outs = []
            if batched:
                outs = batch_step(heap, seqs, rows, k, v, q)
            else:
                bounds = np.cumsum([0] + rows)
                for layer in range(L):
                    out = np.empty_like(q)
                    for i, s in enumerate(seqs):
                        lo, hi = bounds[i], bounds[i + 1]
                        heap.append(s, layer, k[lo:hi], v[lo:hi])
                        heap.attend(s, layer, q[lo:hi], out[lo:hi])
                    outs.append(out)
                for s in seqs:
                    heap.step(s)
            results.append(outs)
        state = [heap.read(s, layer) + heap.read_scores(s, layer) for s in seqs for layer in range(L)]
        results.append(state)
        heap.close()
    n = len(results) // 2
    for x, y in zip(results[:n], results[n:]):
        for a, b in zip(x, y):
            for u, w in zip(a if isinstance(a, tuple) else [a], b if isinstance(b, tuple) else [b]):
                np.testing.assert_array_equal(u, w)


def test_batch_attend_writes_mass_out_for_tensor_parallel_ranks():
    """Batch.attend(mass=): the mass goes to the array (one row of page_tokens per page
    of the layer), not to the scores; observe() of it gives the fused attend's scores,
    bit for bit, one row a sequence. Shapes and scores=False are refused."""
    fused, split = make_heap(policy="h2o"), make_heap(policy="h2o")
    seqs = {}
    for heap in (fused, split):
        seqs[id(heap)] = [heap.new_sequence() for _ in range(2)]
        for i, s in enumerate(seqs[id(heap)]):
            fill(heap, s, 20 + 7 * i, seed=i)
    k, v, q = rand(2, KVH, D, seed=1), rand(2, KVH, D, seed=2), rand(2, QH, D, seed=3)
    batch_step(fused, seqs[id(fused)], [1, 1], k, v, q)
    with split.batch() as batch:
        batch.plan(seqs[id(split)], [1, 1])
        for layer in range(split.n_layers):
            batch.append(layer, k, v)
            before = [split.read_scores(s, layer)[0].copy() for s in seqs[id(split)]]
            mass = np.full((batch.pages(layer), split.options["page_tokens"]), np.nan,
                           dtype=np.float32)
            with pytest.raises(kvgc.InvalidArgument, match="mass"):
                batch.attend(layer, q, mass=mass[:1])
            with pytest.raises(kvgc.InvalidArgument, match="mass_out"):
                batch.attend(layer, q, scores=False, mass=mass)
            batch.attend(layer, q, mass=mass)
            assert not np.isnan(mass).any()
            np.testing.assert_allclose(mass.sum(), 2 * QH, rtol=1e-4)
            for s, b in zip(seqs[id(split)], before):
                np.testing.assert_array_equal(split.read_scores(s, layer)[0], b)
            batch.observe(layer, mass)
        batch.step()
    for a, b in zip(seqs[id(fused)], seqs[id(split)]):
        for layer in range(L):
            for x, y in zip(fused.read_scores(a, layer), split.read_scores(b, layer)):
                np.testing.assert_array_equal(x, y)
    fused.close()
    split.close()


def test_batch_plan_names_the_sequence_that_does_not_fit():
    with make_heap(budget=128 << 10, slab_bytes=64 << 10, policy="full") as heap:
        small, big = heap.new_sequence(), heap.new_sequence()
        batch = heap.batch()
        with pytest.raises(kvgc.OutOfMemory) as e:
            batch.plan([small, big], [1, 100000])
        assert e.value.failed_index == 1
        with pytest.raises(kvgc.InvalidArgument) as e:
            batch.plan([small, small], [1, 1])
        assert e.value.failed_index == 1
        with pytest.raises(kvgc.InvalidArgument, match="must match"):
            batch.plan([small], [1, 1])
        assert heap.tokens(small, 0) == (0, 0)


def page_bytes(view, lay, offsets, p):
    base = view["arena_base"] + int(view[offsets][p])
    return np.ctypeslib.as_array((ctypes.c_uint8 * lay["page_bytes"]).from_address(base))


def decode_pages(view, lay, keys, positions, pages=None):
    """Page layout version 2: each page's header (live bits, positions) at page_offset, its
    K/V at kv_offset; fills keys[(pos, head)] and positions[pos] from every live slot."""
    pt = view["page_tokens"]
    for p in range(view["n_pages"]) if pages is None else pages:
        hdr, kv = page_bytes(view, lay, "page_offset", p), page_bytes(view, lay, "kv_offset", p)
        live = hdr[lay["live_offset"]:lay["live_offset"] + 4 * ((pt + 31) // 32)].view(np.uint32)
        pos = hdr[lay["pos_offset"]:lay["pos_offset"] + 4 * pt].view(np.int32)
        for s in range(pt):
            if live[s // 32] >> (s % 32) & 1:
                for h in range(KVH):
                    at = lay["k_offset"] + h * lay["head_stride"] + s * lay["slot_stride"]
                    keys[(int(pos[s]), h)] = kv[at:at + 4 * D].view(np.float32).copy()
                positions[int(pos[s])] = True


def test_pages_read_through_the_documented_layout_equal_read():
    with make_heap(policy="full", page_tokens=8) as heap:
        seq = heap.new_sequence()
        fill(heap, seq, 20)
        batch = heap.batch()
        batch.plan([seq], [1])
        k1, v1 = rand(1, KVH, D, seed=5), rand(1, KVH, D, seed=6)
        for layer in range(L):
            batch.append(layer, k1, v1)
        view = batch.export(0)
        lay = heap.page_layout("fp16")
        assert lay["version"] == kvgc.PAGE_LAYOUT_VERSION and view["n_pages"] == 3
        keys, positions = {}, {}
        # A private page: its K/V where its header is.
        np.testing.assert_array_equal(view["kv_offset"], view["page_offset"])
        decode_pages(view, lay, keys, positions)
        batch.step()
        k, _, pos = heap.read(seq, 0)
        assert sorted(positions) == sorted(pos.tolist()) == list(range(21))
        for i, p in enumerate(pos):
            for h in range(KVH):
                np.testing.assert_array_equal(keys[(int(p), h)], k[i, h])


def test_kv_bytes():
    assert kvgc.kv_bytes(30, 3, 64, "float16", 1000) == 30 * 3 * 64 * 2 * 2 * 1000
    assert kvgc.kv_bytes(30, 3, 64, "float16", 1000, cls="int4") < kvgc.kv_bytes(
        30, 3, 64, "float16", 1000, cls="int8")
    assert kvgc.kv_bytes(30, 3, 64, "float16", 1000, cls="int2") < kvgc.kv_bytes(
        30, 3, 64, "float16", 1000, cls="int4")  # 0.10
    with pytest.raises(kvgc.InvalidArgument, match="cls"):
        kvgc.kv_bytes(1, 1, 64, "float16", 1, cls="int3")


def test_threads_share_a_heap():
    # The GIL is released around kvgc's calls; the heap's own lock serialises them.
    with make_heap(policy="h2o", token_budget=32) as heap:
        seqs = [heap.new_sequence() for _ in range(4)]
        errors = []

        def work(s, seed):
            try:
                for t in range(50):
                    fill(heap, s, 1, seed=seed + t)
                    heap.attend(s, 0, rand(1, QH, D, seed=seed + 500 + t))
                    heap.step(s)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(s, 1000 * i)) for i, s in enumerate(seqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        heap.check()
        assert all(heap.tokens(s, 0)[1] == 50 for s in seqs)


@pytest.mark.skipif(os.environ.get("KVGC_TEST_CUDA") != "1", reason="KVGC_TEST_CUDA=1 and a GPU")
def test_cuda_needs_device_arrays():  # pragma: no cover - needs a GPU
    with kvgc.Heap(L, QH, KVH, D, "float16", device="cuda", budget="64M") as heap:
        seq = heap.new_sequence()
        with pytest.raises(kvgc.InvalidArgument, match="is on cpu; the heap is on cuda"):
            heap.append(seq, 0, rand(1, KVH, D, dtype=np.float16), rand(1, KVH, D, dtype=np.float16))


def test_observe_prefill_inside_the_plan_equals_the_per_sequence_calls():
    """Batch.plan(scored_rows=, defer_step=) is kvgc_batch_plan_ex: the early rows attend
    unscored, the last rows score, and step() leaves the sequence for its prompt's end."""
    chunk, scored = 40, 8
    k, v, q = rand(chunk, KVH, D, seed=1), rand(chunk, KVH, D, seed=2), rand(chunk, QH, D, seed=3)
    results = []
    for batched in (False, True):
        heap = make_heap(policy="h2o", token_budget=16, window=4)
        seq = heap.new_sequence()
        outs = []
        if batched:
            outs = batch_step(heap, [seq], [chunk], k, v, q, scored_rows=[scored], defer_step=[True])
        else:
            for layer in range(L):
                heap.append(seq, layer, k[:-scored], v[:-scored])
                a = heap.attend(seq, layer, q[:-scored], scores=False)
                heap.append(seq, layer, k[-scored:], v[-scored:])
                outs.append(np.concatenate([a, heap.attend(seq, layer, q[-scored:])]))
        assert heap.stats().gcs == 0  # deferred: nothing collected yet
        results.append((outs, [heap.read_scores(seq, layer)[0] for layer in range(L)]))
        heap.step(seq)  # the prompt's end: one GC over every appended token
        results[-1] += ([heap.read(seq, layer)[2] for layer in range(L)],)
        heap.close()
    for x, y in zip(results[0], results[1]):
        for a, b in zip(x, y):
            np.testing.assert_array_equal(a, b)
    with make_heap() as heap:
        seq = heap.new_sequence()
        with pytest.raises(kvgc.InvalidArgument, match="scored_rows has 2 entries"):
            heap.batch().plan([seq], [1], scored_rows=[1, 1])


# ---- the prefix cache and shared pages (0.7) ------------------------------------------

PT = 8  # page_tokens of the prefix tests: 30 prompt tokens are 3 full pages and a partial one


def prefix_heap(**kw):
    kw.setdefault("policy", "full")
    kw.setdefault("page_tokens", PT)
    return make_heap(**kw)


def pages(n):
    return (n + PT - 1) // PT


def prefix_state(heap):
    """What a failed prefix call must leave as it was."""
    s = heap.stats()
    return (s.prefixes, s.prefixes_pinned, s.shared_pages, s.shared_refs, s.pages_shared,
            s.live_tokens, s.classes["fp16"]["pages_used"], s.cls_header["pages_used"],
            s.prefix_lookups, s.prefix_hits, s.prefix_tokens_attached)


def keeper_with_prompt(heap, n=30, tenant=0, seed=1):
    seq = heap.new_sequence(tenant)
    k, v = fill(heap, seq, n, seed=seed)
    return seq, k, v, list(range(100, 100 + n))


def test_prefix_stats_fields_and_constants():
    assert kvgc.STATS_VERSION == 10 and kvgc.PAGE_LAYOUT_VERSION == 2
    assert kvgc._kvgc.PREFIX_PIN == 1
    with prefix_heap() as heap:
        s = heap.stats()
        assert s.version == 10
        for f in ("shared_pages", "shared_bytes", "shared_refs", "prefixes", "prefixes_pinned",
                  "prefix_lookups", "prefix_hits", "prefix_tokens_attached",
                  "prefix_evictions", "pages_shared", "cow_copies", "cached_only_bytes",
                  "pages_migrated", "slabs_evacuated", "pages_shrunk", "bytes_shrunk",
                  "pages_unshared"):
            assert getattr(s, f) == 0, f
        assert set(s.cls_header) == set(s.classes["fp16"]) and s.cls_header["page_bytes"] > 0
        assert s.cls_header["page_bytes"] < s.classes["fp16"]["page_bytes"]
    for name in ("keep_prefix", "attach_prefix", "pin_prefix", "drop_prefix"):
        assert getattr(kvgc.Heap, name).__doc__
    doc = kvgc.Heap.keep_prefix.__doc__
    assert "salt" in doc and "tenant" in doc and "least-recently-used" in doc and "step" in doc


def test_prefix_keep_attach_round_trip():
    with prefix_heap() as heap:
        keeper, k, v, ids = keeper_with_prompt(heap)
        before = heap.stats()
        p = heap.keep_prefix(keeper, ids)
        assert isinstance(p, int) and p != 0
        s = heap.stats()
        assert (s.prefixes, s.prefixes_pinned) == (1, 0)
        assert s.shared_pages == L * pages(30) and s.pages_shared == L * pages(30)
        assert s.shared_refs == 2 * L * pages(30)  # the keeper's header pages and the prefix
        assert s.classes["fp16"]["pages_used"] == before.classes["fp16"]["pages_used"]  # no copy
        # The same ids again (an array this time): the same prefix, nothing else changes.
        assert heap.keep_prefix(keeper, np.array(ids, np.int32)) == p
        assert heap.stats().prefixes == 1

        seq = heap.new_sequence()
        pre = heap.stats()
        assert heap.attach_prefix(seq, np.array(ids, np.int32)) == 30
        post = heap.stats()
        # No K/V page allocated by the attach: a header page per shared page, that is all.
        assert post.classes["fp16"]["pages_used"] == pre.classes["fp16"]["pages_used"]
        assert post.cls_header["pages_used"] == pre.cls_header["pages_used"] + L * pages(30)
        assert post.shared_pages == pre.shared_pages
        assert (post.prefix_lookups, post.prefix_hits, post.prefix_tokens_attached) == (1, 1, 30)
        assert post.used_bytes == post.arena_bytes - post.scratch_bytes - post.free_bytes
        for layer in range(L):
            assert heap.tokens(seq, layer) == (30, 30)
            ka, va, pa = heap.read(seq, layer)
            kk, vk, pk = heap.read(keeper, layer)
            np.testing.assert_array_equal(ka, kk)
            np.testing.assert_array_equal(va, vk)
            np.testing.assert_array_equal(ka, k)
            np.testing.assert_array_equal(va, v)
            np.testing.assert_array_equal(pa, np.arange(30))
            scores, gens = heap.read_scores(seq, layer)
            np.testing.assert_array_equal(scores, np.zeros(30, np.float32))
            assert (gens[:4] == kvgc.Generation.SINK).all()
        heap.check()
        # The attached sequence goes on as any: its first write copies the shared tail page.
        k2, v2 = rand(5, KVH, D, seed=9), rand(5, KVH, D, seed=10)
        for layer in range(L):
            heap.append(seq, layer, k2, v2)
        assert heap.stats().cow_copies == L
        out = heap.attend(seq, 0, rand(1, QH, D, seed=11))
        ref, _ = reference_attention(rand(1, QH, D, seed=11), np.concatenate([k, k2]),
                                     np.concatenate([v, v2]))
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(heap.read(keeper, 0)[0], k)  # the prefix is untouched
        heap.check()


def test_prefix_partial_match():
    with prefix_heap() as heap:
        keeper, k, _, ids = keeper_with_prompt(heap)
        heap.keep_prefix(keeper, ids)
        differs = list(ids)
        differs[13] = -5          # page 1: only page 0 matches
        tail_differs = list(ids)
        tail_differs[29] = -1     # the partly filled page must match whole
        cases = [(ids + [1, 2, 3], 30),   # longer: the whole prefix, the rest is the engine's
                 (ids[:20], 16),          # shorter: whole pages only
                 (differs, 8), (tail_differs, 24), (ids[:7], 0),
                 ([i + 1 for i in ids], 0), ([], 0)]
        for want_ids, want in cases:
            seq = heap.new_sequence()
            got = heap.attach_prefix(seq, want_ids)
            assert got == want, (want_ids[:3], got)
            for layer in range(L):
                assert heap.tokens(seq, layer) == (want, want)
            if want:
                np.testing.assert_array_equal(heap.read(seq, 0)[0], k[:want])
            heap.free_sequence(seq)
        s = heap.stats()
        assert (s.prefix_lookups, s.prefix_hits) == (len(cases), 4)
        assert s.prefix_tokens_attached == 30 + 16 + 8 + 24
        heap.check()


def test_prefix_keep_first_whole_pages():
    with prefix_heap() as heap:
        keeper, k, _, ids = keeper_with_prompt(heap)
        with pytest.raises(kvgc.InvalidArgument, match="page_tokens"):
            heap.keep_prefix(keeper, ids[:12])      # not a page boundary
        assert heap.stats().shared_pages == 0
        heap.keep_prefix(keeper, ids[:16])          # 2 whole pages; the rest stays its own
        assert heap.stats().shared_pages == L * 2
        seq = heap.new_sequence()
        assert heap.attach_prefix(seq, ids) == 16
        np.testing.assert_array_equal(heap.read(seq, 0)[0], k[:16])
        heap.check()


def attached_and_ranked(heap, n=48):
    """A kept n-token prompt attached by a new sequence, whose first step ranks it by a
    rising mass (the keeper let go): (seq, the prompt's K)."""
    keeper, k, _, ids = keeper_with_prompt(heap, n=n)
    heap.keep_prefix(keeper, ids)
    heap.free_sequence(keeper)
    seq = heap.new_sequence()
    assert heap.attach_prefix(seq, ids) == n
    for layer in range(L):
        heap.observe(seq, layer, np.linspace(0.1, 1.0, n, dtype=np.float32))
    heap.step(seq)
    return seq, k


def test_prefix_charge_prune_demotes_shared_tokens_in_place():
    # prune (0.8; shrink since 0.15): the holder's ladder demotes shared tokens as an
    # unshared sequence's would (read_classes reports the class it charged), but their K/V
    # stay the shared fp16 pages' until a later step re-stores them (the next test): read
    # back exactly as appended, with no private copy.
    with prefix_heap(policy="h2o", token_budget=8, window=4, sinks=2, demote="int4",
                     prefix_charge="prune") as heap:
        seq, k = attached_and_ranked(heap)
        cls = heap.read_classes(seq, 0)
        assert (cls == kvgc.StorageClass.INT4).any() and len(cls) < 48  # demoted, evicted
        rk, _, pos = heap.read(seq, 0)
        np.testing.assert_array_equal(rk, k[pos])      # fp16 (here f32) bytes, not int4
        assert heap.stats().classes["int4"]["pages_used"] == 0  # no private copy
        heap.check()


def test_prefix_charge_shrink_restores_pages_every_holder_demoted():
    # shrink (0.13): prune, and a shared page whose every holder counts its live slots at
    # the ladder's first rung below fp16 (here int4, the only rung) is re-stored there at
    # the next step: the holder then reads it at int4, and the pages' bytes shrink.
    with prefix_heap(policy="h2o", token_budget=8, window=4, sinks=2, demote="int4",
                     prefix_charge="shrink") as heap:
        seq, k = attached_and_ranked(heap)  # demoted in place: the holder judges the pages
        assert heap.stats().pages_shrunk == 0
        heap.step(seq)                      # the pass before it re-stores them
        s = heap.stats()
        assert s.pages_shrunk > 0 and s.bytes_shrunk > 0
        assert s.classes["int4"]["pages_used"] > 0  # the shrunk shared pages
        rk, _, pos = heap.read(seq, 0)
        cls = heap.read_classes(seq, 0)
        shrunk = cls == kvgc.StorageClass.INT4
        assert shrunk.any()
        # fp16 (here f32) tokens read exactly; int4 ones within int4's error, not exactly.
        np.testing.assert_array_equal(rk[~shrunk], k[pos[~shrunk]])
        err = np.linalg.norm(rk[shrunk] - k[pos[shrunk]]) / np.linalg.norm(k[pos[shrunk]])
        assert 0 < err < 0.15
        heap.check()


def test_prefix_tenant_isolation_and_salt():
    with prefix_heap() as heap:
        keeper, k, _, ids = keeper_with_prompt(heap, tenant=1)
        own = heap.keep_prefix(keeper, ids)                   # tenant 1 only
        salted = heap.keep_prefix(keeper, ids, salt=0xabc)    # anyone with the salt
        assert own != salted and heap.stats().prefixes == 2
        other = heap.new_sequence(tenant=2)
        assert heap.attach_prefix(other, ids) == 0             # another tenant gets 0
        assert heap.attach_prefix(other, ids, salt=0xabd) == 0  # a wrong salt too
        assert heap.tokens(other, 0) == (0, 0) and heap.stats().prefix_hits == 0
        assert heap.attach_prefix(other, ids, salt=0xabc) == 30  # the same salt hits
        np.testing.assert_array_equal(heap.read(other, 0)[0], k)
        # The shared pages stay charged to tenant 1; tenant 2 pays its header pages only.
        s = heap.stats()
        assert heap.tenant_usage(2)[0] == L * pages(30) * s.cls_header["page_bytes"]
        same = heap.new_sequence(tenant=1)
        assert heap.attach_prefix(same, ids) == 30            # the keeper's tenant, salt 0
        salted_same = heap.new_sequence(tenant=1)
        assert heap.attach_prefix(salted_same, ids, salt=0xabd) == 0
        assert heap.stats().prefix_hits == 2
        heap.check()


def test_prefix_bad_arguments_raise_and_change_nothing():
    # A small window, so that a step ranks (and evicts) the prompt's tokens.
    with prefix_heap(policy="h2o", token_budget=24, window=4, sinks=2) as heap:
        keeper, _, _, ids = keeper_with_prompt(heap)
        arr = np.array(ids, np.int32)
        state = prefix_state(heap)
        bad_keeps = [
            (lambda: heap.keep_prefix(keeper, np.array(ids, np.int64)), kvgc.InvalidArgument,
             "token_ids has dtype int64"),
            (lambda: heap.keep_prefix(keeper, np.repeat(arr, 2)[::2]), kvgc.InvalidArgument,
             "C-contiguous"),
            (lambda: heap.keep_prefix(keeper, arr.reshape(5, 6)), kvgc.InvalidArgument, "shape"),
            (lambda: heap.keep_prefix(keeper, ids[:29]), kvgc.InvalidArgument, "length"),
            (lambda: heap.keep_prefix(keeper, []), kvgc.InvalidArgument, "n_tokens"),
            (lambda: heap.keep_prefix(keeper, ids[:-1] + [2 ** 40]), kvgc.InvalidArgument,
             r"token_ids\[29\]"),
            (lambda: heap.keep_prefix(keeper, ids, salt=-1), kvgc.InvalidArgument, "salt=-1"),
            (lambda: heap.keep_prefix(keeper, ids, salt=1 << 64), kvgc.InvalidArgument, "salt"),
            (lambda: heap.keep_prefix(keeper, ids, stream="default"), kvgc.InvalidArgument,
             "stream"),
            (lambda: heap.keep_prefix(keeper + 1000, ids), kvgc.NotFound,
             "not a live sequence"),
            (lambda: heap.keep_prefix(keeper, ids[:-1] + [1.5]), TypeError, r"token_ids\[29\]"),
            (lambda: heap.keep_prefix(keeper, "abc"), TypeError, "token_ids"),
            (lambda: heap.keep_prefix(keeper, 30), TypeError, "token_ids"),
        ]
        for call, exc, what in bad_keeps:
            with pytest.raises(exc, match=what):
                call()
            assert prefix_state(heap) == state, what
        heap.check()
        # Attach: to a sequence that already holds tokens, an unknown one, bad ids.
        fresh = heap.new_sequence()
        state = prefix_state(heap)
        for call, exc, what in [
                (lambda: heap.attach_prefix(keeper, ids), kvgc.InvalidArgument, "already holds"),
                (lambda: heap.attach_prefix(fresh + 1000, ids), kvgc.NotFound,
                 "not a live sequence"),
                (lambda: heap.attach_prefix(fresh, arr.astype(np.uint32)), kvgc.InvalidArgument,
                 "dtype uint32"),
                (lambda: heap.attach_prefix(fresh, ids, salt=2.0), kvgc.InvalidArgument, "salt"),
                (lambda: heap.attach_prefix(fresh, [None]), TypeError, "token_ids")]:
            with pytest.raises(exc, match=what):
                call()
            assert prefix_state(heap) == state, what
        assert heap.tokens(fresh, 0) == (0, 0)
        # Ranked by a step: too late to keep.
        heap.step(keeper)
        with pytest.raises(kvgc.InvalidArgument, match="step"):
            heap.keep_prefix(keeper, ids)
        assert heap.stats().prefixes == 0
        # An unknown handle: NotFound naming it, for pin and drop alike.
        with pytest.raises(kvgc.NotFound, match="12345"):
            heap.pin_prefix(12345)
        with pytest.raises(kvgc.NotFound, match="12345"):
            heap.drop_prefix(12345)
        heap.check()


def test_prefix_pin_and_drop():
    with prefix_heap() as heap:
        keeper, k, _, ids = keeper_with_prompt(heap)
        p = heap.keep_prefix(keeper, ids, pin=True)
        assert heap.stats().prefixes_pinned == 1
        heap.pin_prefix(p, False)
        assert heap.stats().prefixes_pinned == 0
        heap.pin_prefix(p)
        assert heap.stats().prefixes_pinned == 1
        # keep again with the same ids: the same handle, pin still applies
        assert heap.keep_prefix(keeper, ids, pin=False) == p
        # Sequences attached keep their pages after the drop; the rest go back.
        seq = heap.new_sequence()
        assert heap.attach_prefix(seq, ids) == 30
        heap.drop_prefix(p)
        s = heap.stats()
        assert (s.prefixes, s.prefixes_pinned) == (0, 0)
        assert s.shared_pages == L * pages(30)
        np.testing.assert_array_equal(heap.read(seq, 1)[0], k)
        with pytest.raises(kvgc.NotFound):
            heap.pin_prefix(p)
        with pytest.raises(kvgc.NotFound):
            heap.drop_prefix(p)
        assert heap.attach_prefix(heap.new_sequence(), ids) == 0  # gone from the cache
        heap.free_sequence(keeper)
        heap.free_sequence(seq)
        s = heap.stats()
        assert s.shared_pages == 0 and s.classes["fp16"]["pages_used"] == 0
        assert s.cls_header["pages_used"] == 0
        heap.check()


def test_prefix_lru_eviction_spares_the_pinned():
    # A small arena: cached prompts that no sequence holds fill it, and the append that
    # finds no room evicts the least recently used unpinned ones first.
    with prefix_heap(budget=512 << 10, slab_bytes=64 << 10) as heap:
        kept, prompts = [], []
        for i in range(10000):
            seq = heap.new_sequence()
            fill(heap, seq, 32, seed=i)
            prompts.append(list(range(1000 * i, 1000 * i + 32)))
            kept.append(heap.keep_prefix(seq, prompts[-1], pin=(i == 0)))
            heap.free_sequence(seq)
            if heap.stats().prefix_evictions:
                break
        assert len(kept) >= 4
        assert heap.attach_prefix(heap.new_sequence(), prompts[0]) == 32   # pinned: kept
        assert heap.attach_prefix(heap.new_sequence(), prompts[1]) == 0    # the oldest: gone
        assert heap.attach_prefix(heap.new_sequence(), prompts[-1]) == 32  # the newest: kept
        with pytest.raises(kvgc.NotFound):
            heap.pin_prefix(kept[1])
        heap.check()


def test_fork_shares_pages():
    with prefix_heap(policy="h2o") as heap:
        a = heap.new_sequence()
        fill(heap, a, 20)
        before = heap.stats()
        b = heap.fork(a, tenant=1)
        s = heap.stats()
        n = L * pages(20)
        assert s.shared_pages == n and s.shared_refs == 2 * n and s.pages_shared == n
        assert s.shared_bytes == n * s.classes["fp16"]["page_bytes"]
        assert s.classes["fp16"]["pages_used"] == before.classes["fp16"]["pages_used"]  # no copy
        assert s.cls_header["pages_used"] == 2 * n
        for layer in range(L):
            for x, y in zip(heap.read(a, layer), heap.read(b, layer)):
                np.testing.assert_array_equal(x, y)
        # The first write into the shared partly filled tail copies that page, for b only.
        kb = rand(1, KVH, D, seed=3)
        for layer in range(L):
            heap.append(b, layer, kb, kb)
        assert heap.stats().cow_copies == L
        assert heap.tokens(a, 0) == (20, 20) and heap.tokens(b, 0) == (21, 21)
        heap.free_sequence(a)
        heap.free_sequence(b)
        s = heap.stats()
        assert s.shared_pages == 0 and s.cls_header["pages_used"] == 0
        heap.check()


def test_attached_pages_exported_with_kv_offset():
    with prefix_heap(policy="full") as heap:
        keeper, k, _, ids = keeper_with_prompt(heap)
        heap.keep_prefix(keeper, ids)
        seqs = [heap.new_sequence(), heap.new_sequence()]
        for s in seqs:
            assert heap.attach_prefix(s, ids) == 30
        with heap.batch() as batch:
            batch.plan(seqs, [3, 3])
            k1, v1 = rand(6, KVH, D, seed=5), rand(6, KVH, D, seed=6)
            for layer in range(L):
                batch.append(layer, k1, v1)
            view = batch.export(0)
            lay = heap.page_layout("fp16")
            assert view["n_pages"] == 2 * pages(33)
            assert view["kv_offset"].dtype == np.uint64
            assert len(view["kv_offset"]) == view["n_pages"]
            shared = view["kv_offset"] != view["page_offset"]
            assert shared.sum() == 2 * 3   # the three full prompt pages of each
            assert view["kv_offset"][0] == view["kv_offset"][5]      # one page, two headers
            assert view["page_offset"][0] != view["page_offset"][5]
            decoded = []
            for i in range(2):
                keys, positions = {}, {}
                lo, hi = view["page_indptr"][i], view["page_indptr"][i + 1]
                decode_pages(view, lay, keys, positions, range(lo, hi))
                decoded.append((keys, positions))
            batch.step()
        for i, s in enumerate(seqs):
            keys, positions = decoded[i]
            kr, _, pos = heap.read(s, 0)
            assert sorted(positions) == sorted(pos.tolist()) == list(range(33))
            np.testing.assert_array_equal(kr[:30], k)
            for j, p in enumerate(pos):
                for h in range(KVH):
                    np.testing.assert_array_equal(keys[(int(p), h)], kr[j, h])
        heap.check()
