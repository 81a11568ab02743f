"""vLLM's OffloadingConnector with the streaming-session fix of vLLM PR #60810.

A streaming-input session that resumes for its next chunk is scheduled as a *new*
request (``scheduled_new_reqs``) and so carries its full block table. vLLM before
0.33 treated that table as this step's additions and appended it to the table the
connector already tracked. The store jobs pair chunk j's offload key with block j
of that doubled table, so earlier chunks' KV was stored under later chunks' keys:
the CPU tier was silently corrupted.

The fix replaces the tracked table with the full one (keeping the store cursor,
which stays valid because a continuation keeps its prefix). We also carry vLLM
PR #63010: a request that restarts from token 0 offers every chunk again.

Both overrides run *before* the upstream code and only reset state that the
upstream code then rebuilds, so on a vLLM that already has the fix they are
no-ops; we skip them there anyway (see ``compat``).

A third carries vLLM 0.33's handling of a request that a cache reset preempts and
reloads from the tier in the same step; vLLM 0.32 died on an assertion there. Our
correctness harness found it (see docs/correctness.md).

The fourth is ours, on every vLLM: the *session tail store*. With vLLM's default
``offload_prompt_only``, a request's outputs are never offloaded; a streaming
session's outputs become prompt only when its next chunk arrives. So when a
session's request ends (the server parks it, or it is closed), its last chunk's
outputs never reached the tier, and a session resumed from the tier recomputed
them. For an ended resumable request we store every token with computed KV: the
outputs are the context the session resumes from.

The fifth, on vLLM 0.32 with our host tier: *synchronous tier loads*. 0.32's
offloading scheduler reports every load as asynchronous: the request waits in
WAITING_FOR_REMOTE_KVS, the load is submitted after that step's forward pass, and
the request is scheduled a step later. Our host worker copies inside
``submit_load``, so those steps are protocol, not copying. We report the load as
synchronous instead (as vLLM 0.33's sync loads do): the scheduler schedules the
request in the step that finds the hit and flags the step (``has_sync_kv_loads``),
so the model runner submits the loads before that step's forward pass. The worker
then must not report them as received: the scheduler waits on no such request, and
would assert on a running one (and a session id reused on resume would leave a
stale entry).

The sixth, with our host tier's copy thread (``connectors.host_tier``): a step's
copies start when its metadata is bound, before the forward pass (vLLM starts
them after it when no load is synchronous), so stores run beside the forward pass,
and each attention layer waits only for its own pages' loads
(``wait_for_layer_load``, a no-op upstream).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connectors.compat import install_fix, session_tail_store_wanted, synchronous_loads_wanted
from connectors.host_tier import HostTierWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        RequestOffloadState,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


# Requests whose disk-tier share is kept for the API process to claim.
DISK_TIER_TOKENS_KEPT = 4096


class StreamingSafeOffloadingScheduler(OffloadingConnectorScheduler):
    """Scheduler side of the OffloadingConnector, safe for resumed sessions."""

    # Set when the class is installed (connectors.compat.install_fix).
    streaming_fix = True
    session_tail_store = True
    synchronous_loads = False
    # Synchronous loads booked complete before the worker reports them: job id ->
    # reports still due (one per worker), dropped as they arrive.
    # Set by the connector: instances get this class by a swap, so no __init__ runs.
    _early_completed_loads: dict[int, int]

    def _calc_num_offloadable_tokens(self, req_status: RequestOffloadState, num_computed_tokens: int) -> int:
        req = req_status.req
        if not (self.session_tail_store and req.resumable and req.is_finished()):
            return super()._calc_num_offloadable_tokens(req_status, num_computed_tokens)
        # An ended session: every token with computed KV (all but the last sampled
        # one, which upstream's finished path already leaves out) is its context.
        num = min(num_computed_tokens, req.num_tokens)
        if req_status.max_offload_tokens is not None:
            num = min(num, req_status.max_offload_tokens)
        return num

    def _update_req_states(self, scheduler_output: SchedulerOutput) -> None:
        if not self.streaming_fix:
            return super()._update_req_states(scheduler_output)
        # A request in scheduled_new_reqs brings its whole block table: forget the
        # table we tracked so upstream's extend() rebuilds it instead of doubling it.
        for new_req in scheduler_output.scheduled_new_reqs:
            req_status = self._req_status.get(new_req.req_id)
            if req_status is not None:
                for group_state in req_status.group_states:
                    group_state.block_ids.clear()
        super()._update_req_states(scheduler_output)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.synchronous_loads:
            self._complete_synchronous_loads(self._current_batch_load_jobs)
        return self._meta_without_reloads_in_flush(scheduler_output)

    # Not "_build_connector_meta": vLLM 0.34 has a method of that name, called by its
    # build_connector_meta (found by running 0.34's own tests against this class).
    def _meta_without_reloads_in_flush(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        # vLLM 0.33: a cache reset with running requests preempts a request and may
        # reschedule it, with a load from the tier, in the same step. That load is
        # not on the worker yet, so there is nothing to flush for it; vLLM 0.32
        # asserted every preempted request's jobs are stores and killed the engine.
        if not self.streaming_fix:
            return super().build_connector_meta(scheduler_output)
        preempted = scheduler_output.preempted_req_ids
        reloading = {
            req_id
            for req_id in preempted or ()
            if (status := self._req_status.get(req_id)) is not None
            and status.transfer_jobs
            and status.transfer_jobs <= self._current_batch_load_jobs.keys()
        }
        if not reloading:
            return super().build_connector_meta(scheduler_output)
        # preempted_req_ids only drives the flush in build_connector_meta (and the
        # manager's no-op on_schedule_end); hide these requests for this call only.
        scheduler_output.preempted_req_ids = set(preempted or ()) - reloading
        try:
            return super().build_connector_meta(scheduler_output)
        finally:
            scheduler_output.preempted_req_ids = preempted

    def _complete_synchronous_loads(self, load_jobs: dict[int, Any]) -> None:
        """Book this step's loads as complete before the step's stores are built.

        The worker runs them before this step's forward pass, so before any work of
        a later step: the stores built now (the worker defers them to the next step),
        one that evicts their source chunks, a later load. Upstream's bookkeeping
        assumes a request never has a load pending beside a store (true of the
        asynchronous protocol, where the request waits for its load) and asserts so,
        here when a loaded request's first step completes a chunk; completing the
        load first keeps that true. The worker's report of it is dropped on arrival."""
        for job_id in load_jobs:
            job = self._jobs.pop(job_id)
            req_status = self._req_status[job.req_id]
            self.manager.complete_load(job.keys, req_status.req_context)
            if self._chunks_being_loaded:
                self._chunks_being_loaded.difference_update(job.keys)
            req_status.transfer_jobs.remove(job_id)
            if req_status.finished_signaled and not req_status.transfer_jobs:
                del self._req_status[job.req_id]
            self._early_completed_loads[job_id] = job.pending_count

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        # (synchronous_loads first: a scheduler built without our connector has no map.)
        if self.synchronous_loads and self._early_completed_loads and isinstance(meta, OffloadingWorkerMetadata):
            completed = dict(meta.completed_jobs)
            for job_id in self._early_completed_loads.keys() & completed.keys():
                remaining = self._early_completed_loads.pop(job_id) - completed.pop(job_id)
                if remaining > 0:  # more workers still to report it
                    self._early_completed_loads[job_id] = remaining
            connector_output = dataclasses.replace(
                connector_output,
                kv_connector_worker_meta=OffloadingWorkerMetadata(
                    completed_jobs=completed, transfer_stats=meta.transfer_stats
                ),
            )
        super().update_connector_output(connector_output)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.synchronous_loads and num_external_tokens:
            # A synchronous hit's blocks are cached as they are allocated (vLLM caches
            # them only after an asynchronous load lands), but upstream finds the load
            # region as the unhashed blocks past the local hit: show it them unhashed.
            local_tokens = self._req_status[request.request_id].num_locally_computed_tokens
            groups = list(blocks.blocks)
            for group in self.config.kv_group_configs:
                first_fresh = cdiv(local_tokens, group.tokens_per_block)
                group_blocks = groups[group.group_idx]
                # Duck-typed: upstream reads block_id, is_null and block_hash only.
                unhashed: list[Any] = [_UnhashedBlock(block) for block in group_blocks[first_fresh:]]
                groups[group.group_idx] = [*group_blocks[:first_fresh], *unhashed]
            blocks = KVCacheBlocks(tuple(groups))
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _lookup(self, req_status: RequestOffloadState, max_num_new_tokens: int | None = None) -> int | None:
        # A disk tier (connectors.disk_tier) checks the request's files in parallel first.
        if (verify_ahead := getattr(self.manager, "verify_ahead", None)) is not None:
            verify_ahead([key for group in req_status.group_states for key in group.offload_keys])
        result: int | None = super()._lookup(req_status, max_num_new_tokens)
        return result

    def get_num_new_matched_tokens(
        self,
        request: Request,
        num_computed_tokens: int,
        max_num_new_tokens: int | None = None,
    ) -> tuple[int | None, bool]:
        # Only requests starting at token 0 get here (new or preempted): their
        # earlier stores may have been flushed or evicted, so offer every chunk.
        req_status = self._req_status.get(request.request_id)
        if self.streaming_fix and req_status is not None:
            for group_state in req_status.group_states:
                group_state.next_stored_chunk_idx = 0
        num_hit_tokens, load_async = super().get_num_new_matched_tokens(
            request, num_computed_tokens, max_num_new_tokens
        )
        if self.synchronous_loads and num_hit_tokens:
            # Leave the last token to compute, as vLLM does when an asynchronous
            # load covers the whole request; its chunk still loads whole. (No
            # partial-tail boundary to keep: that is for recurrent groups only.)
            assert req_status is None or req_status.partial_tail_boundary is None
            return min(num_hit_tokens, request.num_tokens - 1 - num_computed_tokens), False
        return num_hit_tokens, load_async


@dataclasses.dataclass(frozen=True, slots=True)
class _UnhashedBlock:
    """A device block as ``update_state_after_alloc`` reads it, before caching."""

    block: KVCacheBlock
    block_hash: None = None

    @property
    def block_id(self) -> int:
        return self.block.block_id

    @property
    def is_null(self) -> bool:
        return self.block.is_null


class StreamingSafeOffloadingConnector(OffloadingConnector):
    """OffloadingConnector whose scheduler side handles resumed streaming sessions.

    Load it with ``kv_connector="StreamingSafeOffloadingConnector"`` and
    ``kv_connector_module_path="connectors.offloading"``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        extra_config: dict[str, Any] = self._kv_transfer_config.kv_connector_extra_config
        tail_store = session_tail_store_wanted(extra_config)
        # Both roles decide from the same config: the scheduler's reports and the
        # worker's filter must agree, or a request waits forever for its load.
        # Full attention only: that is the layout our load-region fix in
        # update_state_after_alloc knows (sliding windows and Mamba keep async loads).
        self.synchronous_loads = synchronous_loads_wanted(extra_config) and all(
            isinstance(group.kv_cache_spec, FullAttentionSpec) for group in kv_cache_config.kv_cache_groups
        )
        install_fix(
            self.connector_scheduler,
            StreamingSafeOffloadingScheduler,
            extra_config,
            also_when=tail_store or self.synchronous_loads,
        )
        if isinstance(self.connector_scheduler, StreamingSafeOffloadingScheduler):
            self.connector_scheduler.session_tail_store = tail_store
            self.connector_scheduler.synchronous_loads = self.synchronous_loads
            self.connector_scheduler._early_completed_loads = {}
        # Scheduler side: each request's disk-tier tokens, until the API process asks
        # (connectors.disk_tier's engine-core utility); bounded, oldest dropped.
        self._disk_tier_tokens: OrderedDict[str, int] = OrderedDict()
        # Worker side, with the host tier's copy thread (register_kv_caches).
        self._host_tier: HostTierWorker | None = None
        self._tensor_of_layer: dict[str, int] = {}
        self._transfers_started = False

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        sources: dict[Any, int] = super().get_external_cache_hit_sources(request, num_external_tokens)
        if disk := sources.get(CacheHitSource.DISK, 0):
            self._disk_tier_tokens[request.request_id] = disk
            while len(self._disk_tier_tokens) > DISK_TIER_TOKENS_KEPT:
                self._disk_tier_tokens.popitem(last=False)
        return sources

    def take_disk_tier_tokens(self, request_ids: list[str]) -> dict[str, int]:
        return {rid: self._disk_tier_tokens.pop(rid) for rid in request_ids if rid in self._disk_tier_tokens}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        if isinstance(worker, HostTierWorker) and worker.copies_in_background:
            self._host_tier = worker
            self._tensor_of_layer = worker.tensor_index_by_layer(kv_caches)
            worker.layerwise_loads = True  # wait_for_layer_load below waits for them

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._host_tier is not None:
            # Hand this step's copies to the copy thread before the forward pass.
            super().start_load_kv(None)  # type: ignore[arg-type]  # upstream does not read it
            self._transfers_started = True

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self._transfers_started:
            super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._host_tier is not None:
            # A layer we cannot place waits for every load.
            self._host_tier.wait_for_tensor(self._tensor_of_layer.get(layer_name))

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._transfers_started = False

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        finished_sending, finished_recving = super().get_finished(finished_req_ids)
        if self.synchronous_loads:
            # Loaded before the forward pass of the step that scheduled them; the
            # job completions still reach the scheduler side in the worker metadata.
            finished_recving = set()
        return finished_sending, finished_recving
