"""Resume after a restart from the disk tier, against a resume from the CPU tier and a
recompute, with the disk's own sequential read speed measured in the same run.

In process, one engine with a disk tier (``disk_tier_gib``) in a fresh directory under
``--dir``, then the same engine settings started again on that directory (a restart:
its device cache and CPU tier are empty). Sessions of CONTEXT tokens (one chunk), then
a chunk of 16 tokens timed to its first token:

- ``cpu_tier``: on the first engine, parked, the device cache reset;
- ``disk_tier``: parked on the first engine, resumed on the restarted one, with the page
  cache dropped before (when this process may: root), so the files are read from the disk;
- ``recompute``: on the restarted engine, a session whose whole context is computed (as
  a restart without a disk tier resumes one).

The disk tier's load rate is the bytes its files hold for the hit over the time a disk
resume takes beyond a CPU-tier one (reading, checking and copying into the CPU tier: a
lower bound of its read rate), against a 1 GiB file read sequentially after a cache drop.

    python -m benchmarks.disk_tier --dtype float32      # bench model
    python -m benchmarks.disk_tier --quick              # tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    EngineSetup,
    benchmark_parser,
    finish,
    in_process_engine,
    percentile,
    pyplot,
    quick_engine,
    random_tokens,
    stop_engine,
)
from benchmarks.store import NEXT_CHUNK, OWNER, Bench
from connectors.disk_files import scan

SIDES = ("cpu_tier", "disk_tier", "recompute")
SEQUENTIAL_BYTES = 1 << 30


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def sequential_read_bytes_per_s(directory: str) -> dict[str, Any]:
    """A 1 GiB file written and fsynced in ``directory``, the page cache dropped, then read
    in 8 MiB reads."""
    path = Path(directory) / "sequential-read.bin"
    block = os.urandom(8 << 20)
    with path.open("wb") as file:
        for _ in range(SEQUENTIAL_BYTES // len(block)):
            file.write(block)
        file.flush()
        os.fsync(file.fileno())
    dropped = drop_page_cache()
    start = time.perf_counter()
    with path.open("rb", buffering=0) as file:
        while file.read(8 << 20):
            pass
    seconds = time.perf_counter() - start
    path.unlink()
    return {"bytes_per_s": SEQUENTIAL_BYTES / seconds, "page_cache_dropped": dropped}


async def warm_up(bench: Bench, service: Any, rng: random.Random) -> None:
    """One chunk on a session of its own, closed: an engine's first steps run slower."""
    session_id = await bench.open(service)
    await bench.chunk(service, session_id, random_tokens(rng, 64))
    await service.close(OWNER, session_id)


def tier_bytes(directory: str) -> tuple[int, int]:
    files = [path.stat().st_size for path in Path(directory).rglob("*.bin")]
    return len(files), sum(files)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from app.engine import flush_disk_tier

    root = Path(args.dir)
    disk_dir = tempfile.mkdtemp(prefix="streamsess-bench-disk-tier-", dir=root)
    store_url = f"sqlite:///{tempfile.mkdtemp(prefix='streamsess-bench-store-')}/sessions.db"
    setup = EngineSetup(
        preset=args.preset,
        kv_cache_gib=args.kv_cache_gib,
        cpu_tier_gib=args.cpu_tier_gib,
        dtype=args.dtype,
        max_model_len=max(4096, max(args.contexts) + 2 * NEXT_CHUNK),
    )
    tier = {
        "disk_tier_gib": args.disk_tier_gib,
        "disk_tier_dir": disk_dir,
        "session_park_after_s": 3600,
        "max_chunk_tokens": max(args.contexts) + NEXT_CHUNK,
    }
    rng = random.Random(args.seed)
    times: dict[str, dict[int, list[float]]] = {side: {c: [] for c in args.contexts} for side in SIDES}
    usage: dict[str, dict[int, Any]] = {side: {} for side in SIDES}

    async def timed(
        bench: Bench, service: Any, side: str, context: int, session_id: str, tokens: int = NEXT_CHUNK
    ) -> None:
        result = await bench.chunk(service, session_id, random_tokens(rng, tokens))
        times[side][context].append(result.time_to_first_token)
        usage[side][context] = result.usage.prompt_tokens_details.model_dump()
        await service.close(OWNER, session_id)

    @contextlib.asynccontextmanager
    async def started() -> AsyncIterator[tuple[Bench, Any]]:
        """An engine with the disk tier and a session service on it, warmed up; on the way
        out the service stops (parking its sessions), the disk tier is flushed, and the
        engine stops: the next one is a restart."""
        engine, recorder, settings = in_process_engine(setup, "disk-tier-bench", **tier)
        try:
            bench = Bench(engine, recorder, settings)
            async with bench.service(store_url) as service:
                await warm_up(bench, service, rng)
                yield bench, service
            await flush_disk_tier(engine)
        finally:
            stop_engine(engine)

    survivors: dict[int, list[str]] = {c: [] for c in args.contexts}
    async with started() as (bench, service):
        for context in args.contexts:
            for _ in range(args.repeats):
                session_id = await bench.open(service)
                await bench.chunk(service, session_id, random_tokens(rng, context - 1))
                await service.park(OWNER, session_id)
                await bench.reset(tier=False)
                await timed(bench, service, "cpu_tier", context, session_id)
                survivors[context].append(await bench.open(service))
                await bench.chunk(service, survivors[context][-1], random_tokens(rng, context - 1))
                await service.park(OWNER, survivors[context][-1])
    files, stored = tier_bytes(disk_dir)
    dropped = drop_page_cache()
    start = time.perf_counter()  # what a restarted engine's disk tier does first (cold cache)
    scan(disk_dir)
    index_rebuild_s = time.perf_counter() - start

    async with started() as (bench, service):
        for context in args.contexts:
            for session_id in survivors[context]:
                await timed(bench, service, "disk_tier", context, session_id)
            for _ in range(args.repeats):  # the context and the next chunk, computed
                await timed(
                    bench, service, "recompute", context, await bench.open(service), tokens=context - 1 + NEXT_CHUNK
                )
    shutil.rmtree(disk_dir)  # about 1 GB at the defaults
    sequential = sequential_read_bytes_per_s(str(root))

    rows: dict[str, Any] = {}
    file_bytes = stored / files if files else 0
    for context in args.contexts:
        row: dict[str, Any] = {f"{side}_p50_s": percentile(times[side][context], 50) for side in SIDES}
        row["usage"] = {side: usage[side][context] for side in SIDES}
        disk_tokens = usage["disk_tier"][context]["disk_tier_tokens"]
        loaded = disk_tokens / setup.block_size * file_bytes
        extra = row["disk_tier_p50_s"] - row["cpu_tier_p50_s"]
        row["disk_bytes_loaded"] = loaded
        row["disk_load_bytes_per_s"] = loaded / extra if extra > 0 else None
        row["disk_over_cpu_tier"] = row["disk_tier_p50_s"] / row["cpu_tier_p50_s"]
        row["recompute_over_disk"] = row["recompute_p50_s"] / row["disk_tier_p50_s"]
        rows[str(context)] = row
    return {
        "settings": {
            **setup.describe(),
            "repeats": args.repeats,
            "next_chunk": NEXT_CHUNK,
            "disk_tier_gib": args.disk_tier_gib,
            "dir": str(root),
            "files_written": files,
            "bytes_written": stored,
            "page_cache_dropped_before_restart": dropped,
            "index_rebuild_s": index_rebuild_s,
        },
        "sequential_read": sequential,
        "contexts": rows,
        "summary": {
            context: {
                "disk/cpu_tier": round(row["disk_over_cpu_tier"], 2),
                "recompute/disk": round(row["recompute_over_disk"], 2),
                "load/sequential": round(row["disk_load_bytes_per_s"] / sequential["bytes_per_s"], 2)
                if row["disk_load_bytes_per_s"]
                else None,
            }
            for context, row in rows.items()
        },
    }


def plot_sides(result: dict[str, Any], sides: tuple[str, ...], what: str) -> Any:
    """Each side's resume p50 per context, bars on a log scale (this and moved_resume)."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    contexts = list(result["contexts"])
    for offset, side in zip((-0.27, 0, 0.27), sides):
        axis.bar(
            [i + offset for i in range(len(contexts))],
            [result["contexts"][c][f"{side}_p50_s"] * 1000 for c in contexts],
            width=0.27,
            label=side,
        )
    axis.set_xticks(range(len(contexts)), [f"{c} tokens" for c in contexts])
    axis.set_ylabel("resume, time to first token p50 (ms)")
    axis.set_yscale("log")
    axis.legend()
    axis.set_title(f"{what} ({result['settings']['model_preset']} model, {result['settings']['dtype']})")
    return figure


def plot(result: dict[str, Any]) -> Any:
    return plot_sides(result, SIDES, "resume after a restart")


def parse_disk_args(
    doc: str | None, name: str, argv: list[str] | None, repeats: int, contexts: list[int], dir_help: str
) -> tuple[str, argparse.Namespace]:
    """The arguments of a benchmark on a disk tier (this and moved_resume)."""
    parser = benchmark_parser(doc, kv_cache_gib=1.0)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--contexts", type=int, nargs="+", default=contexts)
    parser.add_argument("--disk-tier-gib", type=float, default=8.0)
    parser.add_argument("--dir", default="~/.cache/streaming-sessions/bench", help=dir_help)
    args = parser.parse_args(argv)
    args.dir = os.path.expanduser(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    if args.quick:
        quick_engine(args)
        args.repeats, args.contexts, args.disk_tier_gib = 1, [128], 0.25
        name = f"{name}-quick"
    return name, args


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    return parse_disk_args(
        __doc__,
        "disk_tier",
        argv,
        3,
        [512, 2048, 8160],
        "where the disk tier and the sequential-read file go (a disk, not tmpfs)",
    )


async def run(name: str, args: argparse.Namespace) -> None:
    finish(name, await measure(args), args.out, plot)


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
