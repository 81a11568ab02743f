"""What a restart with a full disk-tier directory waits for: the tier's index at start.

A directory of ``--files`` files in the tier's own layout (vLLM's ``FileMapper``, written by
the tier's own writer), the page cache dropped (when this process may: root), then a new
``DiskIndex`` on it, as a restarted engine builds one. Timed, all with a cold cache:

- ``ready_s``: the index constructed, which is all the engine's start waits for;
- ``first_hit_s``: from then, one file found, read and checked (a resume's first key);
- ``walk_s``: the directory walk (names and mtimes, on a thread) merged: from then the
  index knows every file, holds the cap and evicts in least-recently-used order;
- ``walk_us_per_file``, and against it a walk of the same directory with the cache warm.

No engine runs (the index is the only part of a start that grows with the directory).

    python -m benchmarks.disk_index --files 60000
    python -m benchmarks.disk_index --quick
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, finish, pyplot
from benchmarks.disk_tier import drop_page_cache
from connectors.cpu_platform import kernel_flags
from connectors.disk_files import HEADER, DiskIndex, FileWriter, scan


def mapper(root: Path) -> Any:
    from vllm.v1.kv_offload.file_mapper import FileMapper

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


def key(number: int) -> Any:
    """A block hash's key: spread over the layout's directories as real hashes are."""
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(hashlib.sha256(number.to_bytes(8, "big")).digest(), 0)


def fill(root: Path, files: int, payload: int) -> DiskIndex:
    index = DiskIndex(mapper(root), cap_bytes=files * (HEADER.size + payload), file_bytes=HEADER.size + payload)
    index.wait_rebuilt()
    writer = FileWriter(fsync=False, queue_bytes=1 << 30)
    body = os.urandom(payload)
    for number in range(files):
        index.add([key(number)])
        writer.put(index.path(key(number)), [body])
    writer.stop()
    return index


def measure(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="streamsess-bench-disk-index-", dir=args.dir))
    try:
        full = fill(root, args.files, args.file_bytes)
        dropped = drop_page_cache()
        start = time.perf_counter()
        index = DiskIndex(mapper(root), cap_bytes=full.cap_bytes, file_bytes=full.file_bytes)
        ready_s = time.perf_counter() - start
        assert index.verify(key(random.Random(args.seed).randrange(args.files)))
        first_hit_s = time.perf_counter() - start - ready_s
        index.wait_rebuilt()
        walk_s = time.perf_counter() - start
        assert len(index.files) == args.files, (len(index.files), args.files)
        start = time.perf_counter()
        scan(f"{full.mapper.base_path}_r{full.mapper.rank}")
        warm_walk_s = time.perf_counter() - start
    finally:
        shutil.rmtree(root)
    return {
        "settings": {
            "files": args.files,
            "file_bytes": HEADER.size + args.file_bytes,
            "dir": args.dir,
            "page_cache_dropped": dropped,
            "cpu_flags": kernel_flags(),
        },
        "ready_s": ready_s,
        "first_hit_s": first_hit_s,
        "walk_s": walk_s,
        "warm_walk_s": warm_walk_s,
        "summary": {
            "files": args.files,
            "start waits (s)": round(ready_s, 4),
            "first hit after (s)": round(first_hit_s, 4),
            "full index after (s)": round(walk_s, 2),
            "walk per file, cold (us)": round(walk_s / args.files * 1e6),
            "walk per file, warm (us)": round(warm_walk_s / args.files * 1e6),
        },
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.5))
    labels = ["start waits", "first hit", "full index (cold)", "walk (warm)"]
    values = [result["ready_s"], result["first_hit_s"], result["walk_s"], result["warm_walk_s"]]
    axis.barh(labels, values)
    axis.set_xlabel("seconds")
    axis.set_xscale("log")
    axis.set_title(f"disk-tier index at start, {result['settings']['files']:,} files")
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=60_000)
    parser.add_argument("--file-bytes", type=int, default=4096, help="each file's payload (the index reads none)")
    parser.add_argument("--quick", action="store_true", help="2,000 files: the smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default="~/.cache/streaming-sessions/bench", help="a disk, not tmpfs")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    args.dir = os.path.expanduser(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    if args.quick:
        args.files = 2000
    return ("disk_index-quick" if args.quick else "disk_index"), args


async def run(name: str, args: argparse.Namespace) -> None:
    finish(name, measure(args), args.out, plot)


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
