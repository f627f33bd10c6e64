"""vLLM's CPU worker and model runner for the kvgc plugin.

The model runner gives kvgc's heap the KV memory vLLM would have given its own blocks
(VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes): the heap's arena is that many bytes,
and vLLM's KV tensor is backed by a single block, never read or written (the attention
backend appends to kvgc instead). Block ids stay vLLM's bookkeeping only.
"""
from __future__ import annotations

import copy
import logging

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from . import _vllm_state
from ._vllm_platform import heap_keywords

_log = logging.getLogger("vllm.kvgc")  # under vLLM's handlers and levels


class KvgcModelRunner(CPUModelRunner):
    """CPUModelRunner whose KV memory is kvgc's arena (installed by KvgcWorker)."""

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes,
                                    kv_cache_allocation_context=None):
        state = _vllm_state.get()
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise NotImplementedError(
                f"kvgc's vLLM plugin runs models with one KV cache group (one attention "
                f"kind in every layer); this model has {len(groups)}")
        spec = groups[0].kv_cache_spec
        arena = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        n_q_heads = self.model_config.get_num_attention_heads(self.parallel_config)
        state.runner = self
        from vllm.distributed import get_tp_group
        state.create_heap(groups[0].layer_names, n_q_heads, spec.num_kv_heads,
                          spec.head_size, spec.dtype, arena,
                          heap_keywords(self.vllm_config),
                          total_layers=self.model_config.get_total_num_hidden_layers(),
                          tp_group=get_tp_group())
        block = self.cache_config.block_size
        if self.cache_config.enable_prefix_caching and block % state.page_tokens:
            raise ValueError(
                f"kvgc's vLLM plugin with prefix caching: vLLM's block size ({block}) must be "
                f"a multiple of kvgc's page (KVGC_PAGE_TOKENS={state.page_tokens})")
        return super().initialize_kv_cache_tensors(
            _one_block(kv_cache_config), kernel_block_sizes,
            kv_cache_allocation_context=kv_cache_allocation_context)

    def _zero_block_ids(self, block_ids):
        pass    # vLLM's blocks hold nothing: kvgc's pages are fresh per sequence


def _one_block(config):
    """config with one block per layer: the layer-outermost tensors vLLM's CPU backend
    lays out (layer_stride = page * num_blocks), shrunk to one page a layer."""
    small = copy.deepcopy(config)
    n = config.num_blocks
    for t in small.kv_cache_tensors:
        if t.layer_stride < t.block_stride * n or t.offset != 0:
            raise NotImplementedError(
                "kvgc's vLLM plugin expects vLLM's layer-outermost KV layout on the CPU "
                f"(layer_stride {t.layer_stride}, block_stride {t.block_stride}, "
                f"{n} blocks)")
        t.layer_stride = t.block_stride
        t.size = t.block_stride * len(t.layers)
    small.num_blocks = 1
    return small


class KvgcWorker(CPUWorker):
    """CPUWorker with KvgcModelRunner: set as worker_cls by the kvgc platform."""

    def init_device(self):
        super().init_device()
        if type(self.model_runner) is not CPUModelRunner:
            raise NotImplementedError(
                "kvgc's vLLM plugin runs vLLM's V1 CPU model runner; unset "
                "VLLM_USE_V2_MODEL_RUNNER")
        self.model_runner.__class__ = KvgcModelRunner
