"""vLLM's scheduler for the kvgc plugin: admission and preemption by kvgc's real bytes.

vLLM admits a request, and keeps a running one, only while allocate_slots finds blocks
for its new tokens. Here its block pool is virtual (enough blocks for max_num_seqs
requests at max_model_len, so it never binds first) and allocate_slots also asks kvgc's
arena for the pages those tokens take before their next GC. A waiting request is admitted
only when its whole prompt fits beside the prompts in flight and the running decodes'
headroom (state.admits). After a prompt's GC a request holds fewer pages, so more fit.
When a running request's decode finds no room, vLLM preempts one (recompute): free()
destroys its kvgc sequence and its pages return.
"""
from __future__ import annotations

import copy

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from . import _vllm_state


class KvgcKVCacheManager(KVCacheManager):
    """vLLM's KVCacheManager, with room and lifetime from kvgc (class set by KvgcScheduler)."""

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=None, num_lookahead_tokens=0, *args, **kwargs):
        state = _vllm_state.get()
        n = num_new_tokens + num_lookahead_tokens
        if request.request_id in state.deferred:
            return None       # waits a step for a prompt in flight to keep its blocks
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            room = state.admits(request, n, kwargs.get("full_sequence_must_fit", False),
                                kwargs.get("has_scheduled_reqs", True))
        else:
            room = state.room_for(n)
        if not room:
            return None
        blocks = super().allocate_slots(request, num_new_tokens, num_new_computed_tokens,
                                        new_computed_blocks, num_lookahead_tokens,
                                        *args, **kwargs)
        if blocks is not None:
            state.commit(request, n)
        return blocks

    def get_computed_blocks(self, request):
        """vLLM's prefix-cache hit, cut to what kvgc's prefix cache attaches (whole blocks):
        the request then skips computing exactly the tokens its sequence already holds."""
        blocks, hit, boundary = super().get_computed_blocks(request)
        state = _vllm_state.get()
        if not state.prefix_caching:
            return blocks, hit, boundary
        got = state.attach(request, hit)
        if got < hit:
            blocks = self.truncate_computed_blocks(blocks, got)
            boundary = 0
        return blocks, got, boundary

    def free(self, request):
        # A running request freed is a preemption (its status changes afterwards).
        _vllm_state.get().release(request, request.status == RequestStatus.RUNNING)
        super().free(request)

    @property
    def usage(self):
        # The arena's use as read at schedule()'s start: vLLM asks every step, and a
        # stats() snapshot costs milliseconds on the decode path.
        return _vllm_state.get().usage


class KvgcScheduler(Scheduler):
    """vLLM's Scheduler over a virtual block pool, admitting by kvgc's arena."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        virtual = copy.deepcopy(kv_cache_config)
        sched = vllm_config.scheduler_config
        block = vllm_config.cache_config.block_size
        per_request = -(-vllm_config.model_config.max_model_len // block)
        virtual.num_blocks = max(kv_cache_config.num_blocks,
                                 sched.max_num_seqs * per_request + 1)
        super().__init__(vllm_config, virtual, *args, **kwargs)
        self.kv_cache_manager.__class__ = KvgcKVCacheManager
        state = _vllm_state.get()
        state.prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        state.block_size = block
        state.watermark = float(getattr(sched, "watermark", 0.0) or 0.0)

    def schedule(self, *args, **kwargs):
        _vllm_state.get().new_schedule()
        return super().schedule(*args, **kwargs)
