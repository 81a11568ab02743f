"""A host-memory CPU tier for vLLM's OffloadingConnector that also runs on the CPU platform.

vLLM's ``CPUOffloadingSpec`` keeps the tier's bookkeeping on the scheduler side
(``CPUOffloadingManager``: sizing, LRU/ARC eviction, events, metrics) and moves
bytes on the worker side with CUDA streams and kernels, so its worker refuses a
machine without a GPU. ``HostTierOffloadingSpec`` keeps the manager unchanged and,
on the CPU platform only, swaps in ``HostTierWorker``, which copies whole KV pages
between the engine's KV tensors and a host buffer. On CUDA or XPU the upstream
worker runs unchanged.

Select it with ``kv_connector_extra_config`` keys ``spec_name="HostTierOffloadingSpec"``
and ``spec_module_path="connectors.host_tier"``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class HostTierWorker(OffloadingWorker):
    """Synchronous page copies between the engine's KV tensors and a host buffer.

    Every transfer completes inside ``submit_*``: on the CPU platform the model
    runs on the same thread, so there is no stream to overlap with, and a load is
    guaranteed to land before the forward pass that reads it.

    Layout: one host tensor per engine KV tensor, of shape
    ``(num_chunks, blocks_per_chunk * page_bytes)``; sub-block j of a chunk sits at
    byte ``j * page_bytes``, as in vLLM's CUDA worker. Pages are copied whole with
    one ``copy_`` per run of consecutive blocks: row-wise ``index_select`` ran at a
    tenth of memcpy speed on these machines, plain slice copies at full speed.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        self.blocks_per_chunk = blocks_per_chunk
        self.device_pages: list[torch.Tensor] = []
        self.host_pages: list[torch.Tensor] = []
        for kv_tensor in kv_caches.tensors:
            device = kv_tensor.tensor.view(torch.int8).view(-1, kv_tensor.page_size_bytes)
            self.device_pages.append(device)
            self.host_pages.append(
                torch.zeros((num_chunks, blocks_per_chunk * kv_tensor.page_size_bytes), dtype=torch.int8)
            )
        # Each group's distinct tensors: a page is the unit of copy, so layers that
        # share a tensor are copied once.
        self.group_tensor_ids: list[list[int]] = [
            sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs
        ]
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # transfers finish inside submit_*

    def _transfer(
        self, job_id: int, device_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec, to_host: bool
    ) -> bool:
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        num_bytes = 0
        device_offset = 0
        chunk_offset = 0
        for group_idx, (group_size, first_block_idx) in enumerate(
            zip(device_spec.group_sizes, device_spec.block_indices)
        ):
            if group_size == 0:
                continue
            # The first chunk may be partial: skip the sub-blocks before the
            # request's first block in this transfer.
            skip = first_block_idx % self.blocks_per_chunk
            num_chunks = cdiv(skip + group_size, self.blocks_per_chunk)
            device_blocks = device_spec.block_ids[device_offset : device_offset + group_size]
            chunks = host_spec.block_ids[chunk_offset : chunk_offset + num_chunks]
            for tensor_idx in self.group_tensor_ids[group_idx]:
                num_bytes += self._copy_pages(tensor_idx, device_blocks, chunks, skip, to_host)
            device_offset += group_size
            chunk_offset += num_chunks
        assert device_offset == len(device_spec.block_ids)
        assert chunk_offset == len(host_spec.block_ids)
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=num_bytes,
                transfer_time=time.perf_counter() - start,
            )
        )
        return True

    def _copy_pages(
        self,
        tensor_idx: int,
        device_blocks: np.ndarray,
        chunks: np.ndarray,
        skip: int,
        to_host: bool,
    ) -> int:
        device = self.device_pages[tensor_idx]
        # View the host buffer as one page per row: row = chunk * bpc + sub-block.
        host = self.host_pages[tensor_idx].view(-1, device.shape[1])
        host_rows = (chunks.astype(np.int64)[:, None] * self.blocks_per_chunk
                     + np.arange(self.blocks_per_chunk)).ravel()[skip : skip + len(device_blocks)]
        for dev_start, host_start, length in _contiguous_runs(device_blocks, host_rows):
            device_slice = device[dev_start : dev_start + length]
            host_slice = host[host_start : host_start + length]
            if to_host:
                host_slice.copy_(device_slice)
            else:
                device_slice.copy_(host_slice)
        return len(device_blocks) * device.shape[1]


def _contiguous_runs(
    device_rows: Sequence[int] | np.ndarray, host_rows: Sequence[int] | np.ndarray
) -> list[tuple[int, int, int]]:
    """Split paired row lists into (device_start, host_start, length) runs that
    are consecutive on both sides, so each run is one slice copy."""
    runs: list[tuple[int, int, int]] = []
    for dev, host in zip(device_rows, host_rows):
        dev, host = int(dev), int(host)
        if runs:
            dev_start, host_start, length = runs[-1]
            if dev == dev_start + length and host == host_start + length:
                runs[-1] = (dev_start, host_start, length + 1)
                continue
        runs.append((dev, host, 1))
    return runs


def platform_has_upstream_worker() -> bool:
    return bool(current_platform.is_cuda_alike() or current_platform.is_xpu())


class HostTierOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with a worker that also runs on the CPU platform."""

    @classmethod
    def loads_synchronously(cls) -> bool:
        """Every load lands inside ``submit_load`` (``HostTierWorker``), so a tier hit
        can be scheduled in the step that finds it (``connectors.offloading``)."""
        return not platform_has_upstream_worker()

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if platform_has_upstream_worker():
            return super().get_worker(kv_caches)
        if self._host_worker is None:
            self._host_worker = HostTierWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._host_worker

    _host_worker: HostTierWorker | None = None
