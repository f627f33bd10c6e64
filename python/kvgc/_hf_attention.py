"""The "kvgc" attention and mask functions for transformers, and their helpers.

Part of kvgc.transformers (see its docstring); split out to keep files short. The
attention finds its KvgcCache through the tag KvgcCache.update() puts on the key rows.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

import kvgc

_log = logging.getLogger("kvgc.transformers")


def _pool_delta(scores, pos, radius):
    """Per token, (max score within +-radius positions) - its score, in read order.

    kvgc-run's pool_scores (SnapKV clustering): the neighbours of what the question
    attends to (the other digits of a number) rank with it. Positions are unique per
    segment, so after sorting a neighbour within `radius` positions is within `radius`
    rows: `radius` vectorised shifts instead of a window scan.
    """
    order = np.argsort(pos, kind="stable")
    p = pos[order].astype(np.int64)
    s = scores[order].astype(np.float32)
    best = s.copy()
    for d in range(1, min(radius, len(s) - 1) + 1):
        near = (p[d:] - p[:-d]) <= radius
        best[:-d] = np.where(near, np.maximum(best[:-d], s[d:]), best[:-d])
        best[d:] = np.where(near, np.maximum(best[d:], s[:-d]), best[d:])
    delta = np.empty_like(s)
    delta[order] = best - s
    return delta


def _real_rows(mask, b, q_len):
    """Real (non-padding) rows of this forward's chunk per sequence, from a 2D padding mask
    or a 4D one (its last query row). Only left padding within the chunk is supported."""
    if mask.dim() == 4:
        last = mask[:, 0, -1, :]
        cols = last if last.dtype == torch.bool else last == 0
    else:
        cols = mask.bool()
    cols = cols[:, -q_len:]
    if cols.shape != (b, q_len):
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} does not cover a "
                         f"batch of {b} x {q_len} new tokens")
    if bool(cols.all()):
        return [q_len] * b
    real = cols.sum(1)
    want = torch.arange(q_len, device=cols.device)[None, :] >= (q_len - real)[:, None]
    if not torch.equal(cols, want):
        raise kvgc.Unsupported("KvgcCache supports left padding only (a sequence's padding "
                               "must precede its tokens in every forward)")
    return real.tolist()


_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _sdpa_gqa(group, k, v):
    """K and V [1, Hkv, n, d] for SDPA with `group` query heads a KV head, and its keyword:
    enable_gqa where torch has it (as transformers' SDPA path: no repeated K/V copy), else
    K and V repeated per query head."""
    if group > 1 and _SDPA_GQA:
        return k, v, {"enable_gqa": True}
    if group > 1:
        return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), {}
    return k, v, {}


def _causal_sdpa(q, k, v, scale):
    """Causal attention of rows q [n, H, d] over k, v [n, Hkv, d] (GQA), as [n, H, d]."""
    group = q.shape[1] // k.shape[1]
    q = q.transpose(0, 1)[None]
    k, v, gqa = _sdpa_gqa(group, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           scale=scale or None, **gqa)
    return out[0].transpose(0, 1)


def _chunk_sdpa(q, k, v, old_k, old_v, scale, block=1024):
    """Attention of a chunk's rows q [n, H, d] over the rows cached before it, old_k/old_v
    [m, Hkv, d] (every one at an earlier position, in any order), and the chunk's own k, v
    [n, Hkv, d] causally, as [n, H, d]. SDPA with an explicit mask, `block` queries a call:
    a block's keys end at its last query, so the masked-out part computed is at most a
    block's triangle (is_causal cannot say "after m cached rows")."""
    n, m = q.shape[0], old_k.shape[0]
    group = q.shape[1] // k.shape[1]
    keys, values, gqa = _sdpa_gqa(group, torch.cat([old_k, k]).transpose(0, 1)[None],
                                  torch.cat([old_v, v]).transpose(0, 1)[None])
    qs = q.transpose(0, 1)[None]
    out = torch.empty_like(q)
    kpos = torch.arange(m + n, device=q.device)
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        mask = kpos[None, :m + hi] <= kpos[m + lo:m + hi, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            qs[:, :, lo:hi], keys[:, :, :m + hi], values[:, :, :m + hi], attn_mask=mask,
            scale=scale or None, **gqa)
        out[lo:hi] = o[0].transpose(0, 1)
    return out


_warned_fallback = False


def kvgc_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                           scaling=None, **kwargs):
    """transformers attention function "kvgc": kvgc's paged attention over a KvgcCache.

    query [b, n_heads, q_len, head_dim]; key/value are the rows KvgcCache.update returned.
    Returns (attn_output [b, q_len, n_heads, head_dim], None). Without a KvgcCache (no
    cache, or another Cache class) it runs transformers' SDPA attention instead.
    """
    tag = getattr(key, "_kvgc", None)
    if tag is None:
        return _sdpa_fallback(module, query, key, value, attention_mask, scaling, dropout,
                              **kwargs)
    if dropout:
        raise kvgc.Unsupported("kvgc attention has no dropout (inference only): model.eval()")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise kvgc.Unsupported("kvgc attention applies neither sliding windows nor softcapping")
    cache, layer = tag
    return cache._attend(layer, query, attention_mask, scaling), None


def _sdpa_fallback(module, query, key, value, mask, scaling, dropout, **kwargs):
    global _warned_fallback
    if not _warned_fallback and kwargs.get("use_cache", True) is not False:
        _log.info("attn_implementation='kvgc' without a KvgcCache: running SDPA attention")
        _warned_fallback = True
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    # "kvgc"'s mask function hands over the 2D padding mask (or None), so the causal part
    # is built here. SDPA's own is_causal (mask None) aligns queries top-left, which is
    # right only when q_len == kv_len; a chunk after cached tokens needs the explicit mask.
    if (mask is None and 1 < q_len != kv_len) or (mask is not None and mask.dim() == 2):
        qpos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
        kpos = torch.arange(kv_len, device=query.device)[None, :]
        causal = (kpos <= qpos)[None, None]
        if mask is None:
            mask = causal
        else:
            mask = causal & mask[:, -kv_len:].bool()[:, None, None, :]
            mask = mask | ~mask.any(-1, keepdim=True)  # fully padded rows: no NaN (ignored)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def kvgc_mask(batch_size, cache_position, kv_length, kv_offset=0, mask_function=None,
              attention_mask=None, **kwargs):
    """transformers mask function "kvgc": returns the 2D padding mask itself (or None).

    kvgc's attention is causal by position, so the only mask it needs is which tokens are
    padding; building a [b, 1, q, kv] mask every forward would be wasted work. A mask with
    extra conditions (an overlay other than causal) is built as SDPA's 4D mask instead.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if mask_function is not None and mask_function is not causal_mask_function:
        return sdpa_mask(batch_size=batch_size, cache_position=cache_position,
                         kv_length=kv_length, kv_offset=kv_offset, mask_function=mask_function,
                         attention_mask=attention_mask, **kwargs)
    return attention_mask
