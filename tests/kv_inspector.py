"""A vLLM worker extension that lets a test read the engine's KV pages.

Loaded with the engine argument ``worker_extension_cls="tests.kv_inspector.KVInspector"``;
vLLM mixes it into its worker class, so each method runs inside the worker process
and is called with ``AsyncLLM.collective_rpc(name, args=...)``. It returns digests,
not pages, to keep the RPC small. Byte-exact claims compare these digests: the KV a
tier hit loads against the KV the session computed, with no tolerance.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any


def _host_tier_worker() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker.worker
    if worker is None or not hasattr(worker, "host_pages"):
        raise RuntimeError("the engine does not run our host tier (connectors.host_tier)")
    return worker


def _digest(rows: list[Any]) -> str:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(row.numpy().tobytes())
    return digest.hexdigest()


class KVInspector:
    model_runner: Any

    def streamsess_process(self) -> tuple[int, str]:
        """The worker's process: its id and its title (vLLM names its processes)."""
        import psutil

        process = psutil.Process()
        return process.pid, process.cmdline()[0]

    def streamsess_attention_kernels(self) -> list[str]:
        """The CPU attention kernels ("amx", "vec", ...) the model's layers run."""
        return sorted({str(m.isa) for m in self.model_runner.model.modules() if hasattr(m, "isa")})

    def streamsess_request_block_digests(self, internal_request_id: str) -> list[str]:
        """One digest per block of a live request, in block-table order, over every
        KV tensor's page of that block."""
        blocks = self.model_runner.requests[internal_request_id].block_ids[0]
        pages = _host_tier_worker().device_pages
        return [_digest([tensor[block] for tensor in pages]) for block in blocks]

    def streamsess_host_tier_digests(self) -> list[str]:
        """One digest per used block slot of the CPU tier (all-zero slots skipped),
        in the same form as ``streamsess_request_block_digests``."""
        worker = _host_tier_worker()
        rows = [host.view(-1, device.shape[1]) for host, device in zip(worker.host_pages, worker.device_pages)]
        used = rows[0].any(dim=1).nonzero().flatten().tolist()
        return [_digest([tensor[row] for tensor in rows]) for row in used]

    def streamsess_slow_tier_copies(self, delay_s: float, skip_layer_waits: bool = False) -> int:
        """Delay every copy on the host tier's copy thread by ``delay_s``, so a layer
        whose load wait does not hold would read its pages before they land; with
        ``skip_layer_waits`` the connector's layer waits are dropped (the negative
        control). Returns how many distinct tensors the attention layers wait for
        (one per layer when the waits are per layer; 0 without the copy thread)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = _host_tier_worker()
        copier = worker._copier
        if copier is None or not worker.layerwise_loads:
            return 0
        copy = getattr(copier, "_unslowed_copy", copier._copy)
        copier._unslowed_copy = copy

        def slow_copy(*args: Any) -> float:
            time.sleep(delay_s)
            return float(copy(*args))

        copier._copy = slow_copy
        connector = get_kv_transfer_group()
        if skip_layer_waits:
            connector.wait_for_layer_load = lambda layer_name: None
        return len(set(connector._tensor_of_layer.values()))

    def streamsess_zero_device_kv(self) -> None:
        """Zero every device KV page (only with no request running), so stale pages
        that happen to hold the right KV cannot hide a load that did not land."""
        for pages in _host_tier_worker().device_pages:
            pages.zero_()
