"""The CPU-platform tier worker: pages go to the host buffer and come back exactly."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from connectors.host_tier import HostTierWorker, _contiguous_runs

PAGE = 64
NUM_BLOCKS = 16


def make_caches(num_layers: int = 2) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=generator) for _ in range(num_layers)
    ]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(num_layers)]],
    )
    return caches, tensors


@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
def test_store_then_load_round_trips(blocks_per_chunk: int) -> None:
    caches, tensors = make_caches()
    original = [t.clone() for t in tensors]
    worker = HostTierWorker(caches, blocks_per_chunk=blocks_per_chunk, num_chunks=8)
    # Request blocks 1..5 (logical index 1: the first chunk is partial when bpc > 1)
    # live in device blocks 9, 10, 11, 4, 2.
    device_blocks = [9, 10, 11, 4, 2]
    num_chunks = -(-(1 % blocks_per_chunk + len(device_blocks)) // blocks_per_chunk)
    chunks = [7, 3, 5, 0, 1, 6][:num_chunks]
    store = GPULoadStoreSpec(device_blocks, group_sizes=[len(device_blocks)], block_indices=[1])
    assert worker.submit_store(1, store, CPULoadStoreSpec(chunks))
    for tensor in tensors:
        tensor.zero_()
    targets = [0, 1, 2, 3, 5]
    load = GPULoadStoreSpec(targets, group_sizes=[len(targets)], block_indices=[1])
    assert worker.submit_load(2, CPULoadStoreSpec(chunks), load)
    for tensor, before in zip(tensors, original):
        assert torch.equal(tensor[targets], before[device_blocks])
        untouched = [b for b in range(NUM_BLOCKS) if b not in targets]
        assert not tensor[untouched].any()
    results = worker.get_finished()
    assert [r.job_id for r in results] == [1, 2] and all(r.success for r in results)
    assert results[0].transfer_size == len(device_blocks) * PAGE * len(tensors)
    assert worker.get_finished() == []


def test_contiguous_runs_merge_consecutive_rows() -> None:
    assert _contiguous_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert _contiguous_runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]
