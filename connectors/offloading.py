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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from connectors.compat import install_fix, session_tail_store_wanted

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        RequestOffloadState,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class StreamingSafeOffloadingScheduler(OffloadingConnectorScheduler):
    """Scheduler side of the OffloadingConnector, safe for resumed sessions."""

    # Set when the class is installed (connectors.compat.install_fix).
    streaming_fix = True
    session_tail_store = True

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
        return super().get_num_new_matched_tokens(
            request, num_computed_tokens, max_num_new_tokens
        )


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
        install_fix(self.connector_scheduler, StreamingSafeOffloadingScheduler, extra_config, also_when=tail_store)
        if isinstance(self.connector_scheduler, StreamingSafeOffloadingScheduler):
            self.connector_scheduler.session_tail_store = tail_store
