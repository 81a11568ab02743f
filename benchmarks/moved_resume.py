"""A session moved to another replica: resumed from a shared disk tier, against recomputed
on the new replica and against resumed on its own replica from the CPU tier.

In process, two engines with the same settings, each with its session service (replica
ids of their own) on one store and one shared disk-tier directory
(``disk_tier_shared``), both started before any session: replica B's index knows none of
A's files and finds them by name, as a replica of a running cluster does. Sessions of
CONTEXT tokens (one chunk), then a chunk of 16 tokens timed to its first token:

- ``own_cpu_tier``: on A, parked, A's device cache reset: A resumes it from its CPU tier;
- ``moved_disk``: on A, parked, A's disk writes flushed and the tier's files dropped from
  the page cache (``posix_fadvise``: those files only, not the engines' weights and
  libraries, which a replica keeps in memory), then resumed on B: B loads the context
  from the files A wrote, from the disk;
- ``moved_recompute``: on B, a session whose whole context is computed (as a move without
  a shared tier resumes one).

Goals (issue 51): at 8,160 tokens a moved resume within 1.25x of an own-replica CPU-tier
resume, and at least 10x faster than the recompute.

The floor a moved resume cannot beat on the machine: the own-replica resume plus one cold
read of the session's files (``cold_read_floor``: the files A wrote for the moved session,
read in parallel with no engine and no checksum, dropped from the page cache again after).

    python -m benchmarks.moved_resume --dtype float32      # bench model
    python -m benchmarks.moved_resume --quick              # tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import (
    SWITCH_SETTLE_S,
    EngineSetup,
    finish,
    in_process_engine,
    percentile,
    random_tokens,
    release_engine,
)
from benchmarks.disk_tier import parse_disk_args, plot_sides, warm_up
from benchmarks.store import NEXT_CHUNK, OWNER, Bench

SIDES = ("own_cpu_tier", "moved_disk", "moved_recompute")
FLOOR_THREADS = 4  # the fastest cold read of this machine's disk (1, 2 and 4 threads tried)


def drop_from_page_cache(directory: str) -> int:
    """Evict the directory's files from the page cache (and no other file's); how many."""
    dropped = 0
    for path in Path(directory).rglob("*.bin"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        finally:
            os.close(fd)
    return dropped


def tier_files(directory: str) -> set[Path]:
    return set(Path(directory).rglob("*.bin"))


def cold_read_s(paths: list[Path]) -> float:
    """The disk's floor for a moved resume: the files read once, cold, in parallel, into
    reused buffers (no engine, no checksum); dropped from the page cache again after."""

    def read(path: Path) -> None:
        buffer = bytearray(1 << 20)
        with path.open("rb", buffering=0) as file:
            while file.readinto(buffer):
                pass

    with ThreadPoolExecutor(FLOOR_THREADS) as pool:
        start = time.perf_counter()
        list(pool.map(read, paths))
        return time.perf_counter() - start


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from app.engine import flush_disk_tier

    root = Path(args.dir)
    shared = tempfile.mkdtemp(prefix="streamsess-bench-shared-tier-", dir=root)
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
        "disk_tier_dir": shared,
        "disk_tier_shared": True,
        "session_park_after_s": 3600,
        "max_chunk_tokens": max(args.contexts) + NEXT_CHUNK,
        "cache_salt_secret": "bench-secret",
    }
    rng = random.Random(args.seed)
    times: dict[str, dict[int, list[float]]] = {side: {c: [] for c in args.contexts} for side in SIDES}
    floors: dict[int, list[float]] = {c: [] for c in args.contexts}
    usage: dict[str, dict[int, Any]] = {side: {} for side in SIDES}
    engines = []
    try:
        for name in ("a", "b"):
            state = tempfile.mkdtemp(prefix=f"streamsess-bench-replica-{name}-")
            engines.append(
                in_process_engine(
                    setup, f"moved-{name}", shareable=False, replica_id=f"bench-{name}", state_dir=state, **tier
                )
            )
        (engine_a, recorder_a, settings_a), (engine_b, recorder_b, settings_b) = engines
        bench_a, bench_b = Bench(engine_a, recorder_a, settings_a), Bench(engine_b, recorder_b, settings_b)
        async with bench_a.service(store_url) as on_a, bench_b.service(store_url) as on_b:
            for bench, service in ((bench_a, on_a), (bench_b, on_b)):
                await warm_up(bench, service, rng)

            async def timed(
                bench: Bench, service: Any, side: str, context: int, session_id: str, tokens: int = NEXT_CHUNK
            ) -> None:
                await asyncio.sleep(SWITCH_SETTLE_S)  # the other engine's spinning readers settle
                result = await bench.chunk(service, session_id, random_tokens(rng, tokens))
                times[side][context].append(result.time_to_first_token)
                usage[side][context] = result.usage.prompt_tokens_details.model_dump()
                await service.close(OWNER, session_id)

            for context in args.contexts:
                for _ in range(args.repeats):
                    own = await bench_a.open(on_a)
                    await bench_a.chunk(on_a, own, random_tokens(rng, context - 1))
                    await on_a.park(OWNER, own)
                    await bench_a.reset(tier=False)
                    await timed(bench_a, on_a, "own_cpu_tier", context, own)

                    moved = await bench_a.open(on_a)
                    await flush_disk_tier(engine_a)
                    before = tier_files(shared)
                    await bench_a.chunk(on_a, moved, random_tokens(rng, context - 1))
                    await on_a.park(OWNER, moved)
                    await flush_disk_tier(engine_a)
                    drop_from_page_cache(shared)
                    floors[context].append(cold_read_s(sorted(tier_files(shared) - before)))
                    drop_from_page_cache(shared)
                    await timed(bench_b, on_b, "moved_disk", context, moved)

                    await timed(
                        bench_b,
                        on_b,
                        "moved_recompute",
                        context,
                        await bench_b.open(on_b),
                        tokens=context - 1 + NEXT_CHUNK,
                    )
    finally:
        for engine, _, _ in engines:
            release_engine(engine)
        shutil.rmtree(shared, ignore_errors=True)

    rows: dict[str, Any] = {}
    for context in args.contexts:
        row: dict[str, Any] = {f"{side}_p50_s": percentile(times[side][context], 50) for side in SIDES}
        row["usage"] = {side: usage[side][context] for side in SIDES}
        row["cold_read_floor_p50_s"] = percentile(floors[context], 50)
        row["own_plus_cold_read_over_own"] = 1 + row["cold_read_floor_p50_s"] / row["own_cpu_tier_p50_s"]
        row["moved_over_own_cpu_tier"] = row["moved_disk_p50_s"] / row["own_cpu_tier_p50_s"]
        row["recompute_over_moved"] = row["moved_recompute_p50_s"] / row["moved_disk_p50_s"]
        rows[str(context)] = row
    return {
        "settings": {
            **setup.describe(),
            "repeats": args.repeats,
            "next_chunk": NEXT_CHUNK,
            "disk_tier_gib": args.disk_tier_gib,
            "dir": str(root),
            "shared": True,
            "page_cache": "the tier's files dropped before each moved resume (posix_fadvise)",
        },
        "contexts": rows,
        "summary": {
            context: {
                "moved/own_cpu_tier": round(row["moved_over_own_cpu_tier"], 2),
                "recompute/moved": round(row["recompute_over_moved"], 2),
                "floor: (own + one cold read)/own": round(row["own_plus_cold_read_over_own"], 2),
            }
            for context, row in rows.items()
        },
    }


def plot(result: dict[str, Any]) -> Any:
    return plot_sides(result, SIDES, "a session moved to another replica")


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    return parse_disk_args(
        __doc__, "moved_resume", argv, 2, [2048, 8160], "where the shared disk tier goes (a disk, not tmpfs)"
    )


async def run(name: str, args: argparse.Namespace) -> None:
    finish(name, await measure(args), args.out, plot)


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
