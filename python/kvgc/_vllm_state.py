"""The kvgc vLLM plugin's per-process state: one heap, the requests' sequences, one step.

vLLM's engine core runs the scheduler and (the plugin makes the executor "uni") the
worker in one process, one after the other: schedule(), then the model's forward, then
the scheduler's update. So both sides share this object, with no lock:
  - the worker's model runner creates the heap over the KV memory vLLM would have given
    its own blocks (create_heap), and the attention backend plans, appends, attends and
    steps one kvgc batch per forward (begin_forward / end_forward);
  - the scheduler's KV cache manager creates a request's sequence when it first gets
    slots, admits by the heap's real bytes (room), and destroys the sequence when vLLM
    frees the request (finish, abort, preemption).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

from ._errors import InvalidArgument

_log = logging.getLogger("vllm.kvgc")  # under vLLM's handlers and levels

#: Queries of a prompt's last chunk that add attention mass (the observation window), as
#: KvgcCache's prefill="observe"; KVGC_VLLM_OBSERVE_TOKENS overrides.
OBSERVE_TOKENS_DEFAULT = 32
#: Max-pool radius over positions applied to a prompt's scores at its end (SnapKV).
POOL_RADIUS_DEFAULT = 5


def _env_count(name, default, minimum=0):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise InvalidArgument(f"{name}={raw!r}: expected an integer >= {minimum}")
    return value


@dataclass
class _Request:
    seq: int
    target: int          # tokens the request held when its sequence was created
    length: int = 0      # tokens appended so far (vLLM's num_computed_tokens)


@dataclass
class _Forward:
    """One forward of the model: the planned batch's requests, in vLLM's row order."""
    req_ids: list
    prompt_ends: list = field(default_factory=list)   # sequences whose prompt ended here
    dummy: bool = False


class PluginState:
    def __init__(self):
        self.heap = None
        self.batch = None
        self.runner = None
        self.requests: dict[str, _Request] = {}
        self.layer_of: dict[str, int] = {}      # vLLM layer name -> kvgc layer
        self.forward = None
        self.reserved = 0                       # bytes promised by this schedule()
        self.free_bytes = 0                     # arena bytes free at schedule()'s start
        self.observe_tokens = _env_count("KVGC_VLLM_OBSERVE_TOKENS", OBSERVE_TOKENS_DEFAULT)
        self.pool_radius = _env_count("KVGC_VLLM_POOL_RADIUS", POOL_RADIUS_DEFAULT)
        self.steps = 0          # forwards served
        self.sequences = 0      # kvgc sequences created (requests, and again after preemption)
        self.preemptions = 0    # running requests vLLM preempted (their sequences freed)

    # ---- the heap (worker side) --------------------------------------------------------
    def create_heap(self, layer_names, n_q_heads, n_kv_heads, head_dim, dtype, arena_bytes,
                    options):
        from . import Heap
        from vllm.model_executor.models.utils import extract_layer_index
        if self.heap is not None:   # a second initialize_kv_cache (profiling): start over
            self.close()
        order = sorted(layer_names, key=extract_layer_index)
        self.layer_of = {name: i for i, name in enumerate(order)}
        self.heap = Heap(len(order), n_q_heads, n_kv_heads, head_dim, dtype,
                         device="cpu", budget_bytes=int(arena_bytes), **options)
        self.batch = self.heap.batch()
        o = self.heap.options
        self.page_tokens = int(o["page_tokens"])
        self.page_bytes_all_layers = _kv_bytes(self.heap, self.page_tokens)
        _log.info("kvgc: heap of %d layers, %d KV heads x %d, %s, arena %.1f MiB, "
                  "policy %s, byte_budget %s, token_budget %s", len(order), n_kv_heads,
                  head_dim, self.heap._kv_name(), arena_bytes / 2**20,
                  o["policy"].name.lower(), o.get("byte_budget"), o.get("token_budget"))

    def close(self):
        if self.heap is not None:
            self.heap.close()
        self.heap = self.batch = None
        self.requests.clear()

    # ---- the scheduler's side ----------------------------------------------------------
    def new_schedule(self):
        """schedule() starts: what the heap holds now, nothing promised yet."""
        self.reserved = 0
        if self.heap is None:
            self.free_bytes = 0
            return
        s = self.heap.stats()
        self.free_bytes = max(0, s.arena_bytes - s.used_bytes)

    def bytes_for(self, n_tokens):
        """Arena bytes n_tokens more tokens of one sequence may take before its next GC:
        whole fp16 pages in every layer, plus one page for a partly filled one."""
        pages = math.ceil(n_tokens / self.page_tokens) + 1
        return pages * self.page_bytes_all_layers

    def room_for(self, n_tokens):
        """Whether the arena has room for n_tokens more of one sequence, after what this
        schedule() promised already."""
        if self.heap is None:
            raise RuntimeError("kvgc: the scheduler ran before the worker created the heap")
        return self.bytes_for(n_tokens) <= self.free_bytes - self.reserved

    def commit(self, request, n_tokens):
        """vLLM gave request slots for n_tokens: promise their room, and give the request
        its sequence when it has none (its first schedule, or after a preemption)."""
        self.reserved += self.bytes_for(n_tokens)
        req_id = request.request_id
        if req_id not in self.requests:
            seq = self.heap.new_sequence()
            self.sequences += 1
            self.requests[req_id] = _Request(seq=seq, target=int(request.num_tokens))

    def release(self, request, preempted=False):
        """vLLM freed the request's blocks (finished, aborted or preempted)."""
        self.preemptions += bool(preempted)
        r = self.requests.pop(request.request_id, None)
        if r is not None and self.heap is not None:
            self.heap.free_sequence(r.seq)

    # ---- the worker's side: one forward ------------------------------------------------
    def begin_forward(self, attn_metadata):
        """At the first layer: plans the batch of this forward's requests."""
        qsl = attn_metadata.query_start_loc.tolist()
        num_reqs = len(qsl) - 1
        req_ids = list(self.runner.input_batch.req_ids[:num_reqs]) if self.runner else []
        if len(req_ids) != num_reqs or any(r not in self.requests for r in req_ids):
            # A dummy run (warm-up, profiling): no request of the scheduler's. kvgc holds
            # nothing for it; its outputs are zeros.
            self.forward = _Forward(req_ids=[], dummy=True)
            return
        seqs, n_new, scored, defer = [], [], [], []
        fwd = _Forward(req_ids=req_ids)
        for i, req_id in enumerate(req_ids):
            r = self.requests[req_id]
            n = qsl[i + 1] - qsl[i]
            seqs.append(r.seq)
            n_new.append(n)
            end = r.length + n
            if r.length < r.target:  # a prompt (or a recomputed one) arriving in chunks
                last = end >= r.target
                scored.append(min(n, self.observe_tokens) if last else 0)
                defer.append(True)
                if last:
                    fwd.prompt_ends.append(r.seq)
            else:
                scored.append(n)
                defer.append(False)
            r.length = end
        self.batch.plan(seqs, n_new, scored_rows=scored, defer_step=defer)
        self.forward = fwd

    def end_forward(self):
        """After the last layer: every sequence's GC; a prompt that ended here is pooled
        (SnapKV's clustering) and then collected once, as kvgc-run does."""
        fwd, self.forward = self.forward, None
        if fwd is None or fwd.dummy:
            return
        self.batch.step()
        for seq in fwd.prompt_ends:
            if self.pool_radius > 0:
                self._pool(seq)
            self.heap.step(seq)
        self.steps += 1

    def _pool(self, seq):
        import numpy as np
        from ._hf_attention import _pool_delta
        heap = self.heap
        for layer in range(heap.n_layers):
            n = heap.tokens(seq, layer)[0]
            if n < 2:
                continue
            scores, _ = heap.read_scores(seq, layer)
            _, _, pos = heap.read(seq, layer)
            scores, pos = _numpy(scores), _numpy(pos)
            heap.observe(seq, layer, np.ascontiguousarray(
                _pool_delta(scores, pos, self.pool_radius), dtype=np.float32))


def _numpy(a):
    return a.numpy() if hasattr(a, "numpy") and not hasattr(a, "__array_interface__") else a


def _kv_bytes(heap, tokens):
    from . import kv_bytes
    return kv_bytes(heap.n_layers, heap.n_kv_heads, heap.head_dim, heap.dtype, tokens,
                    "fp16", heap.options["page_tokens"])


_state = None


def get():
    """The process's plugin state (created on first use)."""
    global _state
    if _state is None:
        _state = PluginState()
    return _state
