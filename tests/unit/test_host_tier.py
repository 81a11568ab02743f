"""The CPU-platform tier worker: pages go to the host buffer and come back exactly,
copied inline or on its copy thread, and a layer's loaded pages are in place when the
layer's wait returns."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from connectors.host_tier import HostTierWorker, _contiguous_runs, spare_cpus

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


COPY_MODES = {"inline": (False, False), "thread": (True, False), "thread-layerwise": (True, True)}


@pytest.mark.parametrize("copy_mode", COPY_MODES)
@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
def test_store_then_load_round_trips(blocks_per_chunk: int, copy_mode: str) -> None:
    caches, tensors = make_caches()
    original = [t.clone() for t in tensors]
    copy_thread, layerwise = COPY_MODES[copy_mode]
    worker = HostTierWorker(caches, blocks_per_chunk=blocks_per_chunk, num_chunks=8, copy_thread=copy_thread)
    worker.layerwise_loads = layerwise
    # Request blocks 1..5 (logical index 1: the first chunk is partial when bpc > 1)
    # live in device blocks 9, 10, 11, 4, 2.
    device_blocks = [9, 10, 11, 4, 2]
    num_chunks = -(-(1 % blocks_per_chunk + len(device_blocks)) // blocks_per_chunk)
    chunks = [7, 3, 5, 0, 1, 6][:num_chunks]
    store = GPULoadStoreSpec(device_blocks, group_sizes=[len(device_blocks)], block_indices=[1])
    assert worker.submit_store(1, store, CPULoadStoreSpec(chunks))
    stored = worker.get_finished()  # the step's end: every copy of the step has landed
    for tensor in tensors:
        tensor.zero_()
    targets = [0, 1, 2, 3, 5]
    load = GPULoadStoreSpec(targets, group_sizes=[len(targets)], block_indices=[1])
    assert worker.submit_load(2, CPULoadStoreSpec(chunks), load)
    results = stored + worker.get_finished()
    for tensor, before in zip(tensors, original):
        assert torch.equal(tensor[targets], before[device_blocks])
        untouched = [b for b in range(NUM_BLOCKS) if b not in targets]
        assert not tensor[untouched].any()
    assert [r.job_id for r in results] == [1, 2] and all(r.success for r in results)
    assert [r.transfer_size for r in results] == [len(device_blocks) * PAGE * len(tensors)] * 2
    assert worker.get_finished() == []
    worker.shutdown()


# Pages 3-6 stored to chunks 0-3, then loaded back into pages 8-11.
DEVICE_BLOCKS = [3, 4, 5, 6]
TARGETS = [8, 9, 10, 11]


def load_with_the_copy_thread_held(
    worker: HostTierWorker, tensors: list[torch.Tensor]
) -> tuple[list[torch.Tensor], threading.Event]:
    """Store DEVICE_BLOCKS to the tier, zero the device, hold the copy thread until the
    returned event is set, and submit the load into TARGETS (job 2); returns the
    device's tensors as they were before the zeroing."""
    worker.submit_store(
        1, GPULoadStoreSpec(DEVICE_BLOCKS, group_sizes=[4], block_indices=[0]), CPULoadStoreSpec([0, 1, 2, 3])
    )
    worker.get_finished()
    original = [t.clone() for t in tensors]
    for tensor in tensors:
        tensor.zero_()
    release = threading.Event()
    copy = worker._copier._copy  # type: ignore[union-attr]

    def held_copy(*args: object) -> float:
        release.wait(timeout=30)
        return copy(*args)  # type: ignore[arg-type]

    worker._copier._copy = held_copy  # type: ignore[union-attr]
    worker.submit_load(2, CPULoadStoreSpec([0, 1, 2, 3]), GPULoadStoreSpec(TARGETS, group_sizes=[4], block_indices=[0]))
    return original, release


def test_layerwise_load_copies_the_last_page_first_and_each_layer_on_demand() -> None:
    """The copy thread held: submit_load has already written each load's last page
    (the step's new tokens are written there before any layer waits), and a layer's
    wait returns only once that layer's pages are in. Without the inline last page,
    or with a wait that returns early, the asserts below see zeros."""
    caches, tensors = make_caches(num_layers=3)
    worker = HostTierWorker(caches, blocks_per_chunk=1, num_chunks=8, copy_thread=True)
    worker.layerwise_loads = True
    original, release = load_with_the_copy_thread_held(worker, tensors)
    for tensor, before in zip(tensors, original):
        assert torch.equal(tensor[11], before[6])  # the last page: inline
        assert not tensor[8:11].any()  # the rest: still queued
    # What layer 0's pages hold the moment its wait returns: a wait that returned
    # before the held copy thread was released would see zeros there.
    seen_at_return: list[torch.Tensor] = []

    def wait_for_layer_0() -> None:
        worker.wait_for_tensor(0)
        seen_at_return.append(tensors[0][8:11].clone())

    waiter = threading.Thread(target=wait_for_layer_0)
    waiter.start()
    # Time for a wrong wait to return early (a right one blocks until the release);
    # no outcome depends on this pause's length, only how likely a wrong wait is seen.
    waiter.join(timeout=0.2)
    release.set()
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "layer 0's wait never returned"
    assert torch.equal(seen_at_return[0], original[0][3:6])
    worker.wait_for_tensor(None)
    for tensor, before in zip(tensors, original):
        assert torch.equal(tensor[TARGETS], before[DEVICE_BLOCKS])
    assert [r.job_id for r in worker.get_finished()] == [2]
    worker.shutdown()


def test_a_load_under_the_thread_minimum_is_copied_inline_and_a_store_still_goes_to_the_thread() -> None:
    """The copy thread held: a load smaller than ``thread_min_load_bytes`` is whole on
    the device when submit_load returns, while a store waits for the thread."""
    caches, tensors = make_caches()
    worker = HostTierWorker(
        caches, blocks_per_chunk=1, num_chunks=8, copy_thread=True, thread_min_load_bytes=4 * PAGE * len(tensors) + 1
    )
    worker.layerwise_loads = True
    original, release = load_with_the_copy_thread_held(worker, tensors)
    for tensor, before in zip(tensors, original):
        assert torch.equal(tensor[TARGETS], before[DEVICE_BLOCKS])  # inline: all in already
    tensors[0][12] = 7
    worker.submit_store(3, GPULoadStoreSpec([12], group_sizes=[1], block_indices=[0]), CPULoadStoreSpec([4]))
    assert not worker.host_pages[0][4].any()  # the store is queued on the held thread
    release.set()
    assert sorted(r.job_id for r in worker.get_finished()) == [2, 3]
    assert (worker.host_pages[0][4] == 7).all()
    worker.shutdown()


def test_contiguous_runs_merge_consecutive_rows() -> None:
    assert _contiguous_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert _contiguous_runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]


def test_layers_map_to_their_own_tensors_in_one_allocation() -> None:
    """vLLM's CPU platform carves every layer's KV out of one allocation: each layer
    must still map to the tensor that starts where its KV starts (mapping by the
    shared storage sent every layer to one tensor, so each waited for all loads)."""
    storage = torch.zeros(3 * NUM_BLOCKS * PAGE, dtype=torch.int8)
    layers = {
        f"layer.{i}": storage[i * NUM_BLOCKS * PAGE : (i + 1) * NUM_BLOCKS * PAGE].view(NUM_BLOCKS, PAGE)
        for i in range(3)
    }
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in layers.values()],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(3)]],
    )
    worker = HostTierWorker(caches, blocks_per_chunk=1, num_chunks=4)
    assert worker.tensor_index_by_layer(layers) == {"layer.0": 0, "layer.1": 1, "layer.2": 2}


@contextmanager
def thread_bound_to(cpu: int) -> Iterator[None]:
    """A thread of this process bound to one CPU, as vLLM binds its OpenMP threads."""
    bound, done = threading.Event(), threading.Event()

    def run() -> None:
        os.sched_setaffinity(0, {cpu})
        bound.set()
        done.wait(timeout=30)

    thread = threading.Thread(target=run)
    thread.start()
    bound.wait(timeout=30)
    try:
        yield
    finally:
        done.set()
        thread.join()


@pytest.mark.skipif(len(os.sched_getaffinity(os.getppid())) < 2, reason="needs two CPUs to leave one spare")
def test_spare_cpus_are_those_no_bound_thread_uses() -> None:
    """The copy thread goes only where no compute thread is bound: with one CPU
    taken the other is spare; with every CPU taken none is (copies stay inline)."""
    allowed = sorted(os.sched_getaffinity(os.getppid()))
    with thread_bound_to(allowed[0]):
        assert allowed[0] not in spare_cpus() and allowed[1] in spare_cpus()
        with ExitStack() as others:
            for cpu in allowed[1:]:
                others.enter_context(thread_bound_to(cpu))
            assert spare_cpus() == set()
            caches, _ = make_caches()
            assert not HostTierWorker(caches, blocks_per_chunk=1, num_chunks=2, copy_thread=True).copies_in_background
