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

import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

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

from connectors.compat import TIER_COPY_THREAD_MIN_LOAD_BYTES_KEY, tier_copy_thread_wanted

# Under "vllm", so vLLM's log handler prints it in the engine's processes.
logger = logging.getLogger("vllm.streamsess.host_tier")

# (device_start, host_start, length): pages consecutive on both sides, one copy.
Run = tuple[int, int, int]


@dataclass
class _Job:
    job_id: int
    is_load: bool
    num_bytes: int
    remaining: int
    copy_seconds: float = 0.0

    def result(self) -> TransferResult:
        return TransferResult(
            job_id=self.job_id, success=True, transfer_size=self.num_bytes, transfer_time=self.copy_seconds
        )


@dataclass(order=True)
class _Copy:
    """One tensor's share of a job, as the copy thread takes it: loads before stores,
    and loads by tensor (layer) order, so the first layers' pages land first."""

    priority: tuple[int, int, int]
    job: _Job = field(compare=False)
    tensor_idx: int = field(compare=False)
    runs: list[Run] = field(compare=False)


class HostTierWorker(OffloadingWorker):
    """Page copies between the engine's KV tensors and a host buffer.

    Layout: one host tensor per engine KV tensor, of shape
    ``(num_chunks, blocks_per_chunk * page_bytes)``; sub-block j of a chunk sits at
    byte ``j * page_bytes``, as in vLLM's CUDA worker. Pages are copied whole with
    one copy per run of blocks consecutive on both sides: row-wise ``index_select``
    ran at a tenth of memcpy speed on these machines, plain slice copies at full speed.

    **Where copies run.** Inline (``copy_thread=False``, or no spare CPU: see
    ``spare_cpus``), every transfer completes inside ``submit_*``, on the model's
    thread. With a copy thread, on a CPU no compute thread uses, the copies run beside
    the forward pass instead (``np.copyto`` releases the GIL), the way vLLM's CUDA
    worker uses streams:

    - stores go to the thread and overlap this step's forward pass;
    - loads of ``thread_min_load_bytes`` or more go to the thread per tensor (smaller
      ones are copied inline), first layers first, and the forward pass
      waits for a layer's pages only when it reaches that layer
      (``wait_for_tensor``, from the connector's ``wait_for_layer_load``), once
      ``layerwise_loads`` says a connector makes those waits. The last page of each
      load is copied inline: vLLM writes the step's new tokens into the cache
      (``unified_kv_cache_update``) *before* the layer's load wait, and a tier hit's
      last loaded block holds the slot of the token the step computes;
    - every job submitted in a step is complete when the step ends (``get_finished``
      waits), as with inline copies, so a request answered after a step finds that
      step's stores in the tier (the session service's ``tier_barrier`` relies on it).
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_chunks: int,
        copy_thread: bool = False,
        thread_min_load_bytes: int = 0,
    ):
        self.blocks_per_chunk = blocks_per_chunk
        self.device_pages: list[torch.Tensor] = []
        self.host_pages: list[torch.Tensor] = []
        for kv_tensor in kv_caches.tensors:
            device = kv_tensor.tensor.view(torch.int8).view(-1, kv_tensor.page_size_bytes)
            self.device_pages.append(device)
            self.host_pages.append(
                torch.zeros((num_chunks, blocks_per_chunk * kv_tensor.page_size_bytes), dtype=torch.int8)
            )
        # The same memory as numpy arrays, one page per row (host: row = chunk *
        # blocks_per_chunk + sub-block): numpy's copies release the GIL.
        self._device_rows = [device.numpy() for device in self.device_pages]
        self._host_rows = [
            host.view(-1, device.shape[1]).numpy() for host, device in zip(self.host_pages, self.device_pages)
        ]
        # Each group's distinct tensors: a page is the unit of copy, so layers that
        # share a tensor are copied once.
        self.group_tensor_ids: list[list[int]] = [
            sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs
        ]
        # Set by a connector that waits for each layer's load before the layer runs.
        self.layerwise_loads = False
        self.thread_min_load_bytes = thread_min_load_bytes
        self._finished: list[TransferResult] = []
        spare = spare_cpus() if copy_thread else set()
        self._copier = _CopyThread(self._copy, spare) if spare else None
        if copy_thread:
            logger.info(
                "CPU-tier copies: %s",
                f"on a copy thread, on CPUs {sorted(spare)}"
                if spare
                else "inline (every CPU of this engine runs a compute thread, so a copy thread would only take from them)",
            )

    @property
    def copies_in_background(self) -> bool:
        return self._copier is not None

    def tensor_index_by_layer(self, kv_caches: Mapping[str, torch.Tensor]) -> dict[str, int]:
        """Which of our tensors holds each layer's KV: the one that starts where the
        layer's KV starts (on CPU, every layer's KV is a view into one allocation)."""
        index = {device.data_ptr(): i for i, device in enumerate(self.device_pages)}
        return {name: index[tensor.data_ptr()] for name, tensor in kv_caches.items() if tensor.data_ptr() in index}

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, is_load=False)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, dst_spec, src_spec, is_load=True)

    def wait_for_tensor(self, tensor_idx: int | None) -> None:
        """Return once every load submitted so far has landed in this tensor (None:
        in every tensor)."""
        if self._copier is not None:
            self._copier.wait_for_loads(tensor_idx)

    def get_finished(self) -> list[TransferResult]:
        if self._copier is not None:
            self._finished.extend(self._copier.drain())
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        if self._copier is not None:
            self._finished.extend(self._copier.drain())

    def shutdown(self) -> None:
        if self._copier is not None:
            self._copier.stop()

    def _submit(self, job_id: int, device_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec, is_load: bool) -> bool:
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        plan = self._plan(device_spec, host_spec)
        job = _Job(job_id, is_load, num_bytes=sum(self._bytes(t, runs) for t, runs in plan), remaining=0)
        if self._copier is None or (
            is_load and (not self.layerwise_loads or job.num_bytes < self.thread_min_load_bytes)
        ):
            for tensor_idx, runs in plan:
                job.copy_seconds += self._copy(tensor_idx, runs, to_host=not is_load)
            self._finished.append(job.result())
            return True
        if is_load:
            # The last page of each group first, here: see the class docstring.
            plan, last_pages = _split_last_pages(plan, device_spec)
            for tensor_idx, runs in last_pages:
                job.copy_seconds += self._copy(tensor_idx, runs, to_host=False)
        self._copier.submit(job, plan)
        return True

    def _plan(self, device_spec: GPULoadStoreSpec, host_spec: BlockIDsLoadStoreSpec) -> list[tuple[int, list[Run]]]:
        """Per tensor, the runs of pages to copy."""
        plan: list[tuple[int, list[Run]]] = []
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
            host_rows = (
                chunks.astype(np.int64)[:, None] * self.blocks_per_chunk + np.arange(self.blocks_per_chunk)
            ).ravel()[skip : skip + group_size]
            runs = _contiguous_runs(device_blocks, host_rows)
            plan.extend((tensor_idx, runs) for tensor_idx in self.group_tensor_ids[group_idx])
            device_offset += group_size
            chunk_offset += num_chunks
        assert device_offset == len(device_spec.block_ids)
        assert chunk_offset == len(host_spec.block_ids)
        return plan

    def _bytes(self, tensor_idx: int, runs: list[Run]) -> int:
        return sum(length for _, _, length in runs) * self.device_pages[tensor_idx].shape[1]

    def _copy(self, tensor_idx: int, runs: list[Run], to_host: bool) -> float:
        """Copy the runs; returns the seconds it took."""
        start = time.perf_counter()
        device, host = self._device_rows[tensor_idx], self._host_rows[tensor_idx]
        for dev_start, host_start, length in runs:
            device_slice = device[dev_start : dev_start + length]
            host_slice = host[host_start : host_start + length]
            if to_host:
                np.copyto(host_slice, device_slice)
            else:
                np.copyto(device_slice, host_slice)
        return time.perf_counter() - start


def _split_last_pages(
    plan: list[tuple[int, list[Run]]], device_spec: GPULoadStoreSpec
) -> tuple[list[tuple[int, list[Run]]], list[tuple[int, list[Run]]]]:
    """Split each group's last device block off the plan: (rest, last pages)."""
    last_blocks = set()
    offset = 0
    for group_size in device_spec.group_sizes:
        offset += group_size
        if group_size:
            last_blocks.add(int(device_spec.block_ids[offset - 1]))
    rest: list[tuple[int, list[Run]]] = []
    last: list[tuple[int, list[Run]]] = []
    for tensor_idx, runs in plan:
        body: list[Run] = []
        for dev_start, host_start, length in runs:
            end = dev_start + length - 1
            if end in last_blocks:
                last.append((tensor_idx, [(end, host_start + length - 1, 1)]))
                length -= 1
            if length:
                body.append((dev_start, host_start, length))
        rest.append((tensor_idx, body))
    return rest, last


def spare_cpus() -> set[int]:
    """CPUs this engine may use that none of this worker's compute threads is bound to.

    vLLM's CPU worker binds each OpenMP thread to one CPU, and every other thread of
    the process inherits the main thread's. With ``VLLM_CPU_NUM_OF_RESERVED_CPU`` the
    CPUs it leaves to the engine core and the API server are mostly idle during a
    forward pass; a copy thread there overlaps the pass (measured: a 2,048-token tier
    hit's copy hidden), while a copy thread on a compute thread's CPU only slows the
    pass down by as much as it copies (measured too, docs/benchmarks.md section 2)."""
    try:
        allowed = os.sched_getaffinity(os.getppid())  # the engine core's (or server's) CPUs
        tasks = os.listdir("/proc/self/task")
    except (OSError, AttributeError):  # not Linux
        return set()
    busy: set[int] = set()
    for task in tasks:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            cpus = os.sched_getaffinity(int(task))
            if len(cpus) < len(allowed):  # bound: a compute thread, or one that inherited its CPU
                busy |= cpus
    return allowed - busy


class _CopyThread:
    """One thread that runs page copies in ``_Copy`` order, on ``cpus``, and what
    waits on them."""

    def __init__(self, copy: Callable[[int, list[Run], bool], float], cpus: set[int]):
        self._copy = copy
        self._cpus = cpus
        self._cond = threading.Condition()
        self._queue: list[_Copy] = []
        self._seq = itertools.count()
        self._loads_pending: Counter[int] = Counter()  # tensor -> load copies not done
        self._unfinished = 0
        self._finished: list[TransferResult] = []
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="streamsess-host-tier-copy", daemon=True)
        self._thread.start()

    def submit(self, job: _Job, plan: list[tuple[int, list[Run]]]) -> None:
        copies = [(tensor_idx, runs) for tensor_idx, runs in plan if runs]
        with self._cond:
            job.remaining = len(copies)
            if not copies:
                self._finished.append(job.result())
                return
            for tensor_idx, runs in copies:
                priority = (0, tensor_idx, next(self._seq)) if job.is_load else (1, 0, next(self._seq))
                heapq.heappush(self._queue, _Copy(priority, job, tensor_idx, runs))
                if job.is_load:
                    self._loads_pending[tensor_idx] += 1
            self._unfinished += len(copies)
            self._cond.notify_all()

    def wait_for_loads(self, tensor_idx: int | None) -> None:
        if tensor_idx is not None and not self._loads_pending[tensor_idx]:
            # Every layer of every step asks, and nearly always nothing is pending: no lock.
            # Loads are submitted by this (the forward pass's) thread, so a count read as 0
            # cannot grow before this layer reads its tensor; the copy thread only lowers it,
            # after its copy has landed.
            return
        with self._cond:
            if tensor_idx is None:
                self._cond.wait_for(lambda: not any(self._loads_pending.values()) or self._error is not None)
            else:
                self._cond.wait_for(lambda: not self._loads_pending[tensor_idx] or self._error is not None)
            self._raise_error()

    def drain(self) -> list[TransferResult]:
        """Wait for every copy submitted so far; the jobs finished since the last call."""
        with self._cond:
            self._cond.wait_for(lambda: self._unfinished == 0 or self._error is not None)
            self._raise_error()
            finished, self._finished = self._finished, []
        return finished

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("a CPU-tier copy failed") from self._error

    def _run(self) -> None:
        os.sched_setaffinity(0, self._cpus)  # this thread only
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopped)
                if self._stopped:
                    return
                item = heapq.heappop(self._queue)
            try:
                seconds = self._copy(item.tensor_idx, item.runs, not item.job.is_load)
            except BaseException as exc:  # surfaced to the model's thread by the next wait
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                job = item.job
                job.copy_seconds += seconds
                job.remaining -= 1
                if job.remaining == 0:
                    self._finished.append(job.result())
                if job.is_load:
                    self._loads_pending[item.tensor_idx] -= 1
                self._unfinished -= 1
                self._cond.notify_all()


def _contiguous_runs(device_rows: Sequence[int] | np.ndarray, host_rows: Sequence[int] | np.ndarray) -> list[Run]:
    """Split paired row lists into (device_start, host_start, length) runs that
    are consecutive on both sides, so each run is one slice copy."""
    runs: list[Run] = []
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
        """Every load has landed before the forward pass reads it (``HostTierWorker``),
        so a tier hit can be scheduled in the step that finds it
        (``connectors.offloading``)."""
        return not platform_has_upstream_worker()

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if platform_has_upstream_worker():
            return super().get_worker(kv_caches)
        if self._host_worker is None:
            self._host_worker = HostTierWorker(
                kv_caches,
                self.blocks_per_chunk,
                self.num_chunks,
                copy_thread=tier_copy_thread_wanted(self.extra_config),
                thread_min_load_bytes=int((self.extra_config or {}).get(TIER_COPY_THREAD_MIN_LOAD_BYTES_KEY, 0)),
            )
        return self._host_worker

    _host_worker: HostTierWorker | None = None
