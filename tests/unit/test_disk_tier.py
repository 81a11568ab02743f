"""The disk tier's parts without an engine (connectors/disk_tier.py, disk_files.py): the worker's files
round-trip a chunk's pages into a fresh host tier; the index keeps the tier within its
cap (pinned files excepted), rebuilds itself from the directory alone, and turns a file
that fails its checksum into a miss; the namespace follows the weights, not their path.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.file_mapper import FileMapper

from connectors import DISK_TIER_DIR_KEY, disk_files
from connectors.disk_files import HEADER, DiskIndex, FileWriter, key_of
from connectors.disk_tier import DiskFiles, DiskTierManager, DiskTierWorker, file_mapper
from tests.unit.test_host_tier import make_caches

FILE_BYTES = 1000


def mapper(root: Path) -> FileMapper:
    return FileMapper(
        str(root),
        "model",
        tokens_per_hash=32,
        blocks_per_file=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        rank=0,
        dtype="float32",
    )


def key(number: int, group: int = 0) -> OffloadKey:
    return make_offload_key(number.to_bytes(32, "big"), group)


def write(index: DiskIndex, number: int, payload: bytes = b"x" * (FILE_BYTES - HEADER.size)) -> Path:
    """A file as the worker writes it, added to the index as the manager adds it."""
    index.add([key(number)])
    writer = FileWriter(fsync=False, queue_bytes=1 << 20)
    writer.put(index.path(key(number)), [payload])
    writer.stop()
    return Path(index.path(key(number)))


def test_a_chunk_written_by_one_worker_loads_into_another(tmp_path: Path) -> None:
    caches, tensors = make_caches()
    original = [t.clone() for t in tensors]
    index = DiskIndex(mapper(tmp_path), cap_bytes=1 << 20, file_bytes=FILE_BYTES)
    path = index.path(key(1))
    writer = DiskTierWorker(caches, blocks_per_chunk=2, num_chunks=4, fsync=True, queue_bytes=1 << 20)
    writer.submit_store(1, GPULoadStoreSpec([3, 5], group_sizes=[2], block_indices=[0]), DiskFiles([2], [(2, 0, path)]))
    assert [r.job_id for r in writer.get_finished()] == [1]  # the file is queued as the store completes
    writer.shutdown()  # writes what is queued
    assert key_of(path) == key(1)
    for tensor in tensors:
        tensor.zero_()
    # A fresh worker (a restarted engine: its host tier empty) reads it into chunk 0.
    reader = DiskTierWorker(caches, blocks_per_chunk=2, num_chunks=4, fsync=False, queue_bytes=1 << 20)
    reader.submit_load(2, DiskFiles([0], [(0, 0, path)]), GPULoadStoreSpec([8, 9], group_sizes=[2], block_indices=[0]))
    for tensor, before in zip(tensors, original):
        assert torch.equal(tensor[[8, 9]], before[[3, 5]])
    reader.shutdown()


def test_the_cap_holds_under_three_times_its_size_and_spares_pinned_files(tmp_path: Path) -> None:
    index = DiskIndex(mapper(tmp_path), cap_bytes=10 * FILE_BYTES, file_bytes=FILE_BYTES)
    write(index, 0)
    index.pin([key(0)])
    for number in range(1, 30):
        write(index, number)
        on_disk = sum(path.stat().st_size for path in tmp_path.rglob("*.bin"))
        assert on_disk <= index.cap_bytes + FILE_BYTES and index.bytes <= index.cap_bytes
    assert index.has(key(0)) and Path(index.path(key(0))).exists()
    assert not index.has(key(1)) and not Path(index.path(key(1))).exists()
    assert index.counts["evictions"] == 20
    index.unpin([key(0)])
    write(index, 30)
    assert not index.has(key(0))  # the oldest, once no longer read


def test_the_index_rebuilds_from_the_directory_in_lru_order(tmp_path: Path) -> None:
    index = DiskIndex(mapper(tmp_path), cap_bytes=10 * FILE_BYTES, file_bytes=FILE_BYTES)
    for number in range(5):
        write(index, number)
        time.sleep(0.02)  # file times tick coarsely (a few ms): one tick per file
    index.touch([key(1)])  # used last: its mtime is now
    leftover = Path(index.path(key(9)) + ".123.tmp")  # a crashed writer's
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(b"partial")
    rebuilt = DiskIndex(mapper(tmp_path), cap_bytes=3 * FILE_BYTES, file_bytes=FILE_BYTES)
    rebuilt.wait_rebuilt()
    assert list(rebuilt.files) == [key(3), key(4), key(1)]  # the least recently used evicted
    assert not leftover.exists()
    assert all(rebuilt.verify(k) for k in rebuilt.files)


def test_files_are_served_by_name_before_the_index_is_rebuilt(tmp_path: Path, monkeypatch: Any) -> None:
    """A restarted engine does not wait for the directory walk (seconds for tens of
    thousands of files): until it is merged, a key is looked for by its file name; the
    merge then puts the files used meanwhile last and holds the cap."""
    index = DiskIndex(mapper(tmp_path), cap_bytes=10 * FILE_BYTES, file_bytes=FILE_BYTES)
    for number in range(4):
        write(index, number)
        time.sleep(0.02)  # one mtime tick per file
    walked = threading.Event()
    real_scan = disk_files.scan
    monkeypatch.setattr(disk_files, "scan", lambda root: real_scan(root) if walked.wait(30) else [])
    rebuilt = DiskIndex(mapper(tmp_path), cap_bytes=3 * FILE_BYTES, file_bytes=FILE_BYTES)
    assert rebuilt.rebuilding() and not rebuilt.files
    assert rebuilt.verify(key(2)) and not rebuilt.verify(key(7))  # on disk by its name; no file
    walked.set()
    rebuilt.wait_rebuilt()
    assert list(rebuilt.files) == [key(1), key(3), key(2)]  # 0 evicted: the oldest, and unused since
    assert not Path(rebuilt.path(key(0))).exists() and rebuilt.bytes == 3 * FILE_BYTES


def test_a_cpu_tier_hit_keeps_its_file_recent_on_disk(tmp_path: Path) -> None:
    """A session hot in host memory is loaded from the CPU tier, never from disk: its
    files must still count as used, or the disk tier evicts them first and a restart
    loses exactly the sessions in use (vLLM 0.32 never calls the manager's touch())."""
    index = DiskIndex(mapper(tmp_path), cap_bytes=3 * FILE_BYTES, file_bytes=FILE_BYTES)
    index.wait_rebuilt()
    manager = DiskTierManager(index, num_chunks=8)
    context = ReqContext(req_id="request")
    for number in range(3):
        manager.prepare_store([key(number)], context)
        manager.complete_store([key(number)], context)
    manager.prepare_load([key(0)], context)  # the oldest file's chunk, from host memory
    manager.complete_load([key(0)], context)
    manager.prepare_store([key(3)], context)  # one file past the cap
    assert list(index.files) == [key(2), key(0), key(3)]  # 1 evicted, not 0


def test_a_file_that_fails_its_checksum_is_a_miss_and_is_deleted(tmp_path: Path) -> None:
    index = DiskIndex(mapper(tmp_path), cap_bytes=10 * FILE_BYTES, file_bytes=FILE_BYTES)
    good, flipped, cut = write(index, 1), write(index, 2), write(index, 3)
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 1
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-10])
    assert index.verify(key(1))
    assert not index.verify(key(2)) and not flipped.exists() and not index.has(key(2))
    assert not index.verify(key(3)) and not cut.exists()
    assert index.counts["checksum_failures"] == 2 and good.exists()
    index.add([key(4)])  # queued, not written yet: a miss, still counted
    assert not index.verify(key(4)) and index.has(key(4))


def spec(model: Path, root: Path) -> SimpleNamespace:
    """What file_mapper reads of an offloading spec (vLLM's own config objects)."""
    parallel = OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=False,
    )
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="e",
        model=OffloadingModelConfig(name=str(model), dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=parallel,
    )
    return SimpleNamespace(
        config=config, kv_bytes_per_chunk=4096, blocks_per_chunk=1, extra_config={DISK_TIER_DIR_KEY: str(root)}
    )


def test_the_namespace_follows_the_weights_not_their_path(tmp_path: Path) -> None:
    """Another checkpoint of the same shape served from the same directory reads none of
    the first one's files; the same weights (rewritten, or at another path) share them."""
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(os.urandom(3 << 20))
    first = file_mapper(spec(model, tmp_path / "tier")).base_path
    weights.write_bytes(weights.read_bytes())  # the same bytes, a new mtime: the same namespace
    assert file_mapper(spec(model, tmp_path / "tier")).base_path == first
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert file_mapper(spec(copy, tmp_path / "tier")).base_path == first
    weights.write_bytes(os.urandom(3 << 20))  # another checkpoint, the same shape, the same path
    assert Path(file_mapper(spec(model, tmp_path / "tier")).base_path).parent != Path(first).parent


def test_files_checked_ahead_stop_at_the_first_missing_key(tmp_path: Path) -> None:
    """A request's files are checked in parallel before its lookups, up to its first
    key with no file: the same verdicts as checking them one at a time."""
    index = DiskIndex(mapper(tmp_path), cap_bytes=100 * FILE_BYTES, file_bytes=FILE_BYTES)
    for number in (1, 2, 3, 5):
        write(index, number)
    flipped = Path(index.path(key(2)))
    flipped.write_bytes(flipped.read_bytes()[:-1] + b"?")
    index.verify_ahead([key(1), key(2), key(3), key(4), key(5)])
    assert [index.checked(key(n)) for n in range(1, 6)] == [True, False, True, False, False]  # 5: past the miss
    assert not index.has(key(2)) and not flipped.exists() and index.counts["checksum_failures"] == 1
    assert index.verify(key(5)) and index.verify(key(1))
