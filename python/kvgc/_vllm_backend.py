"""vLLM's attention backend with its K/V in kvgc pages (the CPU backend).

Every layer's forward appends the batch's new K/V to kvgc (one planned kvgc batch per
forward, in vLLM's row order) and attends through kvgc's kernel, whose per-token mass
feeds kvgc's GC. vLLM's own KV tensor is never read or written: the plugin's model
runner backs it with one block.
"""
from __future__ import annotations

import torch

from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend,
                                                 CPUAttentionBackendImpl)

from . import _vllm_state


class KvgcAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                 sliding_window, kv_cache_dtype, logits_soft_cap=None,
                 attn_type="decoder", kv_sharing_target_layer_name=None, sinks=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks)
        # What kvgc's kernel does not apply: refuse at start-up, never attend wrongly.
        unsupported = []
        if attn_type != "decoder":
            unsupported.append(f"attn_type={attn_type!r}")
        if alibi_slopes is not None:
            unsupported.append("ALiBi")
        if sliding_window is not None and sliding_window > 0:
            unsupported.append(f"sliding_window={sliding_window}")
        if logits_soft_cap:
            unsupported.append(f"logits_soft_cap={logits_soft_cap}")
        if sinks is not None:
            unsupported.append("learned attention sinks")
        if kv_sharing_target_layer_name is not None:
            unsupported.append("cross-layer KV sharing")
        if kv_cache_dtype not in ("auto", None):
            unsupported.append(f"kv_cache_dtype={kv_cache_dtype!r} (kvgc quantises itself)")
        if unsupported:
            raise NotImplementedError(
                "kvgc's vLLM attention backend does not support " + ", ".join(unsupported) +
                "; run this model without KVGC_VLLM=1")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvgc attention: fused output quantization")
        if attn_metadata is None:   # vLLM's warm-up
            return output
        state = _vllm_state.get()
        index = state.layer_of[layer.layer_name]
        if index == 0:
            state.begin_forward(attn_metadata)
        n = attn_metadata.num_actual_tokens
        fwd = state.forward
        if fwd is None or fwd.dummy:
            output[:n].zero_()
        else:
            q = query[:n].reshape(n, self.num_heads, self.head_size).contiguous()
            k = key[:n].contiguous()
            v = value[:n].contiguous()
            out = output[:n].view(n, self.num_heads, self.head_size)
            state.layer(index, q, k, v, out, self.scale)
        if index == len(state.layer_of) - 1:
            state.end_forward()
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        pass    # forward appends to kvgc; vLLM's KV tensor is not used


class KvgcAttentionBackend(CPUAttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_impl_cls():
        return KvgcAttentionImpl
