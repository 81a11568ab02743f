"""Drive vLLM's real Scheduler with our connectors and record what they store.

Modelled on vLLM's own connector tests (tests/v1/kv_connector/unit/offloading_connector
and tests/v1/simple_kv_offload): the Scheduler, the KV cache manager and the
connector's scheduler side are vLLM's real classes; only the model is replaced by
fixed sampled tokens, and the offload manager (OffloadingConnector) by a recording
one that accepts every store and misses every lookup.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload.metadata import (
    SimpleCPUOffloadMetadata,
    SimpleCPUOffloadWorkerMetadata,
)
from vllm.v1.structured_output import StructuredOutputManager

from app.models.builder import ensure_model
from connectors import (
    OFFLOADING_CONNECTOR_MODULE,
    OFFLOADING_CONNECTOR_NAME,
    SIMPLE_CONNECTOR_MODULE,
    SIMPLE_CONNECTOR_NAME,
)
from connectors.compat import ASYNC_TIER_LOADS_KEY, DISABLE_FIX_KEY, DISABLE_TAIL_STORE_KEY

EOS_TOKEN_ID = 0
ConnectorKind = Literal["offloading", "simple"]


class KeysSpec(LoadStoreSpec):
    """Where the recording manager 'stores' chunks: just their keys."""

    def __init__(self, keys: Iterable[OffloadKey]):
        self.keys = list(keys)


class RecordingOffloadingManager(OffloadingManager):
    """Accepts every store and remembers what was stored. Lookups miss, unless
    ``serve_hits`` is set: then stored keys hit and can be loaded."""

    def __init__(self) -> None:
        self.stored_keys: list[OffloadKey] = []
        self.serve_hits = False
        self.loaded_keys: list[OffloadKey] = []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.serve_hits and key in self.stored_keys else LookupResult.MISS

    def prepare_load(self, keys: Any, req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        self.loaded_keys.extend(keys)
        return KeysSpec(keys)

    def prepare_store(self, keys: Any, req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        return PrepareStoreOutput(keys_to_store=keys, store_spec=KeysSpec(keys), evicted_keys=[])

    def complete_store(self, keys: Any, success: bool = True, *args: Any, **kwargs: Any) -> None:
        if success:
            self.stored_keys.extend(keys)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()


class RecordingOffloadingSpec(OffloadingSpec):
    """Loaded by the OffloadingConnector through spec_module_path."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.manager = RecordingOffloadingManager()

    def get_manager(self) -> OffloadingManager:
        return self.manager

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        raise AssertionError("scheduler-side tests build no worker")

    @classmethod
    def loads_synchronously(cls) -> bool:
        return True  # the harness completes every load at once, as our host tier does


@dataclass
class StepRecord:
    stored_block_offsets: list[int] = field(default_factory=list)


class SchedulerHarness:
    """One real vLLM Scheduler with one of our connectors, driven step by step."""

    def __init__(
        self,
        connector: ConnectorKind,
        async_scheduling: bool,
        disable_fix: bool = False,
        block_size: int = 4,
        num_gpu_blocks: int = 100,
        offload_prompt_only: bool = False,
        disable_tail_store: bool = False,
        async_tier_loads: bool = False,
    ):
        init_none_hash(sha256)
        self.connector_kind = connector
        self.async_scheduling = async_scheduling
        self.block_size = block_size
        extra: dict[str, Any] = {
            DISABLE_FIX_KEY: disable_fix,
            DISABLE_TAIL_STORE_KEY: disable_tail_store,
            ASYNC_TIER_LOADS_KEY: async_tier_loads,
        }
        if connector == "offloading":
            extra.update(
                spec_name="RecordingOffloadingSpec",
                spec_module_path=__name__,
                offload_prompt_only=offload_prompt_only,
            )
            name, module = OFFLOADING_CONNECTOR_NAME, OFFLOADING_CONNECTOR_MODULE
        else:
            # Tier size in bytes: room for plenty of 4-token blocks.
            extra.update(cpu_bytes_to_use=1 << 20)
            name, module = SIMPLE_CONNECTOR_NAME, SIMPLE_CONNECTOR_MODULE

        model_dir = str(ensure_model("tiny"))
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model=model_dir, dtype="float32", seed=0, max_model_len=2048),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=1000,
                max_model_len=2048,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                async_scheduling=async_scheduling,
            ),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector=name,
                kv_connector_module_path=module,
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            ),
        )
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=spec.page_size_bytes * num_gpu_blocks,
                    layers=["layer"],
                    layer_stride=spec.page_size_bytes * num_gpu_blocks,
                    block_stride=spec.page_size_bytes,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(self.kv_cache_config, self.vllm_config)
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        with set_current_vllm_config(self.vllm_config):
            self.scheduler = scheduler_cls(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=scheduler_block_size,
                hash_block_size=hash_block_size,
                log_stats=True,
            )
        assert self.scheduler.connector is not None
        self.connector: Any = self.scheduler.connector
        self._block_hasher = get_request_block_hasher(block_size, sha256)
        # Completions reported back to the connector with the next model output.
        self._pending_offloading_jobs: list[int] = []
        self._pending_simple_events: list[int] = []
        self._finished_loads: set[str] = set()

    # ------------------------------------------------------------------ inputs
    def add_chunk(self, req_id: str, token_ids: list[int]) -> None:
        """Start a streaming session, or append its next input chunk."""
        params = SamplingParams(max_tokens=1000)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(token_ids),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._block_hasher,
            resumable=True,
        )
        self.scheduler.add_request(request)

    def end_session(self, req_id: str) -> None:
        """End a streaming session the way AsyncLLM does when its input stream
        closes: a non-resumable request with the session's id."""
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        self.scheduler.add_request(
            Request(request_id=req_id, prompt_token_ids=[0], sampling_params=params, pooling_params=None)
        )

    # ------------------------------------------------------------------ engine loop
    def run(self, decoded_tokens: list[int], max_steps: int | None = None) -> list[int]:
        """Run steps, sampling ``decoded_tokens`` one per step, until the chunk ends
        (EOS) and every store it started has completed, or for ``max_steps`` steps.
        Returns the request-relative offsets of the device blocks stored meanwhile."""
        stored: list[int] = []
        tokens = iter(decoded_tokens)
        previous: tuple[Any, ModelRunnerOutput] | None = None
        idle_steps = 0
        steps = 0
        while idle_steps < 3 and (max_steps is None or steps < max_steps):
            steps += 1
            scheduler_output = self.scheduler.schedule()
            stored += self._record_stores(scheduler_output.kv_connector_metadata)
            running = list(self.scheduler.running)
            token = next(tokens, EOS_TOKEN_ID) if running else EOS_TOKEN_ID
            output = self._model_output(running, token)
            if self.async_scheduling:
                # The async scheduler consumes each step's output one step later.
                if previous is not None:
                    self.scheduler.update_from_output(*previous)
                previous = (scheduler_output, output)
            else:
                self.scheduler.update_from_output(scheduler_output, output)
            busy = bool(running) or self._pending_offloading_jobs or self._pending_simple_events
            idle_steps = 0 if busy else idle_steps + 1
        if previous is not None:
            self.scheduler.update_from_output(*previous)
        return stored

    def _block_offsets(self) -> dict[int, int]:
        """Device block id -> its index in the owning request's block table."""
        offsets: dict[int, int] = {}
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        for blocks in manager.req_to_blocks.values():
            for index, block in enumerate(blocks):
                offsets[block.block_id] = index
        return offsets

    def _record_stores(self, metadata: Any) -> list[int]:
        offsets = self._block_offsets()
        stored: list[int] = []
        if isinstance(metadata, OffloadingConnectorMetadata):
            for job_id, job in metadata.store_jobs.items():
                # A finished request's blocks are freed already: offset -1.
                stored += [offsets.get(int(b), -1) for b in job.src_spec.block_ids]
                self._pending_offloading_jobs.append(job_id)
            # Loads complete at once, as on our host tier. Like our worker-side
            # connector, report them as received only on the asynchronous protocol.
            self._pending_offloading_jobs.extend(metadata.load_jobs)
            if not getattr(self.connector, "synchronous_loads", False):
                self._finished_loads.update(job.req_id for job in metadata.load_jobs.values())
        elif isinstance(metadata, SimpleCPUOffloadMetadata):
            if metadata.store_event >= 0:
                stored += [offsets[b] for b in metadata.store_gpu_blocks]
                self._pending_simple_events.append(metadata.store_event)
        return stored

    def _model_output(self, running: list[Request], token: int) -> ModelRunnerOutput:
        worker_meta: Any = None
        if self._pending_offloading_jobs:
            worker_meta = OffloadingWorkerMetadata()
            for job_id in self._pending_offloading_jobs:
                worker_meta.mark_completed(job_id)
        elif self._pending_simple_events:
            worker_meta = SimpleCPUOffloadWorkerMetadata(
                completed_store_events={event: 1 for event in self._pending_simple_events}
            )
        self._pending_offloading_jobs = []
        self._pending_simple_events = []
        finished_loads, self._finished_loads = self._finished_loads, set()
        req_ids = [r.request_id for r in running]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=[[token] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(
                kv_connector_worker_meta=worker_meta, finished_recving=finished_loads or None
            ),
        )
