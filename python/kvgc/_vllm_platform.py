"""The kvgc platform: vLLM's CPU platform with its KV cache in kvgc.

check_and_update_config wires the three pieces (attention backend, worker, scheduler),
makes the executor "uni" (the scheduler and the worker share the heap in one process;
tensor parallelism keeps vLLM's external launcher, a process per rank), and refuses what
the plugin cannot serve correctly, each with the reason.
"""
from __future__ import annotations

import logging
import os

from vllm.platforms.cpu import CpuPlatform

_log = logging.getLogger("vllm.kvgc")  # under vLLM's handlers and levels

BACKEND = "kvgc._vllm_backend.KvgcAttentionBackend"
WORKER = "kvgc._vllm_worker.KvgcWorker"
SCHEDULER = "kvgc._vllm_scheduler.KvgcScheduler"


def heap_keywords(vllm_config):
    """The plugin config: additional_config={"kvgc": {option: value}} (vllm serve
    --additional-config), kvgc.Heap's keyword options; KVGC_* override them."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    opts = extra.get("kvgc", {}) if isinstance(extra, dict) else {}
    if not isinstance(opts, dict):
        raise ValueError(f"additional_config['kvgc']={opts!r}: expected a dict of kvgc "
                         "options (e.g. {\"byte_budget\": \"10%\"})")
    for reserved in ("budget", "budget_bytes", "budget_fraction", "device"):
        if reserved in opts:
            raise ValueError(
                f"additional_config['kvgc'][{reserved!r}]: the arena is the KV memory vLLM "
                "gives its cache (VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes); set it "
                "there")
    for var in ("KVGC_BUDGET", "KVGC_DEVICE"):
        if os.environ.get(var):
            raise ValueError(
                f"{var}={os.environ[var]!r}: under the vLLM plugin the arena is the KV memory "
                "vLLM gives its cache (VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes) on "
                "vLLM's device; unset it")
    # Shared prompt pages, each request pruning its own view of them: kvgc's default
    # KVGC_PREFIX_CHARGE (shrink) since 0.15.
    return dict(opts)


def validate_options(vllm_config):
    """Builds a throwaway heap from the plugin config and KVGC_*: a bad value fails here,
    at start-up, with kvgc's message naming the option or variable."""
    from . import Heap, Error
    from . import _vllm_state
    try:
        _vllm_state._env_count("KVGC_VLLM_OBSERVE_TOKENS", 0)
        _vllm_state._env_count("KVGC_VLLM_POOL_RADIUS", 0)
        _vllm_state._env_flag("KVGC_VLLM_CHECK_RANKS")
        Heap(1, 1, 1, 16, "float32", device="cpu", budget_bytes=8 << 20,
             **heap_keywords(vllm_config)).close()
    except (Error, TypeError) as e:
        raise ValueError(f"kvgc's vLLM plugin: {e}") from None


class KvgcCpuPlatform(CpuPlatform):
    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError("kvgc's vLLM plugin does not serve MLA or sparse "
                                      "attention models; run without KVGC_VLLM=1")
        return BACKEND

    @classmethod
    def check_and_update_config(cls, vllm_config):
        super().check_and_update_config(vllm_config)
        if vllm_config.model_config is None:
            return
        par = vllm_config.parallel_config
        refuse = []
        launcher = par.distributed_executor_backend == "external_launcher"
        if par.tensor_parallel_size != 1 and not launcher:
            refuse.append(f"tensor_parallel_size={par.tensor_parallel_size} with the "
                          f"{par.distributed_executor_backend or 'mp'} executor (a rank's "
                          "scheduler admits by its own heap, in its own process: run the "
                          "ranks under torchrun with distributed_executor_backend="
                          "'external_launcher', offline)")
        if par.pipeline_parallel_size != 1:
            refuse.append(f"pipeline_parallel_size={par.pipeline_parallel_size} (each "
                          "rank's heap holds its layers, but the ranks' schedulers would "
                          "admit by different heaps; and vLLM's CPU runner does not run "
                          "pipeline parallelism)")
        if getattr(par, "data_parallel_size", 1) != 1:
            refuse.append(f"data_parallel_size={par.data_parallel_size}")
        if vllm_config.speculative_config is not None:
            refuse.append("speculative decoding")
        if vllm_config.kv_transfer_config is not None:
            refuse.append("a KV connector (kv_transfer_config)")
        if vllm_config.lora_config is not None:
            refuse.append("LoRA")
        if getattr(vllm_config, "use_v2_model_runner", False):
            refuse.append("VLLM_USE_V2_MODEL_RUNNER")
        if vllm_config.cache_config.cache_dtype not in ("auto", None):
            refuse.append(f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r} "
                          "(kvgc quantises its own pages: KVGC_DEMOTE)")
        if refuse:
            raise ValueError("kvgc's vLLM plugin (KVGC_VLLM=1) cannot serve: " +
                             "; ".join(refuse))
        validate_options(vllm_config)
        # The scheduler and the worker share the heap: one process (a rank's, under the
        # external launcher: every rank schedules alike, its GC deciding as the others').
        if not launcher:
            par.distributed_executor_backend = "uni"
        par.worker_cls = WORKER
        vllm_config.scheduler_config.scheduler_cls = SCHEDULER
        _log.info("kvgc: vLLM's KV cache is kvgc's heap (attention %s, scheduler %s)",
                  BACKEND, SCHEDULER)
