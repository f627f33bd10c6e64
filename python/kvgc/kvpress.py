"""kvgc.kvpress: kvgc inside NVIDIA kvpress's pipeline and evaluation harness, unmodified.

    from kvpress import KVPressTextGenerationPipeline  # registers "kv-press-text-generation"
    from kvgc.kvpress import KvgcPress
    press = KvgcPress(compression_ratio=0.9)            # hold 10% of the f16 cache's bytes
    pipe(context, question=q, press=press)              # the pipeline's own code path

Three presses, each usable wherever kvpress takes a press (``PRESS_REGISTRY``, the
pipeline's ``press=``):

* ``KvgcPress``: kvgc itself. Under it, the pipeline's cache IS a KvgcCache
  (kvgc.transformers): K/V live in kvgc pages, attention runs through kvgc's kernel, the
  GC ranks tokens by the mass that kernel accumulates and evicts/demotes to a byte budget.
  ``compression_ratio`` r (what evaluate.py sets) means byte_budget = 1 - r of the f16
  full cache (r = 0: no budget). kvgc's GC also keeps running while the answer decodes
  (that is what kvgc is); the presses compress the context once.
* ``KvgcMassPress``: ObservedAttentionPress's scoring (mean attention a token receives
  over the queries that can see it, averaged over query heads) computed by kvgc's own
  attention kernel instead of eager attention weights, then kvpress's top-k. Equal to
  ObservedAttentionPress when the model has one KV head (ObservedAttentionPress scores per
  KV head, kvgc per token over all heads); the reference check in
  python/tests/torch/test_kvpress.py holds the two to the same kept tokens and answers.
* ``QuantizedCachePress``: no eviction; makes the pipeline's cache HF's QuantizedCache
  (quanto/hqq int4/int2), the same way KvgcPress makes it a KvgcCache, so HF's quantized
  cache runs through the harness as a baseline at its byte share.

How the cache becomes a KvgcCache, and why this way. The pipeline creates
``cache = DynamicCache()`` itself, then runs the context prefill inside ``with press(model)``,
then decodes each question outside the press and rolls back with
``cache.layers[i].keys = cache.layers[i].keys[:, :, :n]``; evaluate.py never passes a
cache. A press only receives the model, so the one place it meets that cache is the
prefill forward. The press therefore (1) switches the model's attention to "kvgc" (which
falls back to SDPA for any other cache, so nothing else changes), and (2) adds a forward
pre-hook on the decoder that, on the prefill's still-empty DynamicCache, re-initialises
that very object as a KvgcCache (``__class__`` assignment + KvgcCache.__init__). It must
be that object and not a replacement passed down the forward: the pipeline keeps its
reference for the decode, ``get_seq_length`` and the roll-back. After the prefill the
press records the bytes kvgc holds, then ``checkpoint()``s the sequence (a kvgc fork):
the pipeline's roll-back idiom is KvgcCache's ``crop(n)``, which restores it. The
alternatives were worse: patching the pipeline or evaluate.py (not "unmodified"), a
persistent hook that shadows the DynamicCache (two caches, a roll-back that only sees the
empty one), or a DynamicCache subclass holding dense copies (then kvgc's attention and
GC would not be what runs).

Byte accounting: ``KvgcPress.last`` (and one JSON line per prefill appended to
$KVGC_KVPRESS_LOG when set) holds the context length, kvgc's held bytes after the
prefill's GC (heap.stats().used_bytes: whole pages incl. slot metadata, every class) and
their share of the raw f16 K/V of the context (kvgc.kv_bytes, page_tokens 0).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from kvpress.presses.base_press import BasePress
from kvpress.presses.scorer_press import ScorerPress
from transformers import DynamicCache

import kvgc
from . import transformers as kt

__all__ = ["KvgcPress", "KvgcMassPress", "QuantizedCachePress", "kvgc_mass"]


@contextmanager
def _adopt_pipeline_cache(model, convert):
    """Context: the first forward of ``model.model`` given an EMPTY DynamicCache has that
    object converted in place by ``convert(cache)`` (see the module docstring: the pipeline
    holds the reference, so it must be the same object)."""
    def pre_hook(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if type(cache) is DynamicCache and cache.get_seq_length() == 0:
            convert(cache)
        return None

    handle = model.model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class KvgcPress(BasePress):
    """kvgc as a kvpress press: the pipeline's cache becomes a KvgcCache (module docstring).

    Args:
        compression_ratio: r; kvgc holds at most 1 - r of the f16 full cache's bytes
            (byte_budget = 1 - r, a per-segment budget counting pages and slot metadata).
            0 = no byte budget (kvgc's policy with nothing to evict for).
        kv_dtype: the dtype kvgc stores K/V in (torch.float16: an f16 cache; the model may
            compute in float32).
        prefill: KvgcCache's prefill mode ("observe": the context's last observe_tokens
            queries score, pooled, one GC step; "stream": every query scores).
        prefill_attention: "sdpa" (default, as KvgcCache's) computes the unscored prefill
            queries with torch SDPA (exact; the rows still go to kvgc, the scored tail
            through kvgc's kernel), "kvgc" runs them all through kvgc's kernel.
        key_prior: KvgcCache's query-agnostic key-diversity prior (2.0 here, 0 in
            KvgcCache): the pipeline compresses the context before it reads the question,
            so the context's last queries ask nothing. With it, kvgc at 10% of the bytes
            answered 20/20 RULER niah_single_1 rows at 4K (KeyDiff 16/20), without it
            4/10 (docs/QUALITY.md, "A query-agnostic prior"). Pass 0 when the question
            is in the compressed context (query_aware): there the prior dilutes what the
            question attends to.
        heap_options: any other kvgc.Heap option (policy, demote, window, sinks, ...);
            absent ones are kvgc's defaults, but for min_length: 0 here, since a press's
            compression_ratio applies to every context, as kvpress's presses apply theirs
            (kvgc's default leaves sequences under 256 tokens whole).
    """

    # Not a dataclass (BasePress is one): heap options are free keywords, as for KvgcCache.
    def __init__(self, compression_ratio=0.0, *, kv_dtype=torch.float16, prefill="observe",
                 prefill_attention="sdpa", key_prior=2.0, **heap_options):
        self.compression_ratio = compression_ratio
        self.kv_dtype, self.prefill, self.prefill_attention = kv_dtype, prefill, prefill_attention
        self.key_prior = key_prior
        self.heap_options = dict(heap_options)
        self.heap_options.setdefault("min_length", 0)
        if "byte_budget" in self.heap_options:
            raise ValueError("KvgcPress: set compression_ratio (byte_budget = 1 - compression_ratio)")
        self.last = None
        self._cache = None

    def __repr__(self):  # evaluate.py saves str(press) as press_init_command
        opts = "".join(f", {k}={v!r}" for k, v in sorted(self.heap_options.items()))
        return (f"KvgcPress(compression_ratio={self.compression_ratio}, kv_dtype={self.kv_dtype}, "
                f"prefill={self.prefill!r}, prefill_attention={self.prefill_attention!r}, "
                f"key_prior={self.key_prior!r}{opts})")

    def cache_options(self):
        """KvgcCache keyword arguments for this press's compression_ratio."""
        if not 0 <= self.compression_ratio < 1:
            raise ValueError(f"compression_ratio={self.compression_ratio}: expected 0 <= r < 1")
        opts = dict(self.heap_options)
        if self.compression_ratio > 0:
            opts["byte_budget"] = 1.0 - self.compression_ratio
        return dict(kv_dtype=self.kv_dtype, prefill=self.prefill,
                    prefill_attention=self.prefill_attention, key_prior=self.key_prior, **opts)

    def _convert(self, model, cache):
        # The previous sample's cache is garbage to the pipeline by now: release its arena
        # at once rather than when the collector gets to it.
        if self._cache is not None and self._cache is not cache:
            self._cache.close()
        cache.__dict__.clear()
        cache.__class__ = kt.KvgcCache
        kt.KvgcCache.__init__(cache, model.config, **self.cache_options())
        self._cache = cache

    @contextmanager
    def __call__(self, model):
        """Prefill context: the model on kvgc attention (left on afterwards: the pipeline
        decodes from this KvgcCache outside the press; "kvgc" attention is SDPA for any
        other cache) and the pipeline's empty cache made a KvgcCache."""
        kt.use_kvgc(model)
        self._cache = self._cache if self._cache is not None and self._cache.heap is not None else None
        before = self._cache
        with _adopt_pipeline_cache(model, lambda c: self._convert(model, c)):
            yield
        cache = self._cache
        if cache is None or cache is before or cache.heap is None:
            return  # no prefill through the pipeline's cache happened here
        self._record(cache)
        cache.checkpoint()  # the pipeline's `keys = keys[:, :, :n]` roll-back restores this

    def _record(self, cache):
        n = cache.get_seq_length()
        held = cache.kv_bytes()
        f16 = kvgc.kv_bytes(cache.n_layers, cache.n_kv_heads, cache.head_dim, "float16", n, "fp16")
        live = cache.live_tokens(0)
        self.last = dict(context_tokens=n, held_bytes=held, f16_bytes=f16, share=held / f16,
                         live_tokens_layer0=live[0] if live else 0,
                         cell=f"kvgc:{self.compression_ratio:.2f}")
        path = os.environ.get("KVGC_KVPRESS_LOG")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(self.last) + "\n")


def kvgc_mass(keys, queries, scale):
    """Per-token attention mass from kvgc's kernel: every query attends causally (query i
    of n is position i) and the mass it gives is accumulated per token over all query heads.

    keys [n, n_kv_heads, d], queries [n, n_q_heads, d] (float32 CPU tensors, post-RoPE).
    Returns float32 [n] indexed by position. One scratch heap, policy "full": nothing is
    evicted, so the scores are the plain sums.
    """
    n, n_kv, d = keys.shape
    n_q = queries.shape[1]
    keys = keys.detach().to(torch.float32).contiguous()
    queries = queries.detach().to(torch.float32).contiguous()
    arena = 4 * kvgc.kv_bytes(1, n_kv, d, "float32", n, "fp16", page_tokens=16) + (32 << 20)
    with kvgc.Heap(1, n_q, n_kv, d, "float32", policy="full", budget_bytes=arena,
                   ignore_env=True) as heap:
        seq = heap.new_sequence()
        heap.append(seq, 0, keys, keys)  # V is irrelevant to the mass; K's rows stand in
        heap.attend(seq, 0, queries, scale=float(scale))
        scores, _ = heap.read_scores(seq, 0)
        _, _, pos = heap.read(seq, 0)
    out = torch.zeros(n, dtype=torch.float32)
    out[torch.as_tensor(pos, dtype=torch.long)] = torch.as_tensor(scores, dtype=torch.float32)
    return out


@dataclass
class KvgcMassPress(ScorerPress):
    """ObservedAttentionPress's score with kvgc's kernel as the source of the attention
    mass (no eager attention needed): score(token i) = mass_i / (n - i) / n_q_heads, the
    same for every KV head (kvgc accumulates per token, not per head)."""

    compression_ratio: float = 0.0

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        from kvpress.utils import get_prerope_query_states
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, n_kv, n, _ = keys.shape
        cos, sin = kwargs["position_embeddings"]
        q = get_prerope_query_states(module, hidden_states)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)  # the queries the attention used
        n_q = q.shape[1]
        if q.shape[2] != n:
            raise ValueError("KvgcMassPress scores a prefill into an empty cache only")
        out = torch.empty(b, n_kv, n, dtype=keys.dtype, device=keys.device)
        seen = torch.arange(n, 0, -1, dtype=torch.float32)  # queries that see token i
        for i in range(b):
            mass = kvgc_mass(keys[i].transpose(0, 1).cpu(), q[i].transpose(0, 1).cpu(), module.scaling)
            out[i] = (mass / seen / n_q).to(keys.dtype).to(keys.device)[None, :]
        return out


@dataclass
class QuantizedCachePress(BasePress):
    """No eviction: the pipeline's cache becomes HF's QuantizedCache(backend, nbits) (the
    same in-place adoption as KvgcPress), a baseline at its byte share. compression_ratio
    is accepted and ignored (evaluate.py sets it on every press)."""

    backend: str = "quanto"
    nbits: int = 4
    q_group_size: int = 64
    residual_length: int = 128
    compression_ratio: float = 0.0

    @contextmanager
    def __call__(self, model):
        from transformers import QuantizedCache

        def convert(cache):
            cache.__dict__.clear()
            cache.__class__ = QuantizedCache
            QuantizedCache.__init__(cache, backend=self.backend, config=model.config, nbits=self.nbits,
                                    q_group_size=self.q_group_size, residual_length=self.residual_length)

        with _adopt_pipeline_cache(model, convert):
            yield
