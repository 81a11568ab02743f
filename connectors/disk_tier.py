"""A disk tier under the host tier: KV that survives a restart.

Blocks are written through: each chunk the host tier stores is also written to a
file, content-addressed by its offload key (the block hash and KV group) in
vLLM's ``FileMapper`` layout (``<base>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin``, its
model named by its weights' fingerprint rather than its path), under a namespace
directory that fingerprints what the bytes depend on and block hashes do not cover:
the weights (vLLM PR #57810), the chunk's byte size and our file format.
Write-through, not write-back on eviction: a parked session's KV is on disk as soon
as it is in the host tier, so ``kill -9`` loses at most the writes
still queued (the writer's backlog, bounded by ``disk_tier_write_queue_bytes``),
where write-back would lose every block the host tier held.

Why not vLLM's ``TieringOffloadingSpec`` with its file-system tier: it moves bytes
through a ``/dev/shm`` region shared by the scheduler and the worker (named by a
per-start engine id and unlinked only on a clean exit, so a ``kill -9`` leaks it),
loads from disk asynchronously (our host worker's loads are synchronous: see
``connectors.offloading``), and in vLLM 0.32 its files have no checksum, no size
cap and no eviction. Here the scheduler side (``DiskTierManager``) keeps the index
(rebuilt from the directory's names and mtimes on a thread at start), verifies a
file's checksum before it reports a hit (a file that fails is deleted: a miss), pins
files being read and evicts the least recently used past the cap; the worker side
(``DiskTierWorker``) writes files on a thread and reads them into the host tier
inside ``submit_load``, before the chunk's pages reach the device.

The files, their index and their writer are in ``connectors.disk_files``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zlib
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TransferResult,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connectors import (
    DISK_TIER_BYTES_KEY,
    DISK_TIER_DIR_KEY,
    DISK_TIER_FLUSH_UTILITY,
    DISK_TIER_FSYNC_KEY,
    DISK_TIER_SHARED_KEY,
    DISK_TIER_TOKENS_UTILITY,
    DISK_TIER_WRITE_QUEUE_BYTES_KEY,
)
from connectors.compat import TIER_COPY_THREAD_MIN_LOAD_BYTES_KEY, tier_copy_thread_wanted
from connectors.disk_files import HEADER, MAGIC, DiskIndex, FileWriter, writer_cpus
from connectors.host_tier import (
    HostTierOffloadingSpec,
    HostTierWorker,
    platform_has_upstream_worker,
)

logger = logging.getLogger("vllm.streamsess.disk_tier")


FORMAT = "streamsess-kv-v1"  # in the namespace: a new format never reads an old file
# The weights fingerprint reads this many evenly spaced samples of each weight file
# (and its size and name), not every byte: a multi-GB checkpoint is fingerprinted in
# milliseconds, and two checkpoints of one shape differ in practically every sample.
SAMPLES, SAMPLE_BYTES = 64, 64 * 1024
# Prometheus, through vLLM's offloading metrics (the gauges, then the counters).
METRIC_PREFIX = "vllm:kv_offload_disk_tier_"
GAUGES = {
    "bytes": "Bytes of KV files in the disk tier this replica knows (queued writes included).",
    "files": "KV files in the disk tier this replica knows (queued writes included).",
    "directory_bytes": "A shared disk tier: bytes of every replica's files, at the last sweep.",
    "cap_bytes": "The disk tier's size cap.",
}
COUNTERS = {
    "hits": "Disk-tier lookups that found a whole file.",
    "misses": "Disk-tier lookups (of keys not in host memory) that found none.",
    "foreign_hits": "A shared disk tier: hits on files another replica wrote.",
    "evictions": "Disk-tier files deleted to keep the tier within its size.",
    "checksum_failures": "Disk-tier files that failed their checksum (deleted: a miss).",
    "vanished": "A shared disk tier: files another replica deleted after this one saw them (a miss).",
}
# The writer's backlog, at most: a 8,192-token prefill of the bench model in float32
# stores about 380 MB in one step, and a write dropped is a miss after a restart.
WRITE_QUEUE_BYTES = 1 << 30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# A load's files are read this many at a time (reads release the GIL): the 254 files of
# an 8K-token float32 resume of the bench model, read from the page cache apart from the
# engine, in 29 ms instead of 49 one after another (EPYC, 2 cores).
READ_THREADS = 2


def weights_fingerprint(model: str) -> str:
    """What the model's KV depends on beyond its config: a digest of its weight files
    (names, sizes, sampled content). A name that is not a local directory is taken by
    its name alone (logged: a changed checkpoint under that name is not noticed)."""
    root = Path(model)
    files = sorted(p for p in root.rglob("*") if p.suffix in WEIGHT_SUFFIXES) if root.is_dir() else []
    digest = hashlib.sha256()
    if not files:
        logger.warning("disk tier: %s is not a local model directory; its namespace is its name alone", model)
        digest.update(b"name:" + model.encode())
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(root)}:{size}\n".encode())
        with path.open("rb") as weights:
            for offset in sorted({size * i // SAMPLES for i in range(SAMPLES)} | {max(size - SAMPLE_BYTES, 0)}):
                weights.seek(offset)
                digest.update(weights.read(SAMPLE_BYTES))
    return digest.hexdigest()


def file_mapper(spec: Any) -> FileMapper:
    """vLLM's file layout, under a namespace for the weights, the chunk size and our format.
    vLLM's layout names the model by its path; ours by its weights' fingerprint instead, so
    the same weights at another path (a moved cache, another replica's mount) share files
    and other weights at the same path (a checkpoint replaced in place) share none."""
    weights = weights_fingerprint(spec.config.model.name)
    namespace = {
        "format": FORMAT,
        "weights": weights,
        "kv_bytes_per_chunk": spec.kv_bytes_per_chunk,
        "blocks_per_chunk": spec.blocks_per_chunk,
    }
    name = hashlib.sha256(repr(sorted(namespace.items())).encode()).hexdigest()[:16]
    config = replace(spec.config, model=replace(spec.config.model, name=f"weights-{weights[:16]}"))
    renamed: Any = SimpleNamespace(config=config)  # all that from_offloading_spec reads of a spec
    return FileMapper.from_offloading_spec(os.path.join(spec.extra_config[DISK_TIER_DIR_KEY], name), renamed)


class DiskFiles(CPULoadStoreSpec):
    """Host chunks, with the files to write after storing them or to read before loading
    them: ``(chunk_id, group_idx, path)`` each. ``locked``: files to read whose bytes the
    scheduler checked under a shared lock it still holds (a shared tier): nothing can
    change or delete them before the load, so the load does not check them again."""

    def __init__(self, block_ids: Iterable[int], files: list[tuple[int, int, str]], locked: Collection[str] = ()):
        super().__init__(list(block_ids))
        self.files = files
        self.locked = frozenset(locked)


class DiskTierManager(CPUOffloadingManager):
    """The host tier's manager, with the disk tier under it: a key missing from host
    memory is a hit if its file is whole; loading it first takes a host chunk for it,
    which the worker fills from the file."""

    def __init__(self, disk: DiskIndex, **kwargs: Any):
        super().__init__(**kwargs)
        self.disk = disk
        self._loading_from_disk: set[OffloadKey] = set()  # for vLLM's hits by source

    def verify_ahead(self, keys: list[OffloadKey]) -> None:
        """Before a request's lookups: check its keys' files that host memory lacks."""
        self.disk.verify_ahead([key for key in keys if self._policy.get(key) is None])

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        result = super().lookup(key, req_context)
        if result is not LookupResult.MISS:
            return result
        hit = self.disk.verify(key)
        self.disk.counts["hits" if hit else "misses"] += 1
        if hit and key in self.disk.foreign:
            self.disk.counts["foreign_hits"] += 1
        return LookupResult.HIT if hit else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        in_host: list[OffloadKey] = []
        from_disk: list[OffloadKey] = []
        for key in keys:
            (in_host if self._policy.get(key) is not None else from_disk).append(key)
        # Every key loaded is used, from the CPU tier too: its file must not age out of the
        # disk tier while the session is hot in host memory (vLLM 0.32 never calls touch()).
        # About 3 us a key (utime), so the order survives a restart.
        self.disk.touch(keys)
        if not from_disk:
            return super().prepare_load(keys, req_context)
        # Pin the keys in host memory first, so taking chunks for the others cannot evict them.
        self._prepare_load(in_host, req_context, record_access=True)
        taken = super().prepare_store(from_disk, req_context)
        if taken is None or len(taken.keys_to_store) != len(from_disk):
            raise RuntimeError(
                "disk tier: no room in the CPU tier for a disk hit (every chunk is in use); "
                "give the CPU tier more room (cpu_tier_gib)"
            )
        super().complete_store(from_disk, req_context)  # filled by the worker before the load reads them
        self._prepare_load(from_disk, req_context, record_access=True)
        self.disk.pin(from_disk)
        self._loading_from_disk.update(from_disk)
        chunk_ids = {key: self._policy.get(key).chunk_id for key in keys}  # type: ignore[union-attr]
        reads = [(chunk_ids[key], get_offload_group_idx(key), self.disk.path(key)) for key in from_disk]
        locked = [self.disk.path(key) for key in from_disk if self.disk.shared and self.disk.checked(key)]
        return DiskFiles((chunk_ids[key] for key in keys), reads, locked)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        super().complete_load(keys, req_context)
        self.disk.unpin(keys)
        self._loading_from_disk.difference_update(keys)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        super().touch(keys, req_context)  # not called by vLLM 0.32 (prepare_load touches instead)
        self.disk.touch(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        output = super().prepare_store(keys, req_context)
        if output is None or not output.keys_to_store:
            return output
        assert isinstance(output.store_spec, CPULoadStoreSpec)
        chunk_ids = [int(chunk) for chunk in output.store_spec.block_ids]
        new = [(key, chunk) for key, chunk in zip(output.keys_to_store, chunk_ids) if not self.disk.has(key)]
        writes = [(chunk, get_offload_group_idx(key), self.disk.path(key)) for key, chunk in new]
        self.disk.add(key for key, _ in new)
        return PrepareStoreOutput(
            keys_to_store=output.keys_to_store,
            store_spec=DiskFiles(chunk_ids, writes),
            evicted_keys=output.evicted_keys,
        )

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.DISK if key in self._loading_from_disk else super().get_load_source(key, req_context)

    def reset_cache(self) -> None:
        super().reset_cache()
        self.disk.clear()  # a reset means no cached KV is served, from any tier

    def get_stats(self) -> Any:
        stats = super().get_stats()
        if stats is not None:
            self.disk.rebuilding()  # merged once done: the gauges count every file
            stats.set_gauge(METRIC_PREFIX + "bytes", self.disk.bytes)
            stats.set_gauge(METRIC_PREFIX + "files", len(self.disk.files))
            stats.set_gauge(METRIC_PREFIX + "cap_bytes", self.disk.cap_bytes)
            if self.disk.shared:
                self.disk.sweep()  # takes a finished sweep's figures (and evictions)
                stats.set_gauge(METRIC_PREFIX + "directory_bytes", self.disk.directory_bytes)
            for name in COUNTERS:
                if self.disk.counts[name]:
                    stats.increase_counter(METRIC_PREFIX + name, self.disk.counts.pop(name))
        return stats


class DiskTierWorker(HostTierWorker):
    """The host worker, writing each stored chunk to its file (on a thread, from a copy
    of its pages taken when the store completes: the chunk may be reused after) and
    reading a disk hit's file into its host chunk before the load copies it."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_chunks: int,
        fsync: bool,
        queue_bytes: int,
        **kwargs: Any,
    ):
        super().__init__(kv_caches, blocks_per_chunk, num_chunks, **kwargs)
        self._writes: dict[int, list[tuple[int, int, str]]] = {}
        self._writer = FileWriter(fsync, queue_bytes, writer_cpus())
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="streamsess-disk-tier-read")

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        if isinstance(dst_spec, DiskFiles) and dst_spec.files:
            self._writes[job_id] = dst_spec.files
        return super().submit_store(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        if isinstance(src_spec, DiskFiles):
            reads = [
                self._readers.submit(self._read, chunk, group, path, path not in src_spec.locked)
                for chunk, group, path in src_spec.files
            ]
            for read in reads:
                read.result()  # every file in its host chunk before the copy; a failed read raises
        return super().submit_load(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        finished = super().get_finished()
        for result in finished:
            for chunk, group, path in self._writes.pop(result.job_id, ()):
                self._writer.put(
                    path, [self.host_pages[t][chunk].numpy().tobytes() for t in self.group_tensor_ids[group]]
                )
        return finished

    def flush(self) -> int:
        """Write every file queued so far (the session service's graceful stop)."""
        return self._writer.flush()

    def shutdown(self) -> None:
        super().shutdown()
        self._writer.stop()
        self._readers.shutdown(wait=False)

    def _read(self, chunk: int, group: int, path: str, check: bool = True) -> None:
        rows = [self.host_pages[t][chunk].numpy() for t in self.group_tensor_ids[group]]
        with open(path, "rb") as file:
            magic, size, crc = HEADER.unpack(file.read(HEADER.size))
            if magic != MAGIC or size != sum(row.nbytes for row in rows):
                raise RuntimeError(f"disk tier: {path} does not hold this chunk's pages")
            read_crc = 0
            for row in rows:
                view = memoryview(row)  # type: ignore[arg-type]
                file.readinto(view)
                if check:
                    read_crc = zlib.crc32(view, read_crc)
        if check and read_crc != crc:  # verified at lookup: changed since, which nothing here does
            raise RuntimeError(f"disk tier: {path} changed after it was verified")


class DiskTierOffloadingSpec(HostTierOffloadingSpec):
    """The host tier with a disk tier under it (the CPU platform's host worker only)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        definitions = super().build_metric_definitions(extra_config)
        definitions.update(
            {METRIC_PREFIX + name: OffloadingGaugeMetadata(documentation=text) for name, text in GAUGES.items()}
        )
        definitions.update(
            {METRIC_PREFIX + name: OffloadingCounterMetadata(documentation=text) for name, text in COUNTERS.items()}
        )
        return definitions

    def get_manager(self) -> DiskTierManager:
        if self._manager is None:
            disk = DiskIndex(
                file_mapper(self),
                int(self.extra_config[DISK_TIER_BYTES_KEY]),
                HEADER.size + self.kv_bytes_per_chunk,
                shared=bool(self.extra_config.get(DISK_TIER_SHARED_KEY, False)),
            )
            self._manager = DiskTierManager(
                disk,
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
        assert isinstance(self._manager, DiskTierManager)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if platform_has_upstream_worker():
            raise RuntimeError(
                "the disk tier runs on the CPU platform's host tier only; on a GPU use vLLM's "
                "TieringOffloadingSpec with its file-system tier"
            )
        if self._host_worker is None:
            extra = self.extra_config
            self._host_worker = DiskTierWorker(
                kv_caches,
                self.blocks_per_chunk,
                self.num_chunks,
                fsync=bool(extra.get(DISK_TIER_FSYNC_KEY, False)),
                queue_bytes=int(extra.get(DISK_TIER_WRITE_QUEUE_BYTES_KEY, WRITE_QUEUE_BYTES)),
                copy_thread=tier_copy_thread_wanted(extra),
                thread_min_load_bytes=int(extra.get(TIER_COPY_THREAD_MIN_LOAD_BYTES_KEY, 0)),
            )
        return self._host_worker


def flush_writer(worker: Any) -> int:
    """In a worker process (by ``collective_rpc``): write every file queued; how many."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    tier = getattr(getattr(connector, "connector_worker", None), "worker", None)
    return tier.flush() if isinstance(tier, DiskTierWorker) else 0


def install_engine_core_utilities() -> None:
    """Give vLLM's engine core two utility calls of the disk tier, for the API process:

    - ``DISK_TIER_TOKENS_UTILITY`` hands over the disk-tier tokens our connector recorded
      for requests. vLLM's outputs carry a request's external hits as one number
      (``PrefillStats``), and its hits by source reach only aggregate metrics; this is
      the one per-request channel from the scheduler's process.
    - ``DISK_TIER_FLUSH_UTILITY`` returns how many requests and transfers are still
      pending; with none, it first has every worker write the files it has queued. A
      graceful stop calls it until it returns 0, so parked sessions are on disk before
      the engine's processes are stopped.

    Idempotent; run where this module is imported, the engine core among them."""
    from vllm.v1.engine.core import EngineCore

    if hasattr(EngineCore, DISK_TIER_TOKENS_UTILITY):
        return

    def disk_tier_tokens(self: Any, request_ids: list[str]) -> dict[str, int]:
        take = getattr(getattr(self.scheduler, "connector", None), "take_disk_tier_tokens", None)
        return take(request_ids) if take is not None else {}

    def disk_tier_flush(self: Any) -> int:
        connector = getattr(self.scheduler, "connector", None)
        pending = len(getattr(getattr(connector, "connector_scheduler", None), "_jobs", ()))
        pending += int(self.scheduler.has_requests())
        if not pending:
            self.collective_rpc(flush_writer)
        return pending

    setattr(EngineCore, DISK_TIER_TOKENS_UTILITY, disk_tier_tokens)
    setattr(EngineCore, DISK_TIER_FLUSH_UTILITY, disk_tier_flush)


install_engine_core_utilities()
