"""The disk tier's files: their format, their index, and the thread that writes them.

A file holds one offload chunk of one KV group: a header (magic, payload bytes, CRC-32
of the payload), then the chunk's host pages, tensor by tensor of its group. Written
to a temporary name, optionally fsynced, linked into place (never over a file already
there), so a reader never sees half a file; one that fails its checksum is deleted and
is a miss. The index
(``DiskIndex``) is the scheduler's view of them; ``connectors.disk_tier`` wires both
into vLLM's offloading manager and the host tier's worker.

A directory may be shared by several replicas (``shared``: an NFS or ReadWriteMany
volume every replica mounts). Then the directory is the truth, not the index: a key is
looked for by its name, so a file another replica wrote is a hit; a file is read under a
shared ``flock`` held from its checksum check until its load is done, and deleted only
under an exclusive one, so no replica deletes a file another is reading; and one
replica at a time (the holder of the directory's sweep lock) keeps the whole directory
within its cap, oldest files (by mtime, which every use refreshes) first. A file gone
or corrupt by the time it is checked is a counted miss, never a failed load.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import struct
import threading
import time
import zlib
from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from vllm.v1.kv_offload.base import OffloadKey, make_offload_key
from vllm.v1.kv_offload.file_mapper import FileMapper

from connectors.host_tier import spare_cpus

logger = logging.getLogger("vllm.streamsess.disk_tier")

HEADER = struct.Struct("<8sQI")  # magic, payload bytes, CRC-32 of the payload
MAGIC = b"SSKVDT1\n"
# Files a lookup checks at once (a virtio or NVMe disk serves parallel reads faster).
VERIFY_THREADS = 8
# Shared directories: how long a file checked for a load stays locked if its load never
# comes (a request aborted between its lookup and its load); how often a replica that
# writes sweeps the directory to its cap; the sweep's lock file; how old a temporary
# file must be for a scan to take it for a crashed writer's (another replica's live
# writes are younger).
HOLD_S = 30.0
SWEEP_INTERVAL_S = 1.0
SWEEP_LOCK = ".sweep.lock"
SHARED_STALE_TEMPORARY_S = 60.0


def key_of(path: str) -> OffloadKey:
    """The offload key a file's name holds (``.../<hh>_g<group>/<hash>.bin``)."""
    group = int(os.path.basename(os.path.dirname(path)).rsplit("_g", 1)[1])
    return make_offload_key(bytes.fromhex(os.path.basename(path)[: -len(".bin")]), group)


def scan(root: str, stale_s: float = 0.0) -> list[tuple[int, OffloadKey, int]]:
    """The tier's files under ``root``, least recently used first: (mtime, key, size),
    from names and mtimes alone (no file body is read). Temporary files a crashed
    writer left (older than the scan by ``stale_s``: a live writer's are newer) are deleted."""
    started = time.time_ns() - int(stale_s * 1e9)
    found: list[tuple[int, OffloadKey, int]] = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            try:
                stat = os.stat(path)
            except FileNotFoundError:  # evicted meanwhile
                continue
            if name.endswith(".bin") and "_g" in os.path.basename(directory):
                found.append((stat.st_mtime_ns, key_of(path), stat.st_size))
            elif name.endswith(".tmp") and stat.st_mtime_ns < started:
                _unlink(path)
    return sorted(found)


class DiskIndex:
    """The scheduler's view of the tier's files: least recently used first, with their
    sizes, the ones verified this run, and the ones being read (never evicted).

    It is rebuilt from the directory on a thread: a cold directory walk costs about
    150 us a file (vLLM's layout gives nearly every file a directory of its own), 9 s
    for 60,000 files, and the engine need not wait for it. Until the walk is merged, a
    key the index does not know yet is looked for on disk by its name."""

    def __init__(self, mapper: FileMapper, cap_bytes: int, file_bytes: int, shared: bool = False):
        self.mapper = mapper
        self.shared = shared
        # Shared: the files checked for a load, each open with a shared lock (fd, since).
        self._held: dict[OffloadKey, tuple[int, float]] = {}
        self.foreign: set[OffloadKey] = set()  # shared: found by name, so another replica's
        self._seen: set[OffloadKey] = set()  # shared: found on disk (a miss since: deleted by another)
        self.directory_bytes = 0  # shared: the whole directory, at the last sweep
        self._swept_at = 0.0
        self._sweep: Future[tuple[int, list[OffloadKey]] | None] | None = None
        self.cap_bytes = cap_bytes
        self.file_bytes = file_bytes
        self.files: OrderedDict[OffloadKey, int] = OrderedDict()
        self.bytes = 0
        self._verified: set[OffloadKey] = set()
        self._pins: Counter[OffloadKey] = Counter()
        self.counts: Counter[str] = Counter()  # hits, misses, evictions, checksum_failures, ...
        self._pool = ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="streamsess-disk-tier-check")
        self._root = f"{mapper.base_path}_r{mapper.rank}"
        self._removed: set[OffloadKey] = set()  # while the walk runs: not to be merged back
        self._walk: Future[tuple[list[tuple[int, OffloadKey, int]], float]] | None = self._pool.submit(self._timed_scan)

    def _timed_scan(self) -> tuple[list[tuple[int, OffloadKey, int]], float]:
        started = time.monotonic()
        found = scan(self._root, SHARED_STALE_TEMPORARY_S) if self.shared else scan(self._root)
        return found, time.monotonic() - started

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
        self.files = OrderedDict(
            (key, size) for _, key, size in found if key not in used_since and key not in self._removed
        )
        self.files.update(used_since)
        self.bytes = sum(self.files.values())
        self._removed.clear()
        self._evict()
        logger.info(
            "disk tier: %d files, %.1f MiB, in %s (indexed in %.2f s)",
            len(self.files),
            self.bytes / 2**20,
            self._root,
            seconds,
        )

    def path(self, key: OffloadKey) -> str:
        return self.mapper.get_file_name(key)

    def has(self, key: OffloadKey) -> bool:
        if self.shared:  # the directory is the truth: other replicas write and delete
            if not os.path.exists(self.path(key)):
                if key in self._seen:  # deleted by another replica since this one saw it
                    self.counts["vanished"] += 1
                    self._forget(key)
                return False
            self._seen.add(key)
            if key not in self.files:
                if not self.rebuilding():
                    self.foreign.add(key)  # neither written here nor here at the start
                self.files[key] = self.file_bytes
                self.bytes += self.file_bytes
            return True
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
        if self.shared and key in self._held:  # checked and locked since: nobody has deleted it
            return True
        if not self.has(key):
            return False
        if not self.checked(key):
            self._settle(key, *self._probe(key))
        return self.checked(key)

    def checked(self, key: OffloadKey) -> bool:
        """Whether the key's file passed its checksum this run (shared: and is locked for its load)."""
        return key in (self._held if self.shared else self._verified)

    def verify_ahead(self, keys: list[OffloadKey]) -> None:
        """Check the files of a request's keys up to its first miss, ``VERIFY_THREADS`` at
        a time (reads and CRCs release the GIL), so the lookups that follow, one key at a
        time, find them checked: one file after another, a cold 8K-token resume spent most
        of its time waiting on single reads."""
        if self.shared:
            self._release_stale()  # once a request, not once a key: lookups are a hot path
        pending = []
        for key in keys:
            if not self.has(key):
                break
            if not self.checked(key):
                pending.append(key)
        if len(pending) > 1:
            for key, (whole, fd) in zip(pending, self._pool.map(self._probe, pending)):
                self._settle(key, whole, fd)

    def _probe(self, key: OffloadKey) -> tuple[bool | None, int | None]:
        """Whether the key's file is whole (None: no file: not written yet, the writer's
        queue, dropped, or deleted by another replica); shared, with the file open under
        a shared lock when it is whole."""
        return _check_and_lock(self.path(key)) if self.shared else (_check(self.path(key)), None)

    def _settle(self, key: OffloadKey, whole: bool | None, fd: int | None = None) -> None:
        if whole:
            if fd is None:
                self._verified.add(key)
            elif key in self._held:  # checked twice at once: one lock is enough
                os.close(fd)
            else:
                self._held[key] = (fd, time.monotonic())
        elif whole is False and key in self.files:
            logger.warning("disk tier: %s failed its checksum; deleted", self.path(key))
            self.counts["checksum_failures"] += 1
            self._remove(key)
        elif whole is None and self.shared and key in self._seen:
            self.counts["vanished"] += 1  # deleted by another replica since it was seen
            self._forget(key)

    def add(self, keys: Iterable[OffloadKey]) -> None:
        """Files about to be written: counted now, so the cap holds for what is queued."""
        self.rebuilding()  # merges a finished walk first, so the cap counts its files
        for key in keys:
            self.files[key] = self.file_bytes
            self.bytes += self.file_bytes
        self._evict()

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if key in self.files or self.shared:  # shared: the sweep orders by mtime
                if key in self.files:
                    self.files.move_to_end(key)
                try:  # the order survives a restart
                    os.utime(self.path(key))
                except FileNotFoundError:
                    pass

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        self._pins.update(keys)

    def unpin(self, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        self._pins.subtract(key for key in keys if self._pins[key] > 0)
        self._pins += Counter()  # drop the zeros
        for key in keys:
            if not self._pins[key]:
                self._release(key)  # loaded: another replica's sweep may delete it again

    def _release(self, key: OffloadKey) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            os.close(held[0])

    def _release_stale(self) -> None:
        """Locks of files checked for a load that never came."""
        now = time.monotonic()
        for key in [key for key, (_, since) in self._held.items() if now - since > HOLD_S and not self._pins[key]]:
            self._release(key)

    def clear(self) -> None:
        self.wait_rebuilt()  # every file, the ones not indexed yet too
        for key in [key for key in self.files if not self._pins[key]]:
            self._remove(key)

    def _evict(self) -> None:
        if self.shared:
            self.sweep()
            return
        for key in list(self.files):
            if self.bytes <= self.cap_bytes:
                return
            if not self._pins[key]:
                self._remove(key)
                self.counts["evictions"] += 1

    def _remove(self, key: OffloadKey) -> None:
        if self.shared and not _unlink_unless_read(self.path(key)):
            return  # another replica is reading it: kept
        self._forget(key)
        if not self.shared:
            _unlink(self.path(key))

    def _forget(self, key: OffloadKey) -> None:
        self.bytes -= self.files.pop(key, 0)
        self._verified.discard(key)
        self.foreign.discard(key)
        self._seen.discard(key)
        if self._walk is not None:
            self._removed.add(key)

    # ------------------------------------------------------------------ shared directories
    def sweep(self, wait: bool = False) -> None:
        """Shared: keep the whole directory within the cap, on a thread, at most every
        ``SWEEP_INTERVAL_S`` (``wait``: now, and return once done). The replica that holds
        the directory's sweep lock deletes the oldest files no replica is reading; the
        others skip their turn."""
        self._sweep_done(wait=False)
        if self._sweep is None and (wait or time.monotonic() - self._swept_at >= SWEEP_INTERVAL_S):
            self._swept_at = time.monotonic()
            self._sweep = self._pool.submit(self._sweep_directory, set(self._pins), set(self._held))
        self._sweep_done(wait)

    def _sweep_done(self, wait: bool) -> None:
        """Take a sweep's figures once it is done (``wait``: wait for it)."""
        if self._sweep is None or not (wait or self._sweep.done()):
            return
        done, self._sweep = self._sweep.result(), None
        if done is not None:
            self.directory_bytes, evicted = done
            for key in evicted:
                self._forget(key)
            self.counts["evictions"] += len(evicted)

    def _sweep_directory(self, pinned: set[OffloadKey], held: set[OffloadKey]) -> tuple[int, list[OffloadKey]] | None:
        os.makedirs(self._root, exist_ok=True)
        lock = os.open(os.path.join(self._root, SWEEP_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # another replica is sweeping
            found = scan(self._root, SHARED_STALE_TEMPORARY_S)
            total = sum(size for _, _, size in found)
            evicted = []
            for _, key, size in found:
                if total <= self.cap_bytes:
                    break
                if key not in pinned and key not in held and _unlink_unless_read(self.mapper.get_file_name(key)):
                    total -= size
                    evicted.append(key)
            return total, evicted
        finally:
            os.close(lock)  # releases the sweep lock


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
    payload = memoryview(data)[HEADER.size :]
    return magic == MAGIC and size == len(payload) and zlib.crc32(payload) == crc


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _check(path: str) -> bool | None:
    """Whether the file is whole; None: no file."""
    try:
        with open(path, "rb") as file:
            return whole_file(file.read())
    except FileNotFoundError:
        return None


def _same_file(fd: int, path: str) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not deleted or replaced since it was opened)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _check_and_lock(path: str) -> tuple[bool | None, int | None]:
    """Open the file under a shared lock and check it: (True, its fd, still locked) if it
    is whole; (False, None) if not; (None, None) if it is gone, or being deleted."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None, None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        if not _same_file(fd, path):
            raise FileNotFoundError(path)  # deleted (or replaced) between the open and the lock
        whole = whole_file(os.pread(fd, os.fstat(fd).st_size, 0))
    except (BlockingIOError, FileNotFoundError):  # an exclusive lock: another replica deletes it
        os.close(fd)
        return None, None
    except BaseException:
        os.close(fd)
        raise
    if not whole:
        os.close(fd)
        return False, None
    return True, fd


def _unlink_unless_read(path: str) -> bool:
    """Delete the file unless some replica holds it open for a read (a shared lock);
    True if it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if _same_file(fd, path):
            _unlink(path)
        return True
    finally:
        os.close(fd)


class FileWriter:
    """Writes files on one thread: to a temporary name, optionally fsynced, linked into
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
        # Unique across replicas: two of them may write the same key at once (the same bytes).
        temporary = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        with open(temporary, "wb") as file:
            file.write(HEADER.pack(MAGIC, size, crc))
            for part in parts:
                file.write(part)
            if self._fsync:
                file.flush()
                os.fsync(file.fileno())
        # Linked into place, never over a file already there: content-addressed, that file
        # holds these bytes, and a replica may be reading it under its lock (a rename over
        # it would hand that replica's load a new file its lock does not cover).
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass
        finally:
            _unlink(temporary)
