"""Build vLLM's AsyncLLM from the settings: the one place engine arguments are made."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from typing import TYPE_CHECKING, Any

from app.metrics import SchedulerObserver
from app.settings import GIB, Settings
from connectors import (
    DISK_TIER_BYTES_KEY,
    DISK_TIER_DIR_KEY,
    DISK_TIER_FLUSH_UTILITY,
    DISK_TIER_FSYNC_KEY,
    DISK_TIER_SHARED_KEY,
    DISK_TIER_SPEC_MODULE,
    DISK_TIER_SPEC_NAME,
    HOST_TIER_SPEC_MODULE,
    HOST_TIER_SPEC_NAME,
    OFFLOADING_CONNECTOR_MODULE,
    OFFLOADING_CONNECTOR_NAME,
    SIMPLE_CONNECTOR_MODULE,
    SIMPLE_CONNECTOR_NAME,
    vllm_surface,
)
from connectors.compat import (
    ASYNC_TIER_LOADS_KEY,
    DISABLE_FIX_KEY,
    DISABLE_TAIL_STORE_KEY,
    TIER_COPY_THREAD_KEY,
    TIER_COPY_THREAD_MIN_LOAD_BYTES_KEY,
    UPSTREAM_SYNC_LOAD_BUDGET_KEY,
)
from connectors.cpu_linear import packed_config, packed_kernel_helps

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


class EngineConfigError(ValueError):
    """The settings ask for something this machine's vLLM cannot run."""


def kv_transfer_config(settings: Settings) -> dict[str, Any] | None:
    """The connector part of the engine arguments, or None for no offloading. Refuses
    (``EngineConfigError``) a vLLM that lacks a member our connector relies on."""
    if settings.connector == "none":
        return None
    try:
        vllm_surface.check(settings.connector)
    except RuntimeError as exc:
        raise EngineConfigError(str(exc)) from None
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": int(settings.cpu_tier_gib * GIB),
        DISABLE_FIX_KEY: settings.disable_streaming_session_fix,
        DISABLE_TAIL_STORE_KEY: settings.disable_session_tail_store,
    }
    if settings.connector == "offloading":
        from connectors.host_tier import HostTierOffloadingSpec

        extra.update(
            spec_name=HOST_TIER_SPEC_NAME,
            spec_module_path=HOST_TIER_SPEC_MODULE,
            block_size=settings.block_size * settings.blocks_per_chunk,
        )
        if settings.disk_tier_gib:
            try:
                vllm_surface.check("disk_tier")
            except RuntimeError as exc:
                raise EngineConfigError(str(exc)) from None
            if not HostTierOffloadingSpec.loads_synchronously():
                raise EngineConfigError(
                    "the disk tier runs on the CPU platform's host tier only; on a GPU use "
                    "vLLM's TieringOffloadingSpec with its file-system tier"
                )
            extra.update(spec_name=DISK_TIER_SPEC_NAME, spec_module_path=DISK_TIER_SPEC_MODULE)
            extra[DISK_TIER_DIR_KEY] = settings.resolved_disk_tier_dir()
            extra[DISK_TIER_BYTES_KEY] = int(settings.disk_tier_gib * GIB)
            extra[DISK_TIER_FSYNC_KEY] = settings.disk_tier_fsync
            extra[DISK_TIER_SHARED_KEY] = settings.disk_tier_shared
        extra[ASYNC_TIER_LOADS_KEY] = settings.async_tier_loads
        extra[TIER_COPY_THREAD_KEY] = settings.tier_copy_thread
        extra[TIER_COPY_THREAD_MIN_LOAD_BYTES_KEY] = settings.tier_copy_thread_min_load_bytes
        if not settings.async_tier_loads and HostTierOffloadingSpec.loads_synchronously():
            # vLLM 0.33+ loads synchronously up to this many bytes per step (0.32
            # ignores the key; our connector does it there). Our host worker has every
            # load in place before the forward pass reads it, so every tier hit may
            # load in the step that finds it. Only on the CPU platform: CUDA keeps its
            # streams.
            extra[UPSTREAM_SYNC_LOAD_BUDGET_KEY] = int(settings.cpu_tier_gib * GIB)
        name, module = OFFLOADING_CONNECTOR_NAME, OFFLOADING_CONNECTOR_MODULE
    else:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda_alike():
            raise EngineConfigError(
                "connector 'simple' needs a CUDA GPU: vLLM's SimpleCPUOffloadConnector "
                "worker is CUDA-only. Use connector 'offloading' on this machine."
            )
        name, module = SIMPLE_CONNECTOR_NAME, SIMPLE_CONNECTOR_MODULE
    return {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def build_engine_args(settings: Settings) -> AsyncEngineArgs:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    transfer = kv_transfer_config(settings)
    args: dict[str, Any] = {
        "model": settings.resolved_model(),
        "served_model_name": [settings.resolved_served_model_name()],
        "dtype": settings.dtype,
        "block_size": settings.block_size,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": int(settings.kv_cache_gib * GIB),
        "enforce_eager": settings.enforce_eager,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "seed": settings.seed,
        "kv_transfer_config": KVTransferConfig(**transfer) if transfer else None,
    }
    if uses_packed_linear(settings):
        # In the engine's config, which vLLM hashes into its compile cache's key: a graph
        # compiled for one kernel is not loaded for the other.
        args["additional_config"] = packed_config()
    if settings.disk_tier_gib and transfer:
        # Files are named by block hash: a hash that is the same in every process and
        # Python version (vLLM's default sha256 pickles its input).
        args["prefix_caching_hash_algo"] = "sha256_cbor"
    if settings.reasoning_parser:
        # As `vllm serve --reasoning-parser` sets it: the engine then applies a request's
        # grammar once its reasoning ends, not from the first token.
        args["reasoning_parser"] = settings.reasoning_parser
    if settings.otlp_traces_endpoint:
        args["otlp_traces_endpoint"] = settings.otlp_traces_endpoint  # vLLM sets up the tracer provider
    if settings.async_scheduling is not None:
        args["async_scheduling"] = settings.async_scheduling
    if worker_in_engine_core(settings):
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        # A class, not "uni": vLLM's CPU platform turns "uni" into "mp" (the worker's
        # OpenMP binding is set by its process's environment; build_engine sets it).
        args["distributed_executor_backend"] = UniProcExecutor
    # Pass-through last: an operator's explicit engine argument wins.
    args.update(settings.engine_args)
    return AsyncEngineArgs(**args)


def uses_packed_linear(settings: Settings) -> bool:
    """Whether the engine asks for vLLM's packed bf16 linear kernel (connectors/cpu_linear.py;
    it takes bf16 weights only, so a float32 engine computes as before)."""
    from vllm.platforms import current_platform

    return settings.cpu_linear == "auto" and current_platform.is_cpu() and packed_kernel_helps()


def worker_in_engine_core(settings: Settings) -> bool:
    """Whether the model worker runs in the engine-core process (see the setting)."""
    from vllm.platforms import current_platform

    single_worker = all(
        int(settings.engine_args.get(key, 1)) == 1
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    )
    return (
        settings.cpu_worker_in_engine_core
        and current_platform.is_cpu()
        and single_worker
        and "distributed_executor_backend" not in settings.engine_args
    )


def worker_omp_env(vllm_config: Any) -> contextlib.AbstractContextManager[None]:
    """The OpenMP environment (threads, cores) vLLM's multiprocess executor gives a
    worker process of its own, for the engine-core process that runs the worker."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    return OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0)


def build_engine(settings: Settings) -> AsyncLLM:
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor.abstract import Executor

    engine_args = build_engine_args(settings)
    logger.info(
        "starting engine: model=%s connector=%s kv_cache=%.2fGiB cpu_tier=%.2fGiB block_size=%d",
        engine_args.model,
        settings.connector,
        settings.kv_cache_gib,
        settings.cpu_tier_gib,
        settings.block_size,
    )
    observer = SchedulerObserver()
    usage = UsageContext.OPENAI_API_SERVER
    if not worker_in_engine_core(settings):
        engine = AsyncLLM.from_engine_args(engine_args, usage_context=usage, stat_loggers=[observer.logger_factory])
    else:
        # AsyncLLM.from_engine_args, with the config at hand for the worker's binding.
        vllm_config = engine_args.create_engine_config(usage)
        with worker_omp_env(vllm_config):
            engine = AsyncLLM(
                vllm_config=vllm_config,
                executor_class=Executor.get_class(vllm_config),
                log_requests=engine_args.enable_log_requests,
                log_stats=not engine_args.disable_log_stats,
                usage_context=usage,
                stat_loggers=[observer.logger_factory],
            )
    _observers[engine] = observer
    return engine


# Each engine build_engine made, with the observer of its scheduler (app.wiring hands it
# to the admission backstop); engines built elsewhere have none.
_observers: weakref.WeakKeyDictionary[Any, SchedulerObserver] = weakref.WeakKeyDictionary()


def scheduler_observer(engine: Any) -> SchedulerObserver | None:
    """The observer ``build_engine`` gave this engine's scheduler, if it built it."""
    return _observers.get(engine)


async def flush_disk_tier(engine: AsyncLLM, timeout_s: float = 30.0) -> None:
    """With a disk tier, wait until what the engine holds is on disk: no request or
    transfer pending (parked sessions' tails stored), then every queued file written.
    A graceful stop calls it before ``shutdown_engine``, which kills the worker."""
    extra = (
        engine.vllm_config.kv_transfer_config.kv_connector_extra_config if engine.vllm_config.kv_transfer_config else {}
    )
    if DISK_TIER_DIR_KEY not in extra or engine.errored:
        return

    async def flushed() -> None:
        # Polled: the pending transfers are in the engine core's process.
        while await engine.engine_core.call_utility_async(DISK_TIER_FLUSH_UTILITY):  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(flushed(), timeout_s)
    except Exception as exc:  # an engine stopping too (a signal to the process group), or one still busy
        logger.warning("disk tier: not flushed (%s); files still queued are lost", exc or type(exc).__name__)


def shutdown_engine(engine: AsyncLLM) -> None:
    """Stop the engine as vLLM's own server does: its ``shutdown_timeout`` (0 unless
    set; then requests still running are aborted, ours are ended before this) is
    the engine process's time to exit before it is killed. Without a timeout vLLM
    waits 5 s, which on CPU it always spends (its worker alone takes about 3 s to
    exit), so every stop or restart took 5 s longer."""
    engine.shutdown(timeout=engine.vllm_config.shutdown_timeout)
