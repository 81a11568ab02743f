"""vLLM's SimpleCPUOffloadConnector with the streaming-session fix of vLLM PR #60810.

The simple connector appended a resumed session's full block table to the one it
tracked, like the OffloadingConnector. It keys the CPU tier by block hash, so the
doubled table did not corrupt KV, but its store cursor then pointed into the old
copy and the session's new blocks were never offloaded. The fix replaces the
tracked table with the full one and keeps the cursor.

Its worker is CUDA-only upstream; on the CPU platform use the offloading connector
with our host tier (``connectors.host_tier``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector,
)
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

from connectors.compat import install_fix

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig


class StreamingSafeSimpleCPUOffloadScheduler(SimpleCPUOffloadScheduler):
    """Scheduler side of the simple connector, safe for resumed sessions."""

    def _prepare_eager_store_specs(self, scheduler_output: SchedulerOutput) -> Any:
        num_groups = len(self.cpu_kv_cache_config.kv_cache_groups)
        for new_req in scheduler_output.scheduled_new_reqs:
            state = self._reqs_to_store.get(new_req.req_id)
            if state is not None and not state.finished:
                # The full table follows in scheduled_new_reqs; the cursor
                # (num_stored_blocks) stays, since the session kept its prefix.
                state.block_ids = tuple([] for _ in range(num_groups))
        return super()._prepare_eager_store_specs(scheduler_output)


class StreamingSafeSimpleCPUOffloadConnector(SimpleCPUOffloadConnector):
    """Load with ``kv_connector="StreamingSafeSimpleCPUOffloadConnector"`` and
    ``kv_connector_module_path="connectors.simple"``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        extra_config: dict[str, Any] = self._kv_transfer_config.kv_connector_extra_config
        install_fix(self.scheduler_manager, StreamingSafeSimpleCPUOffloadScheduler, extra_config)
