"""A disk tier under the host tier: KV that survives a restart.

Blocks are written through: each chunk the host tier stores is also written to a
file, content-addressed by its offload key (the block hash and KV group) in
vLLM's ``FileMapper`` layout (``<base>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin``, its
model named by its weights' fingerprint rather than its path), under a namespace
directory that fingerprints what the bytes depend on and block hashes do not cover:
the weights (vLLM PR #57810), the chunk's byte size and our file format. Write-through, not write-back on eviction: a parked session's KV is on
disk as soon as it is in the host tier, so ``kill -9`` loses at most the writes
still queued (the writer's backlog, bounded by ``disk_tier_write_queue_bytes``),
where write-back would lose every block the host tier held.

Why not vLLM's ``TieringOffloadingSpec`` with its file-system tier: it moves bytes
through a ``/dev/shm`` region shared by the scheduler and the worker (named by a
per-start engine id and unlinked only on a clean exit, so a ``kill -9`` leaks it),
loads from disk asynchronously (our host worker's loads are synchronous: see
``connectors.offloading``), and in vLLM 0.32 its files have no checksum, no size
cap and no eviction. Here the scheduler side (``DiskTierManager``) keeps the index
(rebuilt from the directory at start, from names and mtimes alone), verifies a
file's checksum before it reports a hit (a file that fails is deleted: a miss), pins
files being read and evicts the least recently used past the cap; the worker side
(``DiskTierWorker``) writes files on a thread and reads them into the host tier
inside ``submit_load``, before the chunk's pages reach the device.

File format: a header (magic, payload bytes, CRC-32 of the payload), then the
chunk's host pages, tensor by tensor of its KV group. Written to a temporary file,
optionally fsynced, renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
import time
import zlib
from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
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
    make_offload_key,
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
    DISK_TIER_TOKENS_UTILITY,
    DISK_TIER_WRITE_QUEUE_BYTES_KEY,
)
from connectors.compat import TIER_COPY_THREAD_MIN_LOAD_BYTES_KEY, tier_copy_thread_wanted
from connectors.host_tier import (
    HostTierOffloadingSpec,
    HostTierWorker,
    platform_has_upstream_worker,
    spare_cpus,
)

logger = logging.getLogger("vllm.streamsess.disk_tier")


FORMAT = "streamsess-kv-v1"  # in the namespace: a new format never reads an old file
HEADER = struct.Struct("<8sQI")  # magic, payload bytes, CRC-32 of the payload
MAGIC = b"SSKVDT1\n"
# The weights fingerprint reads this many evenly spaced samples of each weight file
# (and its size and name), not every byte: a multi-GB checkpoint is fingerprinted in
# milliseconds, and two checkpoints of one shape differ in practically every sample.
SAMPLES, SAMPLE_BYTES = 64, 64 * 1024
# Prometheus, through vLLM's offloading metrics (the gauges, then the counters).
METRIC_PREFIX = "vllm:kv_offload_disk_tier_"
GAUGES = {"bytes": "Bytes of KV files in the disk tier (queued writes included).",
          "files": "KV files in the disk tier (queued writes included)."}
COUNTERS = {"hits": "Disk-tier lookups that found a whole file.",
            "misses": "Disk-tier lookups (of keys not in host memory) that found none.",
            "evictions": "Disk-tier files deleted to keep the tier within its size.",
            "checksum_failures": "Disk-tier files that failed their checksum (deleted: a miss)."}
# The writer's backlog, at most: a 8,192-token prefill of the bench model in float32
# stores about 380 MB in one step, and a write dropped is a miss after a restart.
WRITE_QUEUE_BYTES = 1 << 30
# Files a lookup checks at once (a virtio or NVMe disk serves parallel reads faster).
VERIFY_THREADS = 8
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


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
    namespace = {"format": FORMAT, "weights": weights,
                 "kv_bytes_per_chunk": spec.kv_bytes_per_chunk, "blocks_per_chunk": spec.blocks_per_chunk}
    name = hashlib.sha256(repr(sorted(namespace.items())).encode()).hexdigest()[:16]
    config = replace(spec.config, model=replace(spec.config.model, name=f"weights-{weights[:16]}"))
    renamed: Any = SimpleNamespace(config=config)  # all that from_offloading_spec reads of a spec
    return FileMapper.from_offloading_spec(os.path.join(spec.extra_config[DISK_TIER_DIR_KEY], name), renamed)


def key_of(path: str) -> OffloadKey:
    """The offload key a file's name holds (``.../<hh>_g<group>/<hash>.bin``)."""
    group = int(os.path.basename(os.path.dirname(path)).rsplit("_g", 1)[1])
    return make_offload_key(bytes.fromhex(os.path.basename(path)[: -len(".bin")]), group)


class DiskFiles(CPULoadStoreSpec):
    """Host chunks, with the files to write after storing them or to read before loading
    them: ``(chunk_id, group_idx, path)`` each."""

    def __init__(self, block_ids: Iterable[int], files: list[tuple[int, int, str]]):
        super().__init__(list(block_ids))
        self.files = files


def scan(root: str) -> list[tuple[int, OffloadKey, int]]:
    """The tier's files under ``root``, least recently used first: (mtime, key, size),
    from names and mtimes alone (no file body is read). Temporary files a crashed
    writer left (older than the scan: a live writer's are newer) are deleted."""
    started = time.time_ns()
    found: list[tuple[int, OffloadKey, int]] = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            try:
                stat = os.stat(path)
            except FileNotFoundError:  # evicted meanwhile
                continue
            if name.endswith(".bin"):
                found.append((stat.st_mtime_ns, key_of(path), stat.st_size))
            elif stat.st_mtime_ns < started:
                _unlink(path)
    return sorted(found)


class DiskIndex:
    """The scheduler's view of the tier's files: least recently used first, with their
    sizes, the ones verified this run, and the ones being read (never evicted).

    It is rebuilt from the directory on a thread: a cold directory walk costs about
    150 us a file (vLLM's layout gives nearly every file a directory of its own), 9 s
    for 60,000 files, and the engine need not wait for it. Until the walk is merged, a
    key the index does not know yet is looked for on disk by its name."""

    def __init__(self, mapper: FileMapper, cap_bytes: int, file_bytes: int):
        self.mapper = mapper
        self.cap_bytes = cap_bytes
        self.file_bytes = file_bytes
        self.files: OrderedDict[OffloadKey, int] = OrderedDict()
        self.bytes = 0
        self._verified: set[OffloadKey] = set()
        self._pins: Counter[OffloadKey] = Counter()
        self.counts: Counter[str] = Counter()  # hits, misses, evictions, checksum_failures
        self._pool = ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="streamsess-disk-tier-check")
        self._root = f"{mapper.base_path}_r{mapper.rank}"
        self._removed: set[OffloadKey] = set()  # while the walk runs: not to be merged back
        self._walk: Future[tuple[list[tuple[int, OffloadKey, int]], float]] | None = self._pool.submit(
            self._timed_scan)

    def _timed_scan(self) -> tuple[list[tuple[int, OffloadKey, int]], float]:
        started = time.monotonic()
        return scan(self._root), time.monotonic() - started

    def rebuilding(self) -> bool:
        """Whether the directory walk is still running (merged here once it is done)."""
        if self._walk is not None and self._walk.done():
            self._merge(*self._walk.result())
        return self._walk is not None

    def wait_rebuilt(self) -> None:
        if self._walk is not None:
            self._walk.result()
        assert not self.rebuilding()

    def _merge(self, found: list[tuple[int, OffloadKey, int]], seconds: float) -> None:
        """The walk's files, oldest first, before the ones used since it began."""
        self._walk = None
        used_since = self.files
        self.files = OrderedDict((key, size) for _, key, size in found
                                 if key not in used_since and key not in self._removed)
        self.files.update(used_since)
        self.bytes = sum(self.files.values())
        self._removed.clear()
        self._evict()
        logger.info("disk tier: %d files, %.1f MiB, in %s (indexed in %.2f s)", len(self.files),
                    self.bytes / 2**20, self._root, seconds)

    def path(self, key: OffloadKey) -> str:
        return self.mapper.get_file_name(key)

    def has(self, key: OffloadKey) -> bool:
        if key in self.files:
            return True
        if self.rebuilding() and os.path.exists(self.path(key)):
            self.files[key] = self.file_bytes  # found before the walk got to it: now used
            self.bytes += self.file_bytes
            return True
        return False

    def verify(self, key: OffloadKey) -> bool:
        """Whether the key's file is there and whole (its checksum read once a run);
        a file that fails its checksum is deleted."""
        if not self.has(key):
            return False
        if key not in self._verified:
            self._settle(key, self._check(key))
        return key in self._verified

    def checked(self, key: OffloadKey) -> bool:
        """Whether the key's file passed its checksum this run."""
        return key in self._verified

    def verify_ahead(self, keys: list[OffloadKey]) -> None:
        """Check the files of a request's keys up to its first miss, ``VERIFY_THREADS`` at
        a time (reads and CRCs release the GIL), so the lookups that follow, one key at a
        time, find them checked: one file after another, a cold 8K-token resume spent most
        of its time waiting on single reads."""
        pending = []
        for key in keys:
            if not self.has(key):
                break
            if key not in self._verified:
                pending.append(key)
        if len(pending) > 1:
            for key, whole in zip(pending, self._pool.map(self._check, pending)):
                self._settle(key, whole)

    def _check(self, key: OffloadKey) -> bool | None:
        """None: no file (not written yet: the writer's queue, or dropped)."""
        try:
            with open(self.path(key), "rb") as file:
                return whole_file(file.read())
        except FileNotFoundError:
            return None

    def _settle(self, key: OffloadKey, whole: bool | None) -> None:
        if whole:
            self._verified.add(key)
        elif whole is False and key in self.files:
            logger.warning("disk tier: %s failed its checksum; deleted", self.path(key))
            self.counts["checksum_failures"] += 1
            self._remove(key)

    def add(self, keys: Iterable[OffloadKey]) -> None:
        """Files about to be written: counted now, so the cap holds for what is queued."""
        self.rebuilding()  # merges a finished walk first, so the cap counts its files
        for key in keys:
            self.files[key] = self.file_bytes
            self.bytes += self.file_bytes
        self._evict()

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if key in self.files:
                self.files.move_to_end(key)
                try:  # the order survives a restart
                    os.utime(self.path(key))
                except FileNotFoundError:
                    pass

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        self._pins.update(keys)

    def unpin(self, keys: Iterable[OffloadKey]) -> None:
        self._pins.subtract(key for key in keys if self._pins[key] > 0)
        self._pins += Counter()  # drop the zeros

    def clear(self) -> None:
        self.wait_rebuilt()  # every file, the ones not indexed yet too
        for key in [key for key in self.files if not self._pins[key]]:
            self._remove(key)

    def _evict(self) -> None:
        for key in list(self.files):
            if self.bytes <= self.cap_bytes:
                return
            if not self._pins[key]:
                self._remove(key)
                self.counts["evictions"] += 1

    def _remove(self, key: OffloadKey) -> None:
        self.bytes -= self.files.pop(key)
        self._verified.discard(key)
        if self._walk is not None:
            self._removed.add(key)
        _unlink(self.path(key))


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
            raise RuntimeError("disk tier: no room in the CPU tier for a disk hit (every chunk is in use); "
                               "give the CPU tier more room (cpu_tier_gib)")
        super().complete_store(from_disk, req_context)  # filled by the worker before the load reads them
        self._prepare_load(from_disk, req_context, record_access=True)
        self.disk.pin(from_disk)
        self._loading_from_disk.update(from_disk)
        chunk_ids = {key: self._policy.get(key).chunk_id for key in keys}  # type: ignore[union-attr]
        reads = [(chunk_ids[key], get_offload_group_idx(key), self.disk.path(key)) for key in from_disk]
        return DiskFiles((chunk_ids[key] for key in keys), reads)

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
        return PrepareStoreOutput(keys_to_store=output.keys_to_store, store_spec=DiskFiles(chunk_ids, writes),
                                  evicted_keys=output.evicted_keys)

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
            for name in COUNTERS:
                if self.disk.counts[name]:
                    stats.increase_counter(METRIC_PREFIX + name, self.disk.counts.pop(name))
        return stats


class DiskTierWorker(HostTierWorker):
    """The host worker, writing each stored chunk to its file (on a thread, from a copy
    of its pages taken when the store completes: the chunk may be reused after) and
    reading a disk hit's file into its host chunk before the load copies it."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int,
                 fsync: bool, queue_bytes: int, **kwargs: Any):
        super().__init__(kv_caches, blocks_per_chunk, num_chunks, **kwargs)
        self._writes: dict[int, list[tuple[int, int, str]]] = {}
        self._writer = FileWriter(fsync, queue_bytes, writer_cpus())

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        if isinstance(dst_spec, DiskFiles) and dst_spec.files:
            self._writes[job_id] = dst_spec.files
        return super().submit_store(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        if isinstance(src_spec, DiskFiles):
            for chunk, group, path in src_spec.files:
                self._read(chunk, group, path)
        return super().submit_load(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        finished = super().get_finished()
        for result in finished:
            for chunk, group, path in self._writes.pop(result.job_id, ()):
                self._writer.put(path, [self.host_pages[t][chunk].numpy().tobytes()
                                        for t in self.group_tensor_ids[group]])
        return finished

    def flush(self) -> int:
        """Write every file queued so far (the session service's graceful stop)."""
        return self._writer.flush()

    def shutdown(self) -> None:
        super().shutdown()
        self._writer.stop()

    def _read(self, chunk: int, group: int, path: str) -> None:
        rows = [self.host_pages[t][chunk].numpy() for t in self.group_tensor_ids[group]]
        with open(path, "rb") as file:
            magic, size, crc = HEADER.unpack(file.read(HEADER.size))
            if magic != MAGIC or size != sum(row.nbytes for row in rows):
                raise RuntimeError(f"disk tier: {path} does not hold this chunk's pages")
            check = 0
            for row in rows:
                view = memoryview(row)  # type: ignore[arg-type]
                file.readinto(view)
                check = zlib.crc32(view, check)
        if check != crc:  # verified at lookup: changed since, which nothing here does
            raise RuntimeError(f"disk tier: {path} changed after it was verified")


def writer_cpus() -> set[int]:
    """The CPUs no compute thread is bound to; with none, every CPU of the engine (the
    writer, at the lowest priority, then takes whichever is idle, not always the one its
    creator's compute thread is bound to)."""
    cpus = spare_cpus()
    if not cpus:
        with contextlib.suppress(OSError, AttributeError):
            cpus = os.sched_getaffinity(os.getppid())
    return cpus


def whole_file(data: bytes) -> bool:
    if len(data) < HEADER.size:
        return False
    magic, size, crc = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size:]
    return magic == MAGIC and size == len(payload) and zlib.crc32(payload) == crc


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class FileWriter:
    """Writes files on one thread: to a temporary name, optionally fsynced, renamed into
    place. A backlog past ``queue_bytes`` drops the newest write (its key is then a miss:
    the tier is a cache), so a slow disk never holds up the engine.

    The thread runs at the lowest priority, on ``cpus`` when given (the CPUs no compute
    thread is bound to): left on a compute thread's CPU, as it would be by inheriting
    the worker's main thread's, it stalls the forward pass, whose OpenMP threads wait
    for each other (measured: 0.71x throughput at 4 sessions, docs/benchmarks.md)."""

    def __init__(self, fsync: bool, queue_bytes: int, cpus: Collection[int] = ()):
        self._cpus = set(cpus)
        self._fsync = fsync
        self._queue_bytes = queue_bytes
        self._queued_bytes = 0
        self._queue: deque[tuple[str, list[bytes], int]] = deque()  # path, parts, their bytes
        self._cond = threading.Condition()
        self._stopped = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="streamsess-disk-tier-writer", daemon=True)
        self._thread.start()

    def put(self, path: str, parts: list[bytes]) -> None:
        size = sum(len(part) for part in parts)
        with self._cond:
            if self._queued_bytes + size > self._queue_bytes:
                self.dropped += 1
                return
            self._queue.append((path, parts, size))
            self._queued_bytes += size
            self._cond.notify()

    def flush(self) -> int:
        """Wait until every queued file is written; how many were queued."""
        with self._cond:
            queued = len(self._queue)
            self._cond.wait_for(lambda: self._queued_bytes == 0 or self._stopped)
        return queued

    def stop(self) -> None:
        self.flush()
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux: as it is
            if self._cpus:
                os.sched_setaffinity(0, self._cpus)  # this thread only
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: per thread
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopped)
                if not self._queue:
                    return
                path, parts, size = self._queue[0]
            try:
                self._write(path, parts, size)
            except OSError as exc:  # a full or failing disk: a miss later, not an engine error
                logger.warning("disk tier: writing %s failed: %s", path, exc)
            with self._cond:
                self._queue.popleft()
                self._queued_bytes -= size
                self._cond.notify_all()

    def _write(self, path: str, parts: list[bytes], size: int) -> None:
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "wb") as file:
            file.write(HEADER.pack(MAGIC, size, crc))
            for part in parts:
                file.write(part)
            if self._fsync:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, path)


class DiskTierOffloadingSpec(HostTierOffloadingSpec):
    """The host tier with a disk tier under it (the CPU platform's host worker only)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        definitions = super().build_metric_definitions(extra_config)
        definitions.update({METRIC_PREFIX + name: OffloadingGaugeMetadata(documentation=text)
                            for name, text in GAUGES.items()})
        definitions.update({METRIC_PREFIX + name: OffloadingCounterMetadata(documentation=text)
                            for name, text in COUNTERS.items()})
        return definitions

    def get_manager(self) -> DiskTierManager:
        if self._manager is None:
            disk = DiskIndex(file_mapper(self), int(self.extra_config[DISK_TIER_BYTES_KEY]),
                             HEADER.size + self.kv_bytes_per_chunk)
            self._manager = DiskTierManager(
                disk, num_chunks=self.num_chunks, cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
        assert isinstance(self._manager, DiskTierManager)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if platform_has_upstream_worker():
            raise RuntimeError("the disk tier runs on the CPU platform's host tier only; on a GPU use vLLM's "
                               "TieringOffloadingSpec with its file-system tier")
        if self._host_worker is None:
            extra = self.extra_config
            self._host_worker = DiskTierWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks,
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
