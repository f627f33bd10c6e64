"""kvgc.transformers: a transformers ``Cache`` whose K/V live only in kvgc pages.

    import torch, kvgc.transformers as kt
    from transformers import AutoModelForCausalLM
    kt.register()                                   # idempotent; importing registers too
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvgc")
    cache = kt.KvgcCache(model.config, policy="generational", byte_budget=0.25)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    print(cache.live_tokens(), cache.kv_bytes(), cache.stats())

How it works. ``KvgcCache.update()`` keeps nothing dense: it stages the layer's new K/V
rows (a view of the model's own tensors) and returns them, tagged with the cache, to
the attention function ``"kvgc"``, which appends them to the layer's kvgc segment and
runs kvgc's paged attention over it. That kernel reads int8/int4 tokens in their class
and adds each token's attention mass to the GC's scores, so eviction and demotion rank
tokens by what the model actually attends to. The GC runs once per sequence after each
forward's last layer:

- prefill="observe" (default, as kvgc-run): a multi-token forward caches every token,
  but only its last ``observe_tokens`` queries add mass (through kvgc's kernel; the
  queries before them attend through torch SDPA, exactly: ``prefill_attention``); each
  token's score is then max-pooled over +-``pool_radius`` positions (SnapKV's
  clustering) and the GC steps;
- prefill="stream": every query of every forward scores and the GC steps after it;
- decode (one new token per sequence): every token scores; a batch of several sequences
  goes through one ``kvgc.Batch`` plan per forward.

Positions stay logical: ``get_seq_length()`` is the number of positions the model has
fed (cache_position and RoPE continue after evictions); ``live_tokens()`` and
``kv_bytes()`` say what is physically kept. Left padding (the 2D attention_mask that
``generate`` passes) is never cached, so kvgc's positions count each sequence's real
tokens, as HF's ``position_ids = cumsum(mask) - 1`` do.

What a transformers Cache normally allows but kvgc cannot (there is no dense copy):
dense K/V (``cache[i]``, iterating, ``to_legacy_cache()``, using ``cache.layers[i].keys``
as a tensor), beam search and other batch reordering, and ``crop()`` to an arbitrary
length. These raise ``kvgc.Unsupported`` with a message. ``checkpoint()`` +
``crop(length)`` roll back to a checkpointed length (a kvgc fork): with
``auto_checkpoint=True`` kvpress's pipeline (several questions on one context, rolled
back by ``layer.keys = layer.keys[:, :, :n]``) runs unchanged on a KvgcCache.

Without a KvgcCache (``use_cache=False`` or a DynamicCache) the "kvgc" attention falls back
to SDPA, so a model loaded with attn_implementation="kvgc" still runs everything else.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers.cache_utils import Cache

import kvgc

from . import _hf_compat
from ._options import heap_options as _check_heap_options
from ._hf_attention import (_causal_sdpa, _chunk_sdpa, _pool_delta, _real_rows,
                            kvgc_attention_forward, kvgc_mask)
from ._hf_layer import DenseKV, KvgcLayer, _dense_error

__all__ = ["KvgcCache", "KvgcLayer", "DenseKV", "register", "use_kvgc",
           "kvgc_attention_forward", "kvgc_mask"]

ATTN_NAME = "kvgc"
_KV_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
              "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DEFAULT_MAX_TOKENS = 8192


class _Forward:
    """What one model forward does, decided at its first layer and shared by the rest."""

    __slots__ = ("b", "q_len", "real", "all_real", "decode", "batched", "stream")

    def __init__(self, b, q_len, real, decode, batched, stream):
        self.b, self.q_len, self.real = b, q_len, real
        self.all_real = all(r == q_len for r in real)
        self.decode, self.batched, self.stream = decode, batched, stream


class KvgcCache(Cache):
    """A transformers Cache whose K/V live only in a kvgc heap (see the module docstring).

    Args:
        config: the model's config (a PretrainedConfig; its text config is used). Full
            attention Llama-family models (Llama, SmolLM2, Qwen2, Mistral without a sliding
            window), GQA included; the model must run attn_implementation="kvgc".
        kv_dtype: dtype K/V are stored in: torch.float16, torch.bfloat16, torch.float32 (or
            their names); None = the dtype of the model's K/V at the first forward. Rows are
            converted on the way in and the attention output back to the model's dtype (a
            float32 model with kv_dtype=torch.float16 stores f16 bytes).
        device: "cpu" or "cuda": the heap's device; the model's tensors must be there.
        prefill: "observe" (a multi-token forward scores only its last observe_tokens
            queries, then pools and steps once) or "stream" (every query scores; one GC
            step per forward).
        observe_tokens: how many of a prefill's last queries score in "observe" mode (32).
        pool_radius: max-pool radius over positions applied after an observe prefill (5,
            as kvgc-run's since 0.10.1; 0 disables pooling).
        key_prior: weight of a query-agnostic prior added to an observe prefill's scores
            (0: off). Each new token gets its key's diversity, 1 - cosine to the mean
            direction of its head's new keys, summed over KV heads (KeyDiff's signal),
            scaled so that a layer's prior totals key_prior times the mass its observed
            queries paid. For prompts whose question comes after the compressed context
            (kvpress's harness, query_aware=False): the context's last queries ask nothing,
            so their mass alone does not find a fact the question will need.
        max_tokens: longest sequence the default arena must hold (default:
            min(max_position_embeddings, 8192)); ignored when budget/budget_bytes is given.
        auto_checkpoint: checkpoint() automatically at the end of the first prefill, so a
            later crop(that length) restores it (kvpress's several questions per context).
        prefill_attention: who attends the queries of an observe prefill that add no
            mass (all but its last observe_tokens). "sdpa" (default): torch SDPA, exactly
            and at DynamicCache + SDPA's speed; into an empty sequence (a first prompt)
            over the chunk's own rows (causal), into one that holds tokens (a second
            turn, a chunked prefill) also over a dense copy of its live rows (read from
            kvgc, int8/int4 dequantised; an explicit mask). Every row is still appended
            to kvgc, and the scored tail (the queries whose mass the GC ranks by) and
            every decode step run through kvgc's kernel, so the GC's scores are those of
            "kvgc". "kvgc": every query through kvgc's kernel, which is built for decode
            (a 4K prompt then prefills at about 0.4x SDPA's speed on a CPU); it is there
            to test and measure that kernel on prefill. prefill="stream" scores every
            query, so it runs them all through kvgc whichever is set.
        **heap_options: kvgc.Heap options (policy=, byte_budget=, token_budget=, demote=,
            sinks=, window=, page_tokens=, cpu_threads=, budget= / budget_bytes= for the
            arena, ...; see help(kvgc.Heap)). The default arena holds max_tokens tokens of
            full-precision K/V for each sequence of the first batch, plus one copy more
            (room for a checkpoint). As for kvgc.Heap, KVGC_* environment variables
            override these keywords unless ignore_env=True.

    The heap and its sequences are created at the first forward (the batch size is known
    then); the batch size is fixed from then on. ``close()`` releases the heap. An
    exception inside a forward (kvgc.OutOfMemory when the arena is full, ...) leaves the
    layers appended unequally: ``reset()`` the cache before using it again.

    Attributes (stable; kvgc.kvpress relies on them):
        heap: the kvgc.Heap (None before the first forward).
        n_layers, n_q_heads, n_kv_heads, head_dim: the model's attention shape.
        kv_dtype: the storage dtype (a torch dtype; None until known).
        prefill, observe_tokens, pool_radius, key_prior, prefill_attention, max_tokens,
        auto_checkpoint, heap_options: the constructor's arguments.

    Methods beyond transformers' Cache: checkpoint(), restore(), live_tokens(layer),
    lengths(layer), kv_bytes(), stats(), positions(index, layer), read(layer, index),
    reset(), close().
    """

    def __init__(self, config, *, kv_dtype=None, device="cpu", prefill="observe",
                 observe_tokens=32, pool_radius=5, key_prior=0.0, max_tokens=None,
                 auto_checkpoint=False, prefill_attention="sdpa", **heap_options):
        self.hf = _hf_compat.profile()
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        _check_full_attention(cfg)
        self.n_layers = int(cfg.num_hidden_layers)
        self.n_q_heads = int(cfg.num_attention_heads)
        self.n_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.n_q_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_q_heads)
        if self.n_q_heads % self.n_kv_heads:
            raise ValueError(f"num_attention_heads={self.n_q_heads} is not a multiple of "
                             f"num_key_value_heads={self.n_kv_heads}")
        if kv_dtype is not None and kv_dtype not in _KV_DTYPES:
            raise ValueError(f"kv_dtype={kv_dtype!r}: expected torch.float16, torch.bfloat16, "
                             "torch.float32 (or their names) or None (the model's dtype)")
        self.kv_dtype = _KV_DTYPES[kv_dtype] if isinstance(kv_dtype, str) else kv_dtype
        if prefill_attention not in ("kvgc", "sdpa"):
            raise ValueError(f"prefill_attention={prefill_attention!r}: expected 'kvgc' or 'sdpa'")
        self.prefill_attention = prefill_attention
        if prefill not in ("observe", "stream"):
            raise ValueError(f"prefill={prefill!r}: expected 'observe' or 'stream'")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda'")
        if "device" in heap_options:
            raise ValueError("pass device= as KvgcCache's own argument")
        # Names and values checked now (kvgc.InvalidArgument, a ValueError), not at the
        # first forward where the heap is created.
        _check_heap_options(**heap_options)
        self.device, self.prefill = device, prefill
        self.observe_tokens, self.pool_radius = int(observe_tokens), int(pool_radius)
        key_prior = float(key_prior)
        if not (key_prior >= 0 and math.isfinite(key_prior)):
            raise ValueError(f"key_prior={key_prior!r}: expected a finite number >= 0")
        self.key_prior = key_prior
        mpe = getattr(cfg, "max_position_embeddings", None) or _DEFAULT_MAX_TOKENS
        self.max_tokens = int(max_tokens or min(mpe, _DEFAULT_MAX_TOKENS))
        self.auto_checkpoint = bool(auto_checkpoint)
        self.heap_options = dict(heap_options)
        self.heap = None          # kvgc.Heap, created at the first forward
        self._batch = None        # kvgc.Batch for batched decode
        self._seqs = []           # one kvgc sequence per batch row
        self._lengths = [0] * self.n_layers   # logical positions fed, per layer
        self._staged = [None] * self.n_layers  # (k, v) new rows awaiting the attention
        self._fwd = None
        self._checkpoint = None   # (forked seqs, lengths)
        self._trace = None        # tests: a list to record the pointers handed to kvgc
        super().__init__(layers=[KvgcLayer(self, i) for i in range(self.n_layers)])

    def __repr__(self):
        return (f"KvgcCache(layers={self.n_layers}, batch={len(self._seqs)}, "
                f"length={self.get_seq_length()}, prefill={self.prefill!r}, "
                f"heap={self.heap!r})")

    # ---- transformers' Cache contract ------------------------------------------------
    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        """Stages the layer's new rows for the "kvgc" attention; returns them (not a
        concatenation: kvgc's attention reads the cached rows from its pages)."""
        return self._stage(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx=0):
        """Logical length: positions fed so far (padding included), not what is kept."""
        return self._lengths[layer_idx] if layer_idx < self.n_layers else 0

    def get_mask_sizes(self, cache_position, layer_idx):
        return self.layers[min(layer_idx, self.n_layers - 1)].get_mask_sizes(cache_position)

    def get_max_cache_shape(self, layer_idx=0):
        return -1

    @property
    def max_batch_size(self):
        return len(self._seqs)

    @property
    def max_cache_len(self):
        return -1

    @property
    def is_compileable(self):
        return False

    def __getitem__(self, layer_idx):
        raise _dense_error("per-layer (keys, values) tensors")

    def __iter__(self):
        raise _dense_error("per-layer (keys, values) tensors")

    def to_legacy_cache(self):
        """Raises kvgc.Unsupported: the K/V live only in kvgc pages, so there is no legacy
        (dense) cache to return."""
        raise _dense_error("legacy (dense) cache")

    def reorder_cache(self, beam_idx):
        raise kvgc.Unsupported("KvgcCache does not support beam search (reordering the batch "
                               "would copy whole caches every step); use greedy or sampling")

    def batch_repeat_interleave(self, repeats):
        raise kvgc.Unsupported("KvgcCache cannot repeat batch rows (beam search, assisted or "
                               "contrastive decoding); use greedy or sampling")

    def batch_select_indices(self, indices):
        raise kvgc.Unsupported("KvgcCache cannot select batch rows (beam search, assisted or "
                               "contrastive decoding); use greedy or sampling")

    def crop(self, max_length):
        """Rolls back to `max_length` positions. Possible only to the current length (no-op)
        or to the length of the last checkpoint() (restores it); a negative value counts
        from the end as in DynamicCache. Anything else raises kvgc.Unsupported: evicted and
        scored tokens cannot be un-appended."""
        length = self.get_seq_length()
        if max_length < 0:
            max_length = length - abs(max_length)
        if max_length >= length:
            return
        if self._checkpoint is not None and max_length == self._checkpoint[1][0]:
            self.restore()
            return
        ck = "no checkpoint" if self._checkpoint is None else \
            f"the checkpoint is at {self._checkpoint[1][0]}"
        raise kvgc.Unsupported(f"KvgcCache cannot crop {length} positions to {max_length} "
                               f"({ck}): kvgc appends are not undoable; call checkpoint() at the "
                               "length you want to return to")

    def reset(self):
        """Frees every sequence and checkpoint; the cache starts empty (same heap)."""
        self._drop_checkpoint()
        for s in self._seqs:
            self.heap.free_sequence(s)
        self._seqs, self._fwd = [], None
        self._lengths = [0] * self.n_layers
        self._staged = [None] * self.n_layers

    # ---- kvgc extras -------------------------------------------------------------------
    def checkpoint(self):
        """Forks every sequence now (kvgc copies the pages, scores and GC state), so that
        crop(current length) or restore() returns here later. Replaces an older checkpoint.
        Its pages count in kv_bytes()/stats() while it exists."""
        if self.heap is None or self._fwd is not None:
            raise kvgc.Unsupported("checkpoint() needs a filled cache and no forward in flight")
        self._drop_checkpoint()
        self._checkpoint = ([self.heap.fork(s) for s in self._seqs], list(self._lengths))

    def restore(self):
        """Returns to the last checkpoint (which stays, for further restores)."""
        if self._checkpoint is None:
            raise kvgc.Unsupported("restore() without a checkpoint()")
        forks, lengths = self._checkpoint
        new = [self.heap.fork(s) for s in forks]  # fork first: all or nothing on OOM
        for s in self._seqs:
            self.heap.free_sequence(s)
        self._seqs, self._lengths, self._fwd = new, list(lengths), None

    def live_tokens(self, layer=0):
        """Tokens kvgc keeps for `layer`, one count per batch row."""
        return [self.heap.tokens(s, layer)[0] for s in self._seqs]

    def lengths(self, layer=0):
        """Tokens ever appended to `layer`, per batch row (real tokens: no padding)."""
        return [self.heap.tokens(s, layer)[1] for s in self._seqs]

    def kv_bytes(self):
        """Bytes of kvgc pages in use (every class, every sequence and checkpoint)."""
        return 0 if self.heap is None else self.heap.stats().used_bytes

    def stats(self):
        """kvgc.Stats of the heap (None before the first forward)."""
        return None if self.heap is None else self.heap.stats()

    def positions(self, index=0, layer=0):
        """Positions (numpy int32, sorted) of the tokens kvgc keeps for batch row `index`."""
        n = self.heap.tokens(self._seqs[index], layer)[0]
        pos = self._out_array((n,), np.int32, torch.int32)
        self.heap.read(self._seqs[index], layer, pos_out=pos)
        return np.sort(np.asarray(pos.cpu()) if torch.is_tensor(pos) else pos)

    def read(self, layer, index=0):
        """A dense copy (k, v, pos) of what kvgc keeps for (batch row, layer), in read order:
        k, v [live, n_kv_heads, head_dim] torch tensors (int8/int4 dequantised). For
        inspection: nothing in the forward path uses it."""
        like = torch.empty(0, dtype=self._dtype(), device=self.device)
        k, v, pos = self.heap.read(self._seqs[index], layer, like=like)
        return k, v, pos

    def close(self):
        """Releases the heap (the cache is unusable afterwards)."""
        if self.heap is not None:
            self.heap.close()
        self.heap, self._batch, self._seqs, self._checkpoint = None, None, [], None

    # ---- internals -----------------------------------------------------------------------
    def _dtype(self):
        return self.kv_dtype or torch.float32

    def _out_array(self, shape, np_dtype, torch_dtype):
        if self.device == "cpu":
            return np.empty(shape, dtype=np_dtype)
        return torch.empty(shape, dtype=torch_dtype, device=self.device)

    def _drop_checkpoint(self):
        if self._checkpoint is not None:
            for s in self._checkpoint[0]:
                self.heap.free_sequence(s)
            self._checkpoint = None

    def _stage(self, layer, k, v):
        # A layer whose rows were never attended means the model is not running the "kvgc"
        # attention: it would have attended only the new rows. Say so instead.
        prev = self._staged[layer - 1] if layer > 0 else self._staged[-1]
        if prev is not None or self._staged[layer] is not None:
            self._staged = [None] * self.n_layers
            raise RuntimeError(
                "KvgcCache: a layer's new K/V rows were never attended. KvgcCache.update() "
                "returns only the new rows, so the model must run attn_implementation='kvgc' "
                "(kvgc.transformers.use_kvgc(model), or from_pretrained(..., "
                "attn_implementation='kvgc')); or an earlier forward failed between update "
                "and attention (reset() the cache)")
        if k.dim() != 4 or k.shape[1] != self.n_kv_heads or k.shape[3] != self.head_dim:
            raise ValueError(f"layer {layer}: key_states of shape {tuple(k.shape)}, expected "
                             f"[batch, {self.n_kv_heads}, q_len, {self.head_dim}]")
        self._staged[layer] = (k, v)
        self._lengths[layer] += k.shape[2]
        k._kvgc = (self, layer)  # lets kvgc_attention_forward find the cache
        return k, v

    def _ensure_heap(self, b, dtype, device):
        if self.kv_dtype is None:
            if dtype not in _KV_DTYPES:
                raise ValueError(f"the model's K/V are {dtype}; pass kv_dtype= one of "
                                 "torch.float16, torch.bfloat16, torch.float32")
            self.kv_dtype = dtype
        if torch.device(device).type != self.device:
            raise ValueError(f"the model runs on {device} but KvgcCache(device="
                             f"{self.device!r}); construct it with device={device.type!r}")
        if self.heap is None:
            opts = dict(self.heap_options)
            if opts.get("budget") is None and opts.get("budget_bytes") is None \
                    and opts.get("budget_fraction") is None:
                per_seq = kvgc.kv_bytes(self.n_layers, self.n_kv_heads, self.head_dim,
                                        _KV_DTYPES[self.kv_dtype], self.max_tokens, "fp16",
                                        page_tokens=opts.get("page_tokens") or 16)
                # +1 sequence: a checkpoint; +1/8: partly filled pages; +32 MiB: a few
                # slabs per storage class (the arena is reserved, not touched).
                opts["budget_bytes"] = int(per_seq * (b + 1) * 9 // 8) + (32 << 20)
            self.heap = kvgc.Heap(self.n_layers, self.n_q_heads, self.n_kv_heads,
                                  self.head_dim, _KV_DTYPES[self.kv_dtype], device=self.device,
                                  **opts)
        if not self._seqs:
            self._seqs = [self.heap.new_sequence() for _ in range(b)]
        elif len(self._seqs) != b:
            raise ValueError(f"KvgcCache holds {len(self._seqs)} sequences but this forward has "
                             f"a batch of {b}; use one cache per batch (or reset() it)")

    def _plan_forward(self, query, mask):
        b, _, q_len, _ = query.shape
        self._ensure_heap(b, query.dtype, query.device)
        real = [q_len] * b
        if mask is not None:
            real = _real_rows(mask, b, q_len)
        stream = torch.cuda.current_stream() if self.device == "cuda" else None
        decode = q_len == 1
        batched = decode and b > 1
        if batched:
            if self._batch is None:
                self._batch = self.heap.batch()
            self._batch.plan(self._seqs, real, stream=stream)
        return _Forward(b, q_len, real, decode, batched, stream)

    def _rows(self, t, dtype):
        """[b, heads, q, d] -> [b, q, heads, d] contiguous in `dtype`, detached. A view when
        the model's layout already is that (RoPE output, projections), else one copy."""
        t = t.detach().transpose(1, 2)
        if t.dtype != dtype:
            t = t.to(dtype)
        return t.contiguous()

    def _hand(self, kind, layer, t, src):
        # Test hook: what kvgc will read (and whether it is the model's own memory).
        if self._trace is not None:
            self._trace.append((kind, layer, t.data_ptr(), kvgc._kvgc.data_pointer(t),
                                src.data_ptr()))
        return t

    def _attend(self, layer, query, mask, scaling):
        staged = self._staged[layer]
        if staged is None:
            raise RuntimeError(f"kvgc attention at layer {layer} without KvgcCache.update()")
        self._staged[layer] = None
        k, v = staged
        try:
            if layer == 0 or self._fwd is None:
                self._fwd = self._plan_forward(query, mask)
            return self._attend_layer(layer, k, v, query, scaling)
        except BaseException as e:
            # A failed forward leaves nothing half-staged for the next one to trip on.
            self._staged, self._fwd = [None] * self.n_layers, None
            if isinstance(e, kvgc.OutOfMemory) and hasattr(e, "add_note"):
                e.add_note(f"KvgcCache: the default arena holds max_tokens={self.max_tokens} "
                           "tokens per sequence; pass a larger max_tokens= or budget= (bytes), "
                           "then reset() this cache")
            raise

    def _attend_layer(self, layer, k, v, query, scaling):
        f = self._fwd
        dt = self.kv_dtype
        scale = float(scaling) if scaling else 0.0
        kr, vr, qr = self._rows(k, dt), self._rows(v, dt), self._rows(query, dt)
        b, q_len, n_q = f.b, f.q_len, self.n_q_heads
        out = torch.empty((b, q_len, n_q, self.head_dim), dtype=dt, device=query.device)
        if f.decode:
            self._attend_decode(layer, f, kr, vr, qr, out, scale, k, query)
        else:
            self._attend_prefill(layer, f, kr, vr, qr, out, scale, k, query)
        if layer == self.n_layers - 1:
            self._finish(f)
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def _attend_decode(self, layer, f, kr, vr, qr, out, scale, k, query):
        s = f.stream
        kr, vr, qr = kr.view(f.b, *kr.shape[2:]), vr.view(f.b, *vr.shape[2:]), \
            qr.view(f.b, *qr.shape[2:])
        o = out.view(f.b, *out.shape[2:])
        if not f.all_real:  # a row whose new token is padding: keep it out of kvgc
            idx = torch.tensor([i for i, r in enumerate(f.real) if r], device=kr.device)
            kr, vr, qr = kr[idx], vr[idx], qr[idx]
            o.zero_()
            o_real = torch.empty_like(qr)
        else:
            o_real = o
        self._hand("k", layer, kr, k)
        self._hand("q", layer, qr, query)
        if f.batched:
            self._batch.append(layer, kr, vr, stream=s)
            self._batch.attend(layer, qr, o_real, scale=scale, stream=s)
        elif f.real[0]:
            self.heap.append(self._seqs[0], layer, kr, vr, stream=s)
            self.heap.attend(self._seqs[0], layer, qr, o_real, scale=scale, stream=s)
        if not f.all_real and len(qr):
            o[idx] = o_real

    def _attend_prefill(self, layer, f, kr, vr, qr, out, scale, k, query):
        # Per sequence; left padding is skipped (its output rows are zeros).
        s, heap = f.stream, self.heap
        if not f.all_real:
            out.zero_()
        observe = self.prefill == "observe"
        for i, seq in enumerate(self._seqs):
            r = f.real[i]
            if r == 0:
                continue
            lo = f.q_len - r
            ki, vi, qi, oi = kr[i, lo:], vr[i, lo:], qr[i, lo:], out[i, lo:]
            self._hand("k", layer, ki, k)
            split = r - self.observe_tokens if observe and r > self.observe_tokens else 0
            if split and self.prefill_attention == "sdpa":
                # The unscored queries through SDPA: over the chunk's own rows, causally, in
                # an empty sequence (a first prompt); else also over every live cached row (a
                # dense copy, int8/int4 dequantised: what kvgc's kernel would attend).
                # kvgc gets every row and attends (and scores) the tail.
                if heap.tokens(seq, layer)[1] == 0:
                    oi[:split] = _causal_sdpa(qi[:split], ki[:split], vi[:split], scale)
                else:
                    old_k, old_v, _ = heap.read(seq, layer, stream=s, like=ki)
                    oi[:split] = _chunk_sdpa(qi[:split], ki[:split], vi[:split], old_k, old_v,
                                             scale)
                heap.append(seq, layer, ki, vi, stream=s)
                heap.attend(seq, layer, qi[split:], oi[split:], scale=scale, stream=s)
                continue
            if split:
                # kvgc's queries are the segment's LAST n_q appended tokens: append the
                # unscored part, attend it, then the scored tail.
                heap.append(seq, layer, ki[:split], vi[:split], stream=s)
                heap.attend(seq, layer, qi[:split], oi[:split], scale=scale, scores=False,
                            stream=s)
            heap.append(seq, layer, ki[split:], vi[split:], stream=s)
            heap.attend(seq, layer, qi[split:], oi[split:], scale=scale, stream=s)

    def _finish(self, f):
        """After the last layer: the GC step(s) of this forward."""
        self._fwd = None
        if f.batched:
            self._batch.step(stream=f.stream)
            return
        observe = not f.decode and self.prefill == "observe"
        for i, seq in enumerate(self._seqs):
            if observe and self.key_prior > 0 and f.real[i] > 1:
                self._add_key_prior(seq, f.real[i])
            if observe and self.pool_radius > 0 and f.real[i] > 1:
                self._pool(seq)
            self.heap.step(seq, stream=f.stream)
        if not f.decode and self.auto_checkpoint and self._checkpoint is None:
            self.checkpoint()

    def _add_key_prior(self, seq, new):
        """key_prior: the diversity of this forward's `new` keys, added to their scores."""
        heap = self.heap
        # What the scored queries paid: each query head's probabilities sum to 1.
        mass = min(new, self.observe_tokens) * self.n_q_heads
        for layer in range(self.n_layers):
            live, length = heap.tokens(seq, layer)
            if live == 0:
                continue
            like = torch.empty(0, device=self.device)
            k, _, pos = heap.read(seq, layer, like=like)
            k, pos = torch.as_tensor(k), torch.as_tensor(pos)
            fresh = pos >= length - new
            if int(fresh.sum()) < 2:
                continue
            prior = torch.zeros(live, dtype=torch.float32, device=k.device)
            prior[fresh] = _key_diversity(k[fresh].float())
            total = float(prior.sum())
            if total > 0:
                prior *= self.key_prior * mass / total
                heap.observe(seq, layer, prior)

    def _pool(self, seq):
        heap = self.heap
        for layer in range(self.n_layers):
            n = heap.tokens(seq, layer)[0]
            if n < 2:
                continue
            scores = self._out_array((n,), np.float32, torch.float32)
            pos = self._out_array((n,), np.int32, torch.int32)
            heap.read_scores(seq, layer, scores_out=scores)
            heap.read(seq, layer, pos_out=pos)
            if torch.is_tensor(scores):
                delta = torch.from_numpy(_pool_delta(scores.cpu().numpy(), pos.cpu().numpy(),
                                                     self.pool_radius)).to(self.device)
            else:
                delta = _pool_delta(scores, pos, self.pool_radius)
            heap.observe(seq, layer, delta)


def _key_diversity(k):
    """[n, heads, dim] keys -> [n]: 1 - cosine to the mean of the normalised keys, per head,
    summed over heads: KeyDiff's signal (kvpress's KeyDiffPress keeps the keys least like
    the rest)."""
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    anchor = unit.mean(dim=0, keepdim=True)
    anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return (1.0 - (unit * anchor).sum(dim=-1)).sum(dim=-1)


def _check_full_attention(cfg):
    types = getattr(cfg, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        raise kvgc.Unsupported(f"KvgcCache needs full attention in every layer; this model "
                               f"has layer types {sorted(set(types))}")
    if types is None and getattr(cfg, "sliding_window", None) is not None:
        raise kvgc.Unsupported(
            f"the model uses a sliding window ({cfg.sliding_window}) that kvgc's attention does "
            "not apply; set config.sliding_window = None if contexts stay shorter than it")


def register():
    """Registers "kvgc" with transformers' AttentionInterface and AttentionMaskInterface
    (idempotent; importing this module already did). Returns the name, "kvgc"."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _hf_compat.profile()
    AttentionInterface.register(ATTN_NAME, kvgc_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, kvgc_mask)
    return ATTN_NAME


def use_kvgc(model):
    """Switches a loaded model to attn_implementation="kvgc" (registering it first)."""
    register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_NAME)
    else:
        model.config._attn_implementation = ATTN_NAME
    return model


register()
