"""The kvgc vLLM plugin's per-process state: one heap, the requests' sequences, one step.

vLLM's engine core runs the scheduler and (the plugin makes the executor "uni"; under
tensor parallelism vLLM's external launcher makes every rank such an engine) the worker
in one process, one after the other: schedule(), then the model's forward, then the
scheduler's update. So both sides share this object, with no lock:
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
from collections import OrderedDict
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


def _env_flag(name):
    raw = os.environ.get(name, "")
    if raw not in ("", "0", "1"):
        raise InvalidArgument(f"{name}={raw!r}: expected 0 or 1")
    return raw == "1"


@dataclass
class _Request:
    seq: int
    target: int          # tokens the request held when its sequence was created
    length: int = 0      # tokens appended or attached so far (vLLM's num_computed_tokens)
    request: object = None   # vLLM's Request (its token ids, for the prefix cache)
    kept: int = 0        # the cached prefix this request's prompt last kept (0: none)
    kept_tokens: int = 0     # ... and its tokens
    admitted: bool = False   # vLLM scheduled it (else it waits, holding only an attach)


@dataclass
class _Chunk:
    """A prompt chunk in a forward: rows [row, row + n) of sequence seq, which held `past`
    tokens before it; its last `tail` rows score (the prompt's end), the rest do not."""
    seq: int
    row: int
    n: int
    past: int
    tail: int


@dataclass
class _Forward:
    """One forward of the model: its decodes (one planned kvgc batch) and prompt chunks."""
    req_ids: list
    prompt_ends: list = field(default_factory=list)   # _Requests whose prompt ended here
    prompt_parts: list = field(default_factory=list)  # _Requests whose prompt goes on
    chunks: list = field(default_factory=list)
    batch_rows: object = None      # torch index of the decode rows (None: no decode)
    all_rows: bool = False         # every row is a decode row
    dummy: bool = False
    # Tensor parallelism: this rank's attention mass, observed once summed over the ranks.
    batch_mass: dict = field(default_factory=dict)   # layer -> [pages, page_tokens]
    tail_mass: list = field(default_factory=list)    # (seq, layer, mass in read order)


class PluginState:
    def __init__(self):
        self.heap = None
        self.batch = None
        self.runner = None
        self.requests: dict[str, _Request] = {}
        self.layer_of: dict[str, int] = {}      # vLLM layer name -> kvgc layer
        self.forward = None
        self.reserved = 0                       # fp16 pages promised by this schedule()
        self.free_pages = 0                     # fp16 pages free at schedule()'s start
        self.cached_pages = 0                   # of the rest, pages only cached prefixes hold
        self.promised = {}      # req_id -> fp16 pages a prompt in flight takes after this step
        self.headroom = 0       # fp16 pages kept for the running decodes (admission only)
        self.watermark = 0.0    # vLLM's scheduler watermark: a fraction of the arena kept free
        self.arena_pages = 0
        self.usage = 0.0                        # used / arena bytes at that point
        self.observe_tokens = _env_count("KVGC_VLLM_OBSERVE_TOKENS", OBSERVE_TOKENS_DEFAULT)
        self.pool_radius = _env_count("KVGC_VLLM_POOL_RADIUS", POOL_RADIUS_DEFAULT)
        self.prefix_caching = False  # vLLM's enable_prefix_caching, mapped to kvgc's
        self.block_size = 0          # vLLM's block size (its prefix hits are whole blocks)
        self.kept = OrderedDict()    # kvgc prefix handles this plugin kept, oldest first
        self.deferred = set()        # req_ids waiting this step for a prompt in flight
        self.prefix_hits = 0         # requests that attached a cached prefix
        self.prefix_waits = 0        # admissions deferred so (counted once a step each)
        self.prefix_tokens = 0       # tokens they attached
        self.tp = None          # vLLM's tensor-parallel group when it has several ranks
        self.check_ranks = False  # KVGC_VLLM_CHECK_RANKS=1: ranks compared after each step
        self.steps = 0          # forwards served
        self.sequences = 0      # kvgc sequences created (requests, and again after preemption)
        self.preemptions = 0    # running requests vLLM preempted (their sequences freed)

    # ---- the heap (worker side) --------------------------------------------------------
    def create_heap(self, layer_names, n_q_heads, n_kv_heads, head_dim, dtype, arena_bytes,
                    options, total_layers=None, tp_group=None):
        """The heap of this rank: its layers (a pipeline rank's range of the model's
        total_layers: first_layer, total_layers) and its KV heads (a tensor-parallel
        rank's share, with tp_group the ranks whose mass it sums before every GC)."""
        from . import Heap
        from vllm.model_executor.models.utils import extract_layer_index
        if self.heap is not None:   # a second initialize_kv_cache (profiling): start over
            self.close()
        order = sorted(layer_names, key=extract_layer_index)
        index = [extract_layer_index(n) for n in order]
        if index != list(range(index[0], index[0] + len(index))):
            raise NotImplementedError(f"kvgc's vLLM plugin: this rank's attention layers "
                                      f"{index} are not one contiguous range")
        if total_layers and (index[0] != 0 or len(order) != total_layers):
            options = dict(options, first_layer=index[0], total_layers=int(total_layers))
        self.layer_of = {name: i for i, name in enumerate(order)}
        self.heap = Heap(len(order), n_q_heads, n_kv_heads, head_dim, dtype,
                         device="cpu", budget_bytes=int(arena_bytes), **options)
        self.batch = self.heap.batch()
        self.tp = tp_group if tp_group is not None and tp_group.world_size > 1 else None
        self.check_ranks = _env_flag("KVGC_VLLM_CHECK_RANKS")
        o = self.heap.options
        self.page_tokens = int(o["page_tokens"])
        _log.info("kvgc: heap of %d layers (from %d), %d KV heads x %d, %s, arena %.1f MiB, "
                  "policy %s, byte_budget %s, token_budget %s%s", len(order), index[0],
                  n_kv_heads, head_dim, self.heap._kv_name(), arena_bytes / 2**20,
                  o["policy"].name.lower(), o.get("byte_budget"), o.get("token_budget"),
                  f", tensor-parallel rank {self.tp.rank_in_group} of {self.tp.world_size}"
                  if self.tp else "")

    def close(self):
        if self.heap is not None:
            self.heap.close()
        self.heap = self.batch = None
        self.requests.clear()
        self.kept.clear()

    # ---- the scheduler's side ----------------------------------------------------------
    def new_schedule(self):
        """schedule() starts: what the heap holds now, nothing reserved yet; what the
        prompts in flight will still take, and the running decodes' headroom."""
        self.reserved = 0
        self.deferred.clear()
        if self.heap is None:
            self.free_pages = 0
            return
        self._read_free()
        admitted = [(req_id, r) for req_id, r in self.requests.items() if r.admitted]
        self.promised = {req_id: self.pages_for(r.target - r.length)
                         for req_id, r in admitted if r.length < r.target}
        self.headroom = (len(admitted) - len(self.promised)) * self.heap.n_layers

    def _read_free(self):
        """The fp16 pages a new token can take now: free ones in fp16 slabs and those of
        the slabs no class owns, less one slab's worth (an attach or a keep may take a
        slab for header pages after a request was admitted). Pages only cached prefixes
        hold are not counted: an attach can make them a sequence's again. room_for drops
        cached prefixes, oldest first, when it needs their pages."""
        s = self.heap.stats()
        self.usage = s.used_bytes / s.arena_bytes if s.arena_bytes else 0.0
        fp16 = s.classes["fp16"]
        per_slab = s.slab_bytes // fp16["page_bytes"]
        self.free_pages = fp16["pages_free"] + (s.slabs_free - 1) * per_slab
        self.cached_pages = s.cached_only_bytes // fp16["page_bytes"]
        self.arena_pages = s.arena_bytes // fp16["page_bytes"]

    def pages_for(self, n_tokens):
        """fp16 pages n_tokens more tokens of one sequence may take before its next GC:
        in every layer, plus one per layer for a partly filled page."""
        return (math.ceil(n_tokens / self.page_tokens) + 1) * self.heap.n_layers

    def room_for(self, n_tokens):
        """Whether the arena has room for n_tokens more of a running request, after what
        this schedule() reserved already."""
        return self._room(self.pages_for(n_tokens))

    def admits(self, request, n_tokens, whole_prompt, others_running):
        """Whether a waiting (or preempted) request may start with n_tokens: the pages of
        its whole prompt (vLLM's scheduler_reserve_full_isl; else of these tokens), on top
        of what the prompts in flight will still take, one page a layer for each running
        decode (a prompt's pages are all fp16 until its GC, and a burst of admissions
        would otherwise end in preemptions that recompute whole prompts), and vLLM's
        watermark when others run."""
        if not any(o.admitted for o in self.requests.values()):
            return self.room_for(n_tokens)  # alone: its chunks' room, as a running request
        r = self.requests.get(request.request_id)
        done = r.length if r is not None else 0          # attached from the prefix cache
        rest = max(n_tokens, int(request.num_tokens) - done) if whole_prompt else n_tokens
        need = self.pages_for(rest) + sum(self.promised.values()) + self.headroom
        if others_running:
            need += int(self.watermark * self.arena_pages)
        return self._room(need)

    def _room(self, need):
        if self.heap is None:
            raise RuntimeError("kvgc: the scheduler ran before the worker created the heap")
        if need > self.free_pages - self.reserved + self.cached_pages:
            return False          # dropping every cached prefix would not make room
        while need > self.free_pages - self.reserved and self.kept:
            self._drop_oldest_prefix()
        return need <= self.free_pages - self.reserved

    def _drop_oldest_prefix(self):
        from ._errors import NotFound
        handle, _ = self.kept.popitem(last=False)
        try:
            self.heap.drop_prefix(handle)
        except NotFound:      # kvgc evicted it for room already
            pass
        self._read_free()

    def commit(self, request, n_tokens):
        """vLLM gave request slots for n_tokens: promise their room, and give the request
        its sequence when it has none (its first schedule, or after a preemption)."""
        self.reserved += self.pages_for(n_tokens)
        req_id = request.request_id
        r = self.requests.get(req_id) or self._new_request(request)
        r.admitted = True
        rest = r.target - max(r.length, int(request.num_computed_tokens)) - n_tokens
        if rest > 0:        # a prompt chunk: the rest of the prompt stays promised
            self.promised[req_id] = self.pages_for(rest)
        else:
            self.promised.pop(req_id, None)

    def _new_request(self, request):
        seq = self.heap.new_sequence()
        self.sequences += 1
        r = _Request(seq=seq, target=int(request.num_tokens), request=request)
        self.requests[request.request_id] = r
        return r

    def attach(self, request, hit):
        """vLLM found `hit` tokens of request in its prefix cache (whole blocks): attaches
        kvgc's cached prefix of them to a new sequence for the request and returns the
        tokens both hold, whole blocks (vLLM recomputes the rest). kvgc's cache can hold
        less than vLLM's (a prompt still in its prefill, or a prefix evicted for room)."""
        r = self.requests.get(request.request_id)
        if r is not None:         # attached on an earlier try that found no room
            if r.length <= hit:
                return r.length   # vLLM computes from there
            self.release(request) # vLLM's own hit shrank (it evicted blocks): start over
        r = self._new_request(request)
        if hit <= 0:
            return 0
        from ._errors import Error
        ids = list(request.all_token_ids[:hit])
        salt = _salt(request)
        try:
            got = self.heap.attach_prefix(r.seq, ids, salt=salt)
            whole = got // self.block_size * self.block_size
            if whole != got:      # a partial block: attach exactly the whole blocks
                self.release(request)
                r = self._new_request(request)
                got = self.heap.attach_prefix(r.seq, ids[:whole], salt=salt) if whole else 0
                if got != whole:
                    raise RuntimeError(f"kvgc: attach_prefix gave {got} of {whole} tokens")
        except Error as e:        # no room for the header pages: compute the prompt
            _log.debug("kvgc: prefix attach failed (%s); computing the prompt", e)
            self.release(request)
            self._new_request(request)
            got = 0
        if got + self.block_size <= hit and self._computing(request, got + self.block_size):
            # vLLM counts blocks that a prompt in flight computes in this very step (its
            # blocks are cached when allocated); kvgc keeps them when that chunk is done.
            # Wait a step (allocate_slots refuses) rather than compute the prefix again.
            self.release(request)
            self.deferred.add(request.request_id)
            self.prefix_waits += 1
            return 0
        r = self.requests[request.request_id]
        r.length = got
        if got:
            self.prefix_hits += 1
            self.prefix_tokens += got
            self._read_free()     # the header pages took room
        return got

    def _computing(self, request, upto):
        """Whether a prompt in flight will compute request's first `upto` tokens."""
        ids = request.all_token_ids
        for req_id, r in self.requests.items():
            if (req_id != request.request_id and r.admitted and r.length < upto <= r.target
                    and r.request.all_token_ids[:upto] == ids[:upto]):
                return True
        return False

    def release(self, request, preempted=False):
        """vLLM freed the request's blocks (finished, aborted or preempted)."""
        self.preemptions += bool(preempted)
        r = self.requests.pop(request.request_id, None)
        if r is not None and self.heap is not None:
            self.heap.free_sequence(r.seq)

    # ---- the worker's side: one forward ------------------------------------------------
    def begin_forward(self, attn_metadata):
        """At the first layer: sorts this forward's requests into decodes (one kvgc batch,
        planned here) and prompt chunks (per sequence, in layer())."""
        qsl = attn_metadata.query_start_loc.tolist()
        num_reqs = len(qsl) - 1
        req_ids = list(self.runner.input_batch.req_ids[:num_reqs]) if self.runner else []
        if len(req_ids) != num_reqs or any(r not in self.requests for r in req_ids):
            # A dummy run (warm-up, profiling): no request of the scheduler's. kvgc holds
            # nothing for it; its outputs are zeros.
            self.forward = _Forward(req_ids=[], dummy=True)
            return
        fwd = _Forward(req_ids=req_ids)
        seqs, n_new, rows = [], [], []
        for i, req_id in enumerate(req_ids):
            r = self.requests[req_id]
            n = qsl[i + 1] - qsl[i]
            if r.length < r.target:  # a prompt (or a recomputed one) arriving in chunks
                last = r.length + n >= r.target
                fwd.chunks.append(_Chunk(seq=r.seq, row=qsl[i], n=n, past=r.length,
                                         tail=min(n, self.observe_tokens) if last else 0))
                (fwd.prompt_ends if last else fwd.prompt_parts).append(r)
            else:
                seqs.append(r.seq)
                n_new.append(n)
                rows.extend(range(qsl[i], qsl[i] + n))
            r.length += n
        if seqs:
            import torch
            self.batch.plan(seqs, n_new)
            fwd.batch_rows = torch.tensor(rows, dtype=torch.long)
            fwd.all_rows = len(rows) == qsl[-1]
        self.forward = fwd

    def layer(self, index, q, k, v, out, scale):
        """One layer of the forward: q [rows, heads, dim], k/v [rows, kv_heads, dim], out
        like q, rows in vLLM's order.

        Decodes go through the planned batch (scored). A prompt chunk is appended to its
        sequence; its unscored rows attend through torch's SDPA over the prompt so far (the
        chunk itself when it is the first; else the sequence's K/V read back: nothing was
        pruned yet, since a prompt's GC waits for its end), and its scored tail (the last
        KVGC_VLLM_OBSERVE_TOKENS rows of the prompt) through kvgc, adding its mass."""
        fwd = self.forward
        if fwd.batch_rows is not None:
            rows = None if fwd.all_rows else fwd.batch_rows
            if rows is None:
                self.batch.append(index, k, v)
            else:
                self.batch.append(index, k.index_select(0, rows), v.index_select(0, rows))
            mass = None
            if self.tp is not None:   # this rank's mass, summed over the ranks at the end
                import torch
                mass = fwd.batch_mass[index] = torch.empty(
                    (self.batch.pages(index), self.page_tokens), dtype=torch.float32)
            if rows is None:
                self.batch.attend(index, q, out, scale=scale, mass=mass)
            else:
                out.index_copy_(0, rows, self.batch.attend(index, q.index_select(0, rows),
                                                           scale=scale, mass=mass))
        for c in fwd.chunks:
            lo, hi = c.row, c.row + c.n
            self.heap.append(c.seq, index, k[lo:hi], v[lo:hi])
            m = c.n - c.tail
            if m > 0:
                out[lo:lo + m] = _sdpa(self.heap, c, index, q[lo:lo + m], k[lo:hi], v[lo:hi],
                                       scale)
            if c.tail > 0 and self.tp is not None:
                o, mass = _tail_with_mass(self.heap, c, index, q[lo + m:hi], scale)
                out[lo + m:hi] = o
                fwd.tail_mass.append((c.seq, index, mass))
            elif c.tail > 0:
                o = self.heap.attend(c.seq, index, q[lo + m:hi].contiguous(), scale=scale)
                out[lo + m:hi] = o

    def end_forward(self):
        """After the last layer: the decodes' GC; a prompt that ended here is kept (prefix
        caching), pooled (SnapKV's clustering) and then collected once, as kvgc-run does."""
        fwd, self.forward = self.forward, None
        if fwd is None or fwd.dummy:
            return
        if self.tp is not None:
            self._observe_summed(fwd)
        if fwd.batch_rows is not None:
            self.batch.step()
        if self.prefix_caching:
            for r in fwd.prompt_parts:
                self._keep(r, r.length)
        for r in fwd.prompt_ends:
            if self.prefix_caching:
                self._keep(r, r.target - 1)
            if self.pool_radius > 0:
                self._pool(r.seq)
            self.heap.step(r.seq)
        self.steps += 1
        if self.check_ranks and self.tp is not None:
            self._check_ranks()

    def _observe_summed(self, fwd):
        """Tensor parallelism: each rank attended its own KV heads, so its mass covers
        only its query heads. The ranks' arrays, gathered and summed in rank order (the
        same bits on every rank), are observed by every rank: their GCs then make the
        same decisions, and their heaps hold the same tokens at the same classes (vLLM's
        external launcher schedules every rank alike from its own heap)."""
        import torch
        parts = [fwd.batch_mass[i].reshape(-1) for i in sorted(fwd.batch_mass)]
        parts += [m for _, _, m in fwd.tail_mass]
        if not parts:
            return
        flat = torch.cat(parts)
        gathered = [torch.empty_like(flat) for _ in range(self.tp.world_size)]
        torch.distributed.all_gather(gathered, flat, group=self.tp.cpu_group)
        total = gathered[0].clone()
        for g in gathered[1:]:
            total += g
        at = 0
        for i in sorted(fwd.batch_mass):
            n = fwd.batch_mass[i].numel()
            self.batch.observe(i, total[at:at + n].reshape(fwd.batch_mass[i].shape))
            at += n
        for seq, layer, m in fwd.tail_mass:
            self.heap.observe(seq, layer, total[at:at + m.numel()])
            at += m.numel()

    def _check_ranks(self):
        """KVGC_VLLM_CHECK_RANKS=1 (tests): every tensor-parallel rank holds the same live
        positions, generations and scores, bit for bit, in every sequence and layer."""
        import hashlib
        import torch
        h = hashlib.blake2b(digest_size=8)
        for req_id in sorted(self.requests):
            seq = self.requests[req_id].seq
            for layer in range(self.heap.n_layers):
                _, _, pos = self.heap.read(seq, layer)
                scores, gen = self.heap.read_scores(seq, layer)
                for a in (pos, scores, gen, self.heap.read_classes(seq, layer)):
                    h.update(memoryview(_numpy(a)).cast("B"))
        mine = torch.tensor([int.from_bytes(h.digest(), "little", signed=True)])
        every = [torch.empty_like(mine) for _ in range(self.tp.world_size)]
        torch.distributed.all_gather(every, mine, group=self.tp.cpu_group)
        if any(int(e) != int(mine) for e in every):
            raise RuntimeError(f"kvgc: tensor-parallel ranks hold different tokens after "
                               f"forward {self.steps} (digests {[int(e) for e in every]})")

    def _keep(self, r, upto):
        """A prompt's first `upto` tokens are cached, before its first GC ranks them:
        keeps their whole blocks in kvgc's prefix cache, so that a later request vLLM
        finds them for attaches them (shared pages, each holder pruning its own view).
        Called as each chunk completes (a request admitted while the prompt is still in
        its prefill attaches what is done) and at the prompt's end (the last token is
        computed again by a request with the same prompt, as vLLM does). A longer keep of
        the same prompt replaces the shorter one: its pages match page by page."""
        n = upto // self.block_size * self.block_size
        if n <= 0 or (n <= r.kept_tokens and r.kept in self.kept):
            return            # no new whole block since the last keep, which still holds
        from ._errors import Error, NotFound
        try:
            handle = self.heap.keep_prefix(r.seq, list(r.request.all_token_ids[:n]),
                                           salt=_salt(r.request))
        except Error as e:    # no room for it: the prompt is simply not shared
            _log.debug("kvgc: keeping a prefix failed (%s)", e)
            return
        if r.kept and r.kept != handle and self.kept.pop(r.kept, None):
            try:
                self.heap.drop_prefix(r.kept)
            except NotFound:  # kvgc evicted it for room already
                pass
        r.kept, r.kept_tokens = handle, n
        self.kept[handle] = True
        self.kept.move_to_end(handle)

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


def _sdpa(heap, c, layer, q, k, v, scale):
    """Causal attention of a prompt chunk's first rows (q, at positions past..) over the
    prompt so far, through torch's SDPA (GQA: kv heads shared by groups of query heads)."""
    import torch
    import torch.nn.functional as F
    if c.past == 0:   # the chunk is the whole context: square causal
        m = q.shape[0]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k[:m].transpose(0, 1).unsqueeze(0),
            v[:m].transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
            enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
    kk, vv, pos = heap.read(c.seq, layer, like=q)
    qpos = torch.arange(c.past, c.past + q.shape[0], dtype=torch.int32)
    mask = pos.unsqueeze(0) <= qpos.unsqueeze(1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), kk.transpose(0, 1).unsqueeze(0),
        vv.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _tail_with_mass(heap, c, layer, q, scale):
    """A prompt's scored tail under tensor parallelism: its rows' attention over the
    sequence's cache (read back: nothing was pruned yet) through torch, with each token's
    mass (summed over this rank's query heads and the tail's rows) in kvgc_read order,
    as kvgc's fused attend would have added it; the caller sums it over the ranks."""
    import torch
    kk, vv, pos = heap.read(c.seq, layer, like=q)
    t, heads = q.shape[0], q.shape[1]
    group = heads // kk.shape[1]
    kf = kk.float().repeat_interleave(group, dim=1).transpose(0, 1)   # [heads, L, d]
    vf = vv.float().repeat_interleave(group, dim=1).transpose(0, 1)
    logits = torch.matmul(q.float().transpose(0, 1), kf.transpose(1, 2)) * scale
    qpos = torch.arange(c.past + c.n - t, c.past + c.n, dtype=pos.dtype)
    logits.masked_fill_((pos.unsqueeze(0) > qpos.unsqueeze(1)).unsqueeze(0), float("-inf"))
    p = torch.softmax(logits, dim=-1)                                   # [heads, t, L]
    out = torch.matmul(p, vf).transpose(0, 1).to(q.dtype)
    return out, p.sum(dim=(0, 1)).contiguous()


def _salt(request):
    """vLLM's cache_salt as kvgc's prefix salt: 0 (one tenant's prefixes) without one,
    else 64 bits of its BLAKE2b digest (never 0)."""
    salt = getattr(request, "cache_salt", None)
    if not salt:
        return 0
    import hashlib
    return int.from_bytes(hashlib.blake2b(str(salt).encode(), digest_size=8).digest(),
                          "little") or 1


def _numpy(a):
    return a.numpy() if hasattr(a, "numpy") and not hasattr(a, "__array_interface__") else a


_state = None


def get():
    """The process's plugin state (created on first use)."""
    global _state
    if _state is None:
        _state = PluginState()
    return _state
