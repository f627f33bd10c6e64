"""KvgcLayer: transformers' per-layer cache object for a KvgcCache, and DenseKV.

Part of kvgc.transformers (see its docstring); split out to keep files short.
"""

from __future__ import annotations

from transformers.cache_utils import CacheLayerMixin

import kvgc

from . import _hf_compat


def _dense_error(what="dense K/V"):
    return kvgc.Unsupported(
        f"KvgcCache keeps K/V only in kvgc pages: there is no {what} to read or assign. "
        "Use cache.read(layer, index) for a dense copy, cache.crop(length) after "
        "cache.checkpoint() to roll back, or DynamicCache where code needs dense tensors.")


class DenseKV:
    """What ``KvgcLayer.keys`` / ``.values`` return: a stand-in, not a tensor.

    kvpress's pipeline rolls a cache back between questions with
    ``layer.keys = layer.keys[:, :, :n]``; that exact idiom works (the assignment calls
    ``cache.crop(n)``, which restores the checkpoint at n). Any other use (shape, math,
    torch functions, conversion) raises kvgc.Unsupported: there is no dense copy.
    """

    __slots__ = ("_layer", "_length")

    def __init__(self, layer, length=None):
        self._layer, self._length = layer, length

    def __getitem__(self, idx):
        if (isinstance(idx, tuple) and len(idx) == 3 and
                all(isinstance(i, slice) for i in idx) and idx[0] == idx[1] == slice(None)
                and idx[2].start in (None, 0) and idx[2].step in (None, 1)
                and idx[2].stop is not None):
            return DenseKV(self._layer, int(idx[2].stop))
        raise _dense_error("dense K/V tensor")

    def __getattr__(self, name):
        raise _dense_error("dense K/V tensor")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise _dense_error("dense K/V tensor")

    def __repr__(self):
        return "<KvgcCache K/V: kept in kvgc pages, no dense tensor>"

    def _unsupported(self, *args, **kwargs):
        raise _dense_error("dense K/V tensor")

    __len__ = __iter__ = __array__ = __bool__ = __add__ = __mul__ = __float__ = _unsupported


class KvgcLayer(CacheLayerMixin):
    """One decoder layer's view of a KvgcCache (transformers' per-layer cache object).

    Holds no tensors: ``update`` stages the new rows on the owning cache, lengths are the
    cache's. ``keys``/``values`` are DenseKV stand-ins: using them as tensors raises
    kvgc.Unsupported; only kvpress's ``keys = keys[:, :, :n]`` roll-back works (crop).
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, cache, layer_idx):
        # CacheLayerMixin.__init__ would assign dense keys/values: deliberately not called.
        self._cache = cache
        self.layer_idx = layer_idx

    def __repr__(self):
        return f"KvgcLayer({self.layer_idx})"

    def _set_dense(self, value):
        if isinstance(value, DenseKV) and value._layer is self and value._length is not None:
            self._cache.crop(value._length)  # the first layer restores, the rest are no-ops
            return
        raise _dense_error("dense K/V tensor")

    keys = property(DenseKV, _set_dense, doc="DenseKV stand-in (no dense keys exist)")
    values = property(DenseKV, _set_dense, doc="DenseKV stand-in (no dense values exist)")

    @property
    def is_initialized(self):
        """True once this layer has been fed a token."""
        return self._cache._lengths[self.layer_idx] > 0

    def lazy_initialization(self, key_states):
        """Nothing to set up: the cache creates its heap at its first forward."""
        pass  # the heap is created by the cache at its first forward

    def update(self, key_states, value_states, cache_kwargs=None):
        """Stages the new K/V rows on the owning cache and returns them (only the new
        rows: the "kvgc" attention attends them over the heap)."""
        return self._cache._stage(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, cache_position):
        """The attention mask's (kv_length, kv_offset): this layer's positions fed plus the
        query's, and 0."""
        # 4.56/4.57 pass cache_position (a tensor), later releases a query length.
        return self._cache._lengths[self.layer_idx] + _hf_compat.query_length(cache_position), 0

    def get_seq_length(self):
        """The positions fed to this layer (evicted tokens included)."""
        return self._cache._lengths[self.layer_idx]

    def get_max_cache_shape(self):
        """-1: no fixed maximum length."""
        return -1

    def crop(self, max_length):
        """The owning cache's crop (KvgcCache.crop): every layer's, not this one's."""
        self._cache.crop(max_length)

    def reset(self):
        self._cache.reset()

    def offload(self):
        raise kvgc.Unsupported("KvgcCache does not offload layers: kvgc owns the pages")

    prefetch = offload

    def reorder_cache(self, beam_idx):
        self._cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats):
        """The owning cache's (KvgcCache.batch_repeat_interleave)."""
        self._cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices):
        """The owning cache's (KvgcCache.batch_select_indices)."""
        self._cache.batch_select_indices(indices)
