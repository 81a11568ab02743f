"""A disk tier shared by replicas (connectors/disk_files.py, ``shared``), without an engine:
each replica is a ``DiskIndex`` of its own on one directory, as each engine's scheduler
has one, and the stress test runs them in processes of their own.

Oracles: the directory itself (what is on disk, its size against the cap), the bytes read
back (each file's payload is derived from its key, so a wrong read is seen), and the
indexes' counters. The negative control is a per-replica index, which misses what another
replica wrote: the case the shared mode exists for.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from pathlib import Path

from connectors.disk_files import HEADER, MAGIC, DiskIndex, FileWriter, scan, whole_file
from tests.unit.test_disk_tier import FILE_BYTES, key, mapper

PAYLOAD_BYTES = FILE_BYTES - HEADER.size


def payload(number: int) -> bytes:
    return (number.to_bytes(4, "big") * (PAYLOAD_BYTES // 4 + 1))[:PAYLOAD_BYTES]


def replica(root: Path, cap_files: int = 100) -> DiskIndex:
    index = DiskIndex(mapper(root), cap_bytes=cap_files * FILE_BYTES, file_bytes=FILE_BYTES, shared=True)
    index.wait_rebuilt()
    return index


def write(index: DiskIndex, number: int) -> Path:
    """As the manager stores a chunk: counted, then written by the writer thread."""
    index.add([key(number)])
    writer = FileWriter(fsync=False, queue_bytes=1 << 20)
    writer.put(index.path(key(number)), [payload(number)])
    writer.stop()
    return Path(index.path(key(number)))


def read_as_the_worker_does(index: DiskIndex, number: int) -> bytes:
    """The load that follows a hit: the file read by its name (DiskTierWorker._read)."""
    data = Path(index.path(key(number))).read_bytes()
    assert data[:8] == MAGIC and whole_file(data)
    return data[HEADER.size :]


def on_disk(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*.bin"))


def test_a_file_another_replica_wrote_is_a_hit_and_is_counted_as_its(tmp_path: Path) -> None:
    a, b = replica(tmp_path), replica(tmp_path)
    per_replica = DiskIndex(mapper(tmp_path), cap_bytes=100 * FILE_BYTES, file_bytes=FILE_BYTES)
    per_replica.wait_rebuilt()  # started before A wrote, as every replica of a cluster
    write(a, 1)
    assert b.verify(key(1)) and key(1) in b.foreign and key(1) not in a.foreign
    assert read_as_the_worker_does(b, 1) == payload(1)
    assert not per_replica.verify(key(1))  # negative control: a per-replica index misses it


def test_no_replica_deletes_a_file_another_is_reading(tmp_path: Path) -> None:
    """B checked key 0 for a load (a shared lock until the load is done); A's sweep keeps
    the directory within the cap by every other file, spares key 0, and deletes it once
    B has loaded it."""
    a, b = replica(tmp_path, cap_files=4), replica(tmp_path, cap_files=4)
    write(a, 0)
    time.sleep(0.02)  # mtimes tick coarsely: key 0 is the oldest
    assert b.verify(key(0))
    b.pin([key(0)])
    for number in range(1, 10):
        write(a, number)
        time.sleep(0.01)
    a.sweep(wait=True)
    assert Path(a.path(key(0))).exists() and read_as_the_worker_does(b, 0) == payload(0)
    assert on_disk(tmp_path) <= 4 * FILE_BYTES
    assert a.counts["evictions"] >= 5
    b.unpin([key(0)])  # loaded: its lock is released
    write(a, 10)
    a.sweep(wait=True)
    assert not Path(a.path(key(0))).exists() and on_disk(tmp_path) <= 4 * FILE_BYTES


def test_a_file_gone_or_corrupt_by_its_check_is_a_counted_miss(tmp_path: Path) -> None:
    a, b = replica(tmp_path), replica(tmp_path)
    gone, corrupt = write(a, 1), write(a, 2)
    assert b.has(key(1)) and b.has(key(2))  # seen, then changed by someone else before the check
    gone.unlink()
    corrupt.write_bytes(corrupt.read_bytes()[:-1] + b"?")
    assert not b.verify(key(1)) and b.counts["vanished"] == 1
    assert not b.verify(key(2)) and b.counts["checksum_failures"] == 1 and not corrupt.exists()


def test_one_sweeper_at_a_time(tmp_path: Path) -> None:
    """Two replicas sweeping at once: one holds the sweep lock, the other skips its turn."""
    import fcntl

    a = replica(tmp_path, cap_files=2)
    for number in range(5):
        write(a, number)
    root = Path(a.mapper.base_path + f"_r{a.mapper.rank}")
    lock = os.open(root / ".sweep.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # another replica is sweeping
    try:
        a.sweep(wait=True)
        assert on_disk(tmp_path) == 5 * FILE_BYTES  # skipped
    finally:
        os.close(lock)
    a.sweep(wait=True)
    assert on_disk(tmp_path) <= 2 * FILE_BYTES


# ----------------------------------------------------------------------------- stress
KEYS = 60  # by key % 3: 0 replica 1's own, 1 replica 2's own, 2 written by both
CAP_FILES = 20
SECONDS = 6.0


def writer_and_reader(root: str, seed: int, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """One replica: writes keys (its own and some in common), and reads keys as its
    engine would: a hit is checked (and locked), then read by name, then released."""
    rng = random.Random(seed)
    index = replica(Path(root), CAP_FILES)
    writer = FileWriter(fsync=False, queue_bytes=1 << 22)
    counts = {"hits": 0, "misses": 0, "wrong": 0, "failed_reads": 0, "foreign_hits": 0}
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline:
        number = rng.randrange(KEYS)
        writes = number % 3 in (seed - 1, 2)  # the other replica's own keys are only read here
        if writes and rng.random() < 0.5 and not index.has(key(number)):
            index.add([key(number)])
            writer.put(index.path(key(number)), [payload(number)])
            continue
        if not index.verify(key(number)):
            counts["misses"] += 1
            continue
        counts["hits"] += 1
        counts["foreign_hits"] += key(number) in index.foreign
        index.pin([key(number)])
        try:
            if read_as_the_worker_does(index, number) != payload(number):
                counts["wrong"] += 1
        except (OSError, AssertionError):  # on vLLM 0.32 a failed load stops the engine
            counts["failed_reads"] += 1
        index.unpin([key(number)])
    writer.stop()
    index.sweep(wait=True)
    results.put(
        {**counts, "vanished": index.counts["vanished"], "checksum_failures": index.counts["checksum_failures"]}
    )


def evictor(root: str, seed: int, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """A third process that deletes and corrupts files at random, as a replica with
    another view, or an operator, might: through the same locks."""
    from connectors.disk_files import _unlink_unless_read

    rng = random.Random(seed)
    deleted = corrupted = 0
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline:
        found = scan(f"{mapper(Path(root)).base_path}_r0", stale_s=60)
        if found:
            _, victim, _ = rng.choice(found)
            path = mapper(Path(root)).get_file_name(victim)
            if rng.random() < 0.2:
                import fcntl

                try:
                    fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.pwrite(fd, b"\xff", HEADER.size + 3)
                    corrupted += 1
                except BlockingIOError:
                    pass
                finally:
                    os.close(fd)
            elif _unlink_unless_read(path):
                deleted += 1
        time.sleep(0.002)
    results.put({"deleted": deleted, "corrupted": corrupted})


def test_two_replicas_writing_and_reading_while_a_third_process_evicts_at_random(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    results: multiprocessing.Queue = context.Queue()  # type: ignore[type-arg]
    processes = [context.Process(target=writer_and_reader, args=(str(tmp_path), seed, results)) for seed in (1, 2)]
    processes.append(context.Process(target=evictor, args=(str(tmp_path), 3, results)))
    for process in processes:
        process.start()
    reports = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    replicas = [r for r in reports if "hits" in r]
    chaos = next(r for r in reports if "deleted" in r)
    print("stress:", replicas, chaos)
    assert sum(r["wrong"] for r in replicas) == 0
    assert sum(r["failed_reads"] for r in replicas) == 0  # no load failed: no engine would have stopped
    assert all(r["hits"] > 50 and r["misses"] > 0 for r in replicas)
    assert chaos["deleted"] > 0 and chaos["corrupted"] > 0
    assert sum(r["vanished"] + r["checksum_failures"] for r in replicas) > 0  # counted misses
    assert all(r["foreign_hits"] > 0 for r in replicas)  # each read files the other wrote
    assert on_disk(tmp_path) <= CAP_FILES * FILE_BYTES + FILE_BYTES
