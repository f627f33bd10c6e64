"""Heap and Batch: kvgc.h's heap, sequences and batches, with keyword options and arrays.

Arrays (numpy arrays, torch tensors, anything with DLPack) cross with no copy: they must
be C-contiguous, in the heap's dtype and on its device, or the call raises
InvalidArgument naming the array before anything reaches kvgc. K/V rows are
[tokens, n_kv_heads, head_dim]; queries and outputs [rows, n_q_heads, head_dim].
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

from ._enums import Device, DType, Policy, PrefixCharge, StorageClass, dtype_of
from ._errors import InvalidArgument
from ._options import heap_options
from . import _kvgc

__all__ = ["Heap", "Batch", "Stats", "kv_bytes"]

Array = Any   # a numpy array, a torch tensor, or any DLPack tensor
TokenIds = Union[Sequence[int], Array]  # a 1-D int32 host array, or a sequence of ints
Stream = Union[None, int, Any]  # None, a cudaStream_t as an int, or an object with .cuda_stream

_NO_SCORES = 0x1  # KVGC_ATTEND_NO_SCORES
_NUMPY_DTYPE = {DType.F16: "float16", DType.F32: "float32"}


def _stream(stream):
    """cudaStream_t as an int: None (the legacy default stream), an int, or an object with
    .cuda_stream (torch.cuda.Stream). nanobind does not pass __dlpack__ a stream, so the
    stream is always explicit."""
    if stream is None:
        return 0
    if isinstance(stream, int) and not isinstance(stream, bool) and stream >= 0:
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if isinstance(handle, int):
        return handle
    raise InvalidArgument(f"stream={stream!r}: expected None, an int (cudaStream_t) or an "
                          "object with .cuda_stream (torch.cuda.Stream)")


def _salt(salt):
    """A prefix's salt: an int in [0, 2**64); 0 means visible to the keeper's tenant only."""
    if isinstance(salt, bool) or not isinstance(salt, int) or not 0 <= salt < 1 << 64:
        raise InvalidArgument(f"salt={salt!r}: expected an int in [0, 2**64) (0: the tenant's "
                              "own prefixes)")
    return salt


def _is_torch(a):
    return type(a).__module__.startswith("torch")


def _empty_like(a, shape):
    """A C-contiguous output of `shape` with a's type, dtype and device."""
    if _is_torch(a):
        import torch
        return torch.empty(shape, dtype=a.dtype, device=a.device)
    import numpy
    return numpy.empty(shape, dtype=a.dtype)


class Stats:
    """A snapshot of kvgc_stats (KVGC_STATS_VERSION 8): every field as an attribute.

    The ones most users want: ``live_tokens``, ``used_bytes`` (bytes of pages in use, every
    class and the header pages), ``arena_bytes``, ``tokens_evicted``, ``tokens_demoted``,
    ``compactions``, ``fragmentation``; ``classes["fp16"|"int8"|"int4"]`` holds each storage
    class's pages.

    Shared pages and the prefix cache (version 4, 0.7): ``cls_header`` (the header pages:
    each holder's own metadata of a shared page; the same keys as a ``classes`` entry),
    ``shared_pages`` (pages held through header pages or cached prefixes), ``shared_bytes``
    (their bytes, each counted once, in ``classes`` too), ``shared_refs`` (header pages plus
    cached prefixes' references to them), ``prefixes`` and ``prefixes_pinned`` (cached
    prefixes now), ``prefix_lookups`` (attach_prefix calls), ``prefix_hits`` (those that
    attached a token), ``prefix_tokens_attached``, ``prefix_evictions`` (cached prefixes
    evicted for room), ``pages_shared`` (pages made shared by keep or fork), ``cow_copies``
    (shared partly filled pages copied on a first write); version 5 (0.7.1):
    ``cached_only_bytes`` (of ``shared_bytes``, the pages only cached prefixes hold: what
    evicting unpinned prefixes gives back, free for an engine's admission); version 6
    (0.10): ``classes["int2"]`` and ``tokens_demoted_to[3]``; version 7 (0.12):
    ``pages_migrated`` and ``slabs_evacuated`` (pages moved out of sparse slabs of one
    storage class, and the slabs so emptied, when the arena was short of another's pages);
    version 8 (0.13): ``pages_shrunk`` and ``bytes_shrunk`` (shared pages re-stored at a
    cheaper class under ``prefix_charge="shrink"``, and the arena bytes that gave back);
    version 9 (0.14): ``gcs_short_of_pages`` and ``demote_slots_short`` (collections whose
    demotions found no page in the arena or the tenant's quota, and the slots they lacked:
    at most that many tokens were evicted instead of demoted);
    version 10 (0.15): ``pages_unshared`` (shared pages taken back as its own by their last
    holder once the other holders were gone; their header pages went back to the pool).
    """

    def __init__(self, fields):
        self.__dict__.update(fields)
        self.device = Device(self.device)

    def as_dict(self):
        """The snapshot as a plain dict."""
        return dict(self.__dict__)

    def __repr__(self):
        return (f"kvgc.Stats(live_tokens={self.live_tokens}, used_bytes={self.used_bytes}, "
                f"arena_bytes={self.arena_bytes}, tokens_evicted={self.tokens_evicted}, "
                f"tokens_demoted={self.tokens_demoted}, compactions={self.compactions})")


class Heap(_kvgc.Heap):
    """One model's KV memory on one device: an arena, page pools, sequences and the GC.

    Heap(n_layers, n_q_heads, n_kv_heads, head_dim, dtype, *, device="cpu", **options)

    dtype: "float16", "bfloat16", "float32", a numpy or torch dtype, or kvgc.DType.
    device: "cpu", "cuda" or "auto" (KVGC_DEVICE).
    options, each the keyword form of a KVGC_* variable (None: the default):
        budget           arena: bytes (int, "512M"), or a fraction of free memory (0.5, "50%")
        policy           "generational" (default), "full", "streaming", "h2o", "random"
        token_budget     live tokens per segment: an int, or a fraction of the length (0.25, "25%")
        byte_budget      bytes per segment: an int, or a fraction of the full cache's (0.1, "10%")
        sinks, window, page_tokens, compact_threshold, score_noise, seed, recent_decay
        window_min       under a byte budget the young window is an eighth of the budget
                         in fp16 tokens, within window_min (8) .. window (32); window_min
                         >= window keeps it fixed
        min_length       sequences shorter than this many tokens (256) are never pruned:
                         no budget applies to them; 0 applies budgets from the first token
        demote           "off", "int4", "int8", "int8,int4" (the ladder, default)
        layer_budget     "uniform", "pyramid", "entropy" (with layer_weights=[...])
        harvest          "deferred" (default) or "immediate"
        prefix_charge    "shrink" (default), "cache" or "view": who pays for tokens
                         attached from the prefix cache (attach_prefix). "shrink": each
                         holder, as if it had appended them (its budgets count them, its
                         GC prunes them), but a shared token its ladder demotes is only
                         charged at its rung and read from the shared page, so a holder
                         holds only its own tokens, and a shared page every holder counts
                         at int8 or below (the ladder's first rung under fp16) is
                         re-stored at int8. "cache": kept whole in every holder's view,
                         never pruned there, held once (a prefix never pruned). "view":
                         as appending the prompt, a demoted shared token copied (for
                         equivalence tests). "prune" (0.8) is retired: it means "shrink".
        cpu_threads      int or "auto" (KVGC_THREADS)
        verbose          bool: print the effective configuration to stderr
        first_layer, total_layers   a pipeline rank's range of the model's layers
        budget_bytes, budget_fraction, cuda_device, slab_bytes: the raw C fields
        ignore_env       True: the KVGC_* environment is not read (it overrides otherwise)

    Prompt caching (the prefix cache, 0.7): keep_prefix() a prompt a sequence has just
    appended, attach_prefix() it to later sequences (shared pages, no K/V copy),
    pin_prefix(), drop_prefix().

    Use it as a context manager, or call close(); a closed heap raises InvalidArgument.
    """

    def __init__(self, n_layers: int, n_q_heads: int, n_kv_heads: int, head_dim: int,
                 dtype: Any, *, device: str = "cpu", **options: Any) -> None:
        kv_dtype = dtype_of(dtype)
        opts = heap_options(device=device, **options)
        super().__init__(_count("n_layers", n_layers), _count("n_q_heads", n_q_heads),
                         _count("n_kv_heads", n_kv_heads), _count("head_dim", head_dim),
                         int(kv_dtype), opts)
        self.dtype = kv_dtype
        self.n_layers, self.n_q_heads = n_layers, n_q_heads
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.device = "cuda" if self.options["device"] == Device.CUDA else "cpu"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        try:
            state = "closed" if self.closed else self.device
        except (TypeError, AttributeError):  # __init__ failed before the C heap existed
            return "kvgc.Heap(<not created>)"
        return (f"kvgc.Heap(n_layers={self.n_layers}, n_q_heads={self.n_q_heads}, "
                f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self._kv_name()}, {state})")

    @property
    def options(self) -> dict:
        """The effective options (defaults, then the keywords, then KVGC_*), as a dict."""
        o = self._options()
        o["device"] = Device(o["device"])
        o["policy"] = Policy(o["policy"])
        o["prefix_charge"] = PrefixCharge(o["prefix_charge"])
        return o

    def fork(self, seq: int, tenant: int = 0, stream: Stream = None) -> int:
        """A new sequence of `tenant` holding a copy of seq's whole cache and GC state; the
        two continue independently. Since 0.7 the copy shares seq's pages (no K/V byte is
        copied, stats().shared_pages counts them): each sequence gets a small header page
        per shared page, and the first to write into a shared partly filled page copies
        it. The shared pages stay charged to seq's tenant, the header pages to `tenant`.
        All or nothing: OutOfMemory, or BudgetExceeded past a tenant's quota."""
        return self._fork(seq, tenant, _stream(stream))

    # ---- the prefix cache (0.7) --------------------------------------------------------
    def keep_prefix(self, seq: int, token_ids: TokenIds, *, salt: int = 0, pin: bool = False,
                    stream: Stream = None) -> int:
        """Keeps seq's cache of a prompt as a cached prefix; returns its handle (an int).

        token_ids: the ids the engine appended (a 1-D int32 host array, or a sequence of
        ints): all of seq's tokens, or (0.7.1) its first whole pages (len(token_ids) a
        multiple of page_tokens below seq's length), e.g. the part of a prompt that other
        prompts share, so that the rest stays seq's own to prune. No step() may have
        ranked them yet: keep a prompt right after appending it (InvalidArgument
        otherwise). The kept pages become shared (no K/V byte is copied) and stay in the heap,
        indexed page by page by a chain of hashes of the ids; seq continues unchanged.

        Visibility: with salt=0 the prefix is found only by sequences of seq's tenant;
        with a salt, by any sequence passing the same salt, whatever its tenant (vLLM's
        cache_salt). Keeping ids already cached with the same visibility returns that
        prefix's handle (pin still applies) and changes nothing else.

        Room: when the arena is short, cached prefixes that are not pinned are evicted in
        least-recently-used order before anything raises OutOfMemory; pin=True (or
        pin_prefix) exempts this one. OutOfMemory when the header pages do not fit,
        BudgetExceeded past seq's tenant quota; either way nothing changed.
        """
        flags = _kvgc.PREFIX_PIN if pin else 0
        return self._prefix_keep(seq, token_ids, _salt(salt), flags, _stream(stream))

    def attach_prefix(self, seq: int, token_ids: TokenIds, *, salt: int = 0,
                      stream: Stream = None) -> int:
        """Attaches to seq the longest cached prefix of token_ids visible to seq's tenant
        and `salt` (see keep_prefix); returns the tokens attached (0: nothing matched, seq
        unchanged).

        seq must hold no token yet (InvalidArgument otherwise). A prefix matches by whole
        pages, plus a cached prefix's partly filled last page when all of its tokens match;
        attaching copies no K/V byte (it reads no page of a prefix that does not match).
        seq then holds what appending those tokens' K/V would have given it (positions,
        sinks, generations, no score); append token_ids[n:] yourself and go on as with
        any sequence (its first write into a shared partly filled page copies that page).
        Who pays for the attached tokens is the heap's prefix_charge option: "shrink"
        (the default) prunes them as seq's own tokens with no private copy of a demoted
        shared token, and pages every holder demoted are stored (and attached) at the
        ladder's first rung below fp16; "cache" keeps the attached whole pages whole in
        seq's view, never pruned by its GC nor counted by its budgets; "view" prunes them
        as seq's own tokens, copying a demoted one. Attaching
        makes the prefix the most recently used. OutOfMemory / BudgetExceeded (seq's
        tenant pays its header pages) change nothing.
        """
        return self._prefix_attach(seq, token_ids, _salt(salt), _stream(stream))

    def pin_prefix(self, prefix: int, pinned: bool = True) -> None:
        """Pins (or, pinned=False, unpins) a cached prefix: a pinned one is never evicted
        for room. NotFound for an unknown handle (never kept, dropped or evicted)."""
        self._prefix_pin(prefix, bool(pinned))

    def drop_prefix(self, prefix: int) -> None:
        """Drops a cached prefix now: the pages no sequence holds go back to the pool
        (sequences attached to it keep theirs). NotFound for an unknown handle."""
        self._prefix_drop(prefix)

    def append(self, seq: int, layer: int, k: Array, v: Array, stream: Stream = None) -> None:
        """Appends k and v ([n, n_kv_heads, head_dim]) to segment (seq, layer); all or
        nothing (OutOfMemory when the pages do not fit)."""
        self._append(seq, layer, k, v, _stream(stream))

    def attend(self, seq: int, layer: int, q: Array, out: Optional[Array] = None, *,
               scale: float = 0.0, scores: bool = True, stream: Stream = None) -> Array:
        """Attention of q ([n_q, n_q_heads, head_dim]) over the segment, fused with the GC's
        signal. The queries are the segment's last n_q appended tokens (query i is at
        position length - n_q + i; causal over live tokens). scores=False leaves the GC's
        scores alone. scale 0 means 1/sqrt(head_dim). Returns out (allocated like q when
        None)."""
        if out is None:
            out = _empty_like(q, tuple(q.shape))
        self._attend(seq, layer, q, out, scale, 0 if scores else _NO_SCORES, _stream(stream))
        return out

    def observe(self, seq: int, layer: int, mass: Array, stream: Stream = None) -> None:
        """Adds attention mass (float32 [live], in read order) to the tokens' scores, for
        engines that compute attention themselves."""
        self._observe(seq, layer, mass, _stream(stream))

    def step(self, seq: int, stream: Stream = None) -> bool:
        """The end of an engine step: GC, demotion and compaction as the policy says.
        Returns False when a budget could not be met because the protected tokens alone
        exceed it (KVGC_EBUDGET: advisory, nothing lost), else True."""
        return self._step(seq, _stream(stream)) == 0

    def live_tokens(self, seq: int, layer: int) -> int:
        """Live tokens of segment (seq, layer)."""
        return self.tokens(seq, layer)[0]

    def _outputs(self, n, like, specs):
        if like is not None and _is_torch(like):
            import torch
            dev = like.device
            tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                   "int32": torch.int32, "uint8": torch.uint8}
            return [torch.empty(s, dtype=tdt[d], device=dev) for s, d in specs]
        if self.device == "cuda" or self.dtype == DType.BF16:
            try:
                import torch
            except ImportError:
                raise InvalidArgument("reading this heap needs torch (a CUDA or bfloat16 heap): "
                                      "pass the outputs as torch tensors") from None
            dev = "cuda:%d" % self._options()["cuda_device"] if self.device == "cuda" else "cpu"
            tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                   "int32": torch.int32, "uint8": torch.uint8}
            return [torch.empty(s, dtype=tdt[d], device=dev) for s, d in specs]
        import numpy
        return [numpy.empty(s, dtype=d) for s, d in specs]

    def _kv_name(self):
        return {DType.F16: "float16", DType.BF16: "bfloat16", DType.F32: "float32"}[self.dtype]

    def read(self, seq: int, layer: int, k_out: Optional[Array] = None,
             v_out: Optional[Array] = None, pos_out: Optional[Array] = None, *,
             stream: Stream = None, like: Optional[Array] = None) -> Tuple[Array, Array, Array]:
        """The segment's live K/V ([live, n_kv_heads, head_dim]) and positions (int32), dense,
        in read order (int8/int4 tokens dequantised). Without outputs it allocates numpy
        arrays (CPU heaps; torch tensors for CUDA or bfloat16 heaps, or when `like` is a
        tensor). Returns (k, v, pos)."""
        if k_out is None and v_out is None and pos_out is None:
            n = self.live_tokens(seq, layer)
            shape = (n, self.n_kv_heads, self.head_dim)
            k_out, v_out, pos_out = self._outputs(
                n, like, [(shape, self._kv_name()), (shape, self._kv_name()), ((n,), "int32")])
        n = self._read(seq, layer, k_out, v_out, pos_out, _stream(stream))
        return tuple(None if a is None else a[:n] for a in (k_out, v_out, pos_out))

    def read_scores(self, seq: int, layer: int, scores_out: Optional[Array] = None,
                    gen_out: Optional[Array] = None, *, stream: Stream = None,
                    like: Optional[Array] = None) -> Tuple[Array, Array]:
        """Each live token's accumulated score (float32) and generation (uint8, kvgc.Generation),
        in read order. Returns (scores, generations)."""
        if scores_out is None and gen_out is None:
            n = self.live_tokens(seq, layer)
            scores_out, gen_out = self._outputs(n, like, [((n,), "float32"), ((n,), "uint8")])
        n = self._read_scores(seq, layer, scores_out, gen_out, _stream(stream))
        return tuple(None if a is None else a[:n] for a in (scores_out, gen_out))

    def read_classes(self, seq: int, layer: int, cls_out: Optional[Array] = None, *,
                     stream: Stream = None, like: Optional[Array] = None) -> Array:
        """Each live token's storage class (uint8, kvgc.StorageClass), in read order."""
        if cls_out is None:
            n = self.live_tokens(seq, layer)
            (cls_out,) = self._outputs(n, like, [((n,), "uint8")])
        n = self._read_classes(seq, layer, cls_out, _stream(stream))
        return cls_out[:n]

    def stats(self) -> Stats:
        """A kvgc.Stats snapshot (applies pending GC results first)."""
        return Stats(self._stats())

    def page_layout(self, cls: Union[str, StorageClass] = StorageClass.FP16) -> dict:
        """The documented page layout of a storage class (kvgc_page_layout) as a dict."""
        if isinstance(cls, str):
            try:
                cls = StorageClass[cls.upper()]
            except KeyError:
                raise InvalidArgument(f"cls={cls!r}: expected 'fp16', 'int8' or 'int4'") from None
        return self._page_layout(int(cls))

    def batch(self) -> Batch:
        """A kvgc.Batch over this heap: one plan per engine step, one call per layer."""
        return Batch(self)


class Batch(_kvgc.Batch):
    """Many sequences per call (kvgc.h's batch API): once per engine step

        batch.plan(seqs, n_new)                   # all or nothing
        for layer in range(n_layers):
            batch.append(layer, k, v)             # [sum n_new, n_kv_heads, head_dim]
            out = batch.attend(layer, q)          # [sum n_new, n_q_heads, head_dim]
        batch.step()                              # every sequence's GC

    Rows are in batch order. plan raises OutOfMemory or BudgetExceeded with
    .failed_index, the first sequence that did not fit (preempt it and plan again).
    A per-sequence call that changes a planned sequence's pages makes the plan stale
    (InvalidArgument). Close it, or let Heap.close() close it.
    """

    def __init__(self, heap: Heap) -> None:
        if not isinstance(heap, Heap):
            raise InvalidArgument(f"heap={heap!r}: expected a kvgc.Heap")
        super().__init__(heap)
        self.heap = heap

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def plan(self, seqs: Sequence[int], n_new: Sequence[int], stream: Stream = None, *,
             scored_rows: Optional[Sequence[int]] = None,
             defer_step: Optional[Sequence[bool]] = None) -> None:
        """Plans one engine step: n_new[i] new tokens for sequence seqs[i].

        scored_rows[i]: only the last scored_rows[i] of sequence i's rows add attention
        mass at attend() (the rest attend unscored); None: every row scores.
        defer_step[i]: step() does not collect sequence i (a prompt arriving in chunks
        SnapKV-style: cached whole, scored by its last rows, one GC at its end).
        Together they run an observe-style prefill inside the plan (kvgc_batch_plan_ex).
        """
        flags = [] if defer_step is None else \
            [_kvgc.BATCH_SEQ_DEFER_STEP if d else 0 for d in defer_step]
        scored = [] if scored_rows is None else [int(r) for r in scored_rows]
        self._plan([int(s) for s in seqs], [int(n) for n in n_new], scored, flags,
                   _stream(stream))

    def append(self, layer: int, k: Array, v: Array, stream: Stream = None) -> None:
        """Appends every planned sequence's new rows to `layer`: k and v [sum n_new,
        n_kv_heads, head_dim], batch order. Once per layer per plan."""
        self._append(layer, k, v, _stream(stream))

    def attend(self, layer: int, q: Array, out: Optional[Array] = None, *, scale: float = 0.0,
               scores: bool = True, mass: Optional[Array] = None,
               stream: Stream = None) -> Array:
        """Attention of every planned sequence's new rows over its cache at `layer`, fused
        with the GC's signal: q [sum n_new, n_q_heads, head_dim], batch order, each row a
        query as in Heap.attend. The layer must have been appended in this plan. Returns
        out (allocated like q when None).

        mass: a float32 array [pages(layer), page_tokens] on the heap's device; the scored
        rows' attention mass is written there, as observe() takes it, instead of added to
        the scores (tensor parallelism: sum the ranks' arrays, then observe() the sum on
        every rank). Not with scores=False."""
        if out is None:
            out = _empty_like(q, tuple(q.shape))
        self._attend(layer, q, out, scale, 0 if scores else _NO_SCORES, mass, _stream(stream))
        return out

    def pages(self, layer: int) -> int:
        """The pages of `layer` in this plan (export(layer)'s n_pages, without its
        arrays): the rows of the mass arrays attend() writes and observe() takes."""
        return self._pages(layer)

    def observe(self, layer: int, mass: Array, stream: Stream = None) -> None:
        """Mass per page slot, float32 [n_pages, page_tokens] of export(layer)'s pages."""
        self._observe(layer, mass, _stream(stream))

    def step(self, stream: Stream = None) -> bool:
        """Every planned sequence's step; False on KVGC_EBUDGET (advisory)."""
        return self._step(_stream(stream)) == 0

    def export(self, layer: int) -> dict:
        """The planned batch's page tables for `layer` (kvgc_batch_view) as a dict: numpy
        copies on the CPU, device addresses (ints) on CUDA; with heap.page_layout() an
        engine's own kernel reads the pages.

        Keys: n_seqs, n_pages, n_rows, page_tokens, arena_base, page_indptr, page_offset,
        page_class, q_indptr, q_pos0, kv_offset. Page layout version 2 (0.7): a page may
        be shared (fork, the prefix cache); its header (live bits, positions, scores,
        generations: the sequence's own view) is at arena_base + page_offset[p], its K, V
        and scales at arena_base + kv_offset[p] (read only). A private page has
        kv_offset[p] == page_offset[p]."""
        return self._export(layer)


def _count(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"{name}={value!r}: expected a positive int")
    return value


def kv_bytes(n_layers: int, n_kv_heads: int, head_dim: int, dtype: Any, tokens: int,
             cls: Union[str, StorageClass] = "fp16", page_tokens: int = 0) -> int:
    """KV bytes `tokens` tokens of one sequence take across all layers in storage class
    `cls`: with page_tokens=0 the raw K/V payload any engine stores; with page_tokens > 0
    what kvgc holds for them (whole pages with their slot metadata)."""
    if isinstance(cls, str):
        try:
            cls = StorageClass[cls.upper()]
        except KeyError:
            raise InvalidArgument(f"cls={cls!r}: expected 'fp16', 'int8' or 'int4'") from None
    return _kvgc.kv_bytes(_count("n_layers", n_layers), _count("n_kv_heads", n_kv_heads),
                          _count("head_dim", head_dim), int(dtype_of(dtype)), int(tokens),
                          int(cls), int(page_tokens))
