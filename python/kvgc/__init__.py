"""kvgc: a managed heap for LLM KV caches (paging, a generational GC, a storage ladder).

This package binds kvgc's C API (kvgc.h) and nothing below it. A heap holds one model's
K/V in pages; each sequence's tokens are ranked by the attention they receive (fused
into kvgc's own attention kernel), and the GC keeps the best at full precision, stores
the middle as int8/int4 and evicts the rest, under token or byte budgets.

    import numpy as np, kvgc
    heap = kvgc.Heap(n_layers=2, n_q_heads=8, n_kv_heads=2, head_dim=64, dtype="float32",
                     budget="64M", policy="generational", byte_budget=0.25)
    seq = heap.new_sequence()
    k = v = np.random.rand(100, 2, 64).astype(np.float32)
    heap.append(seq, 0, k, v)                     # [tokens, n_kv_heads, head_dim]
    out = heap.attend(seq, 0, np.random.rand(1, 8, 64).astype(np.float32))
    heap.step(seq)                                # GC, demotion, compaction
    print(heap.stats().used_bytes)

Arrays (numpy, torch, DLPack) cross without a copy and are checked first: dtype, shape,
C-contiguity and device; errors are kvgc.Error subclasses carrying kvgc_errmsg().

Prompt caching (0.7): heap.keep_prefix(seq, token_ids) right after a sequence appended a
prompt, then heap.attach_prefix(new_seq, token_ids) shares its pages with later requests
(no K/V copy) and returns how many tokens to skip; heap.fork() shares pages too.

Submodules: kvgc.transformers (a transformers Cache whose K/V live in kvgc pages, with
kvgc's attention as attn_implementation="kvgc") and kvgc.kvpress (kvgc inside kvpress's
pipeline and evaluation harness). Both need torch and transformers; this module needs
only numpy for its own arrays. kvgc.vllm is a vLLM platform plugin (KVGC_VLLM=1: vLLM's
KV cache in kvgc pages).
"""
from . import _kvgc
from ._enums import (DType, Demote, Device, Generation, Harvest, LayerBudget, Policy,
                     PrefixCharge, Status, StorageClass)
from ._errors import (BudgetExceeded, DeviceError, Error, InternalError, InvalidArgument,
                      NotFound, OutOfMemory, Unsupported, BY_STATUS as _BY_STATUS)
from ._heap import Batch, Heap, Stats, kv_bytes
from . import _options

_kvgc._set_error_types(dict(_BY_STATUS))

# help() and tracebacks name the public classes by where users import them from.
for _cls in (Heap, Batch, Stats, Error, InvalidArgument, OutOfMemory, BudgetExceeded, NotFound,
             DeviceError, Unsupported, InternalError, DType, Device, StorageClass, Policy,
             Demote, Harvest, PrefixCharge, Generation, LayerBudget, Status):
    _cls.__module__ = "kvgc"
del _cls

__version__ = _kvgc.version()
PAGE_LAYOUT_VERSION = _kvgc.PAGE_LAYOUT_VERSION
"""The page layout's version (KVGC_PAGE_LAYOUT_VERSION): Heap.page_layout() and
Batch.export() describe pages in it."""
STATS_VERSION = _kvgc.STATS_VERSION
"""The library's kvgc_stats version (KVGC_STATS_VERSION): which fields Stats has."""
OPTION_NAMES = _options.OPTION_NAMES
"""The keyword options Heap() accepts (see Heap), sorted."""


def version():
    """The C library's version string (kvgc_version()), e.g. "0.5.0"."""
    return _kvgc.version()


__all__ = ["Heap", "Batch", "Stats", "kv_bytes", "version", "OPTION_NAMES",
           "Error", "InvalidArgument", "OutOfMemory", "BudgetExceeded", "NotFound",
           "DeviceError", "Unsupported", "InternalError",
           "DType", "Device", "StorageClass", "Policy", "Demote", "Harvest", "PrefixCharge",
           "Generation", "LayerBudget", "Status", "PAGE_LAYOUT_VERSION", "STATS_VERSION"]
