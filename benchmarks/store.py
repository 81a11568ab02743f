"""The session store's cost, and resuming after a restart.

In process, on one engine (as ``park_resume``), so that only the store differs:

1. Per-chunk overhead: 1-token chunks with max_tokens=1 through the session service,
   with no store (``store_url=none``), with SQLite (the default: WAL, synchronous=FULL,
   on this machine's disk) and with PostgreSQL (Debian's server on loopback, fsync on):
   a service a store over the one engine, a session each, the chunks paired (each chunk
   goes to every store in turn), so that a drift of the machine falls on all of them.
   Every chunk takes a lease (not flushed) and commits its tokens (flushed): two
   transactions. Reports p50/p99 per store, the p50 over none, and the median of each
   chunk less the store-less chunk next to it (the paired figure).
2. Resume after a restart against resume from the CPU tier: sessions of CONTEXT
   tokens, then a chunk of 16 tokens, timed to its first token, (a) never parked
   (device), (b) parked with the device cache reset (CPU tier), (c) after a
   restart: the service stopped (its sessions stay in the SQLite store), the device
   cache and the CPU tier both dropped (a restarted server's tier is empty: it is
   host memory), and a new service over the same store resumes them, recomputing
   the transcript. A disk tier that would make (c) a disk hit is not built: see
   docs/benchmarks.md.

    python -m benchmarks.store            # bench model
    python -m benchmarks.store --quick    # tiny model (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

from benchmarks.common import (
    EngineSetup,
    alternated,
    benchmark_parser,
    finish,
    in_process_engine,
    percentile,
    pyplot,
    quick_engine,
    random_tokens,
    release_engine,
)
from tests.harness.postgres import postgres_bin_dir, postgres_server

OWNER = "bench"
NEXT_CHUNK = 16


class Bench:
    """One engine; session services over it, each with the store asked for."""

    def __init__(self, engine: Any, recorder: Any, settings: Any):
        self.engine, self.recorder, self.settings = engine, recorder, settings

    @contextlib.asynccontextmanager
    async def service(self, store_url: str) -> AsyncIterator[Any]:
        from app.wiring import session_service

        service = session_service(
            self.engine, self.settings.model_copy(update={"store_url": store_url}), recorder=self.recorder
        )
        await service.start()
        try:
            yield service
        finally:
            await service.stop()

    @staticmethod
    async def open(service: Any) -> str:
        from app.protocol import SessionCreateRequest, SessionDefaults

        defaults = SessionDefaults(temperature=0.0, ignore_eos=True)
        return str((await service.create(OWNER, SessionCreateRequest(defaults=defaults))).id)

    @staticmethod
    async def chunk(service: Any, session_id: str, ids: list[int]) -> Any:
        from app.protocol import SamplingOptions

        run = await service.start_chunk(
            OWNER, session_id, ids, SamplingOptions(max_tokens=1), transport="bench", wait=True
        )
        return await run.result()

    async def per_chunk(self, store_urls: dict[str, str], chunks: int) -> dict[str, dict[str, float]]:
        """Each store's 1-token chunks, paired: a service a store over the one engine, a
        session each, and chunk after chunk goes to every store in turn (the order
        reversed every other time), so each store's chunk has its neighbours on the
        others within a fraction of a second. Per store: p50/p99, and the median of its
        chunk less the store-less chunk next to it."""
        async with contextlib.AsyncExitStack() as stack:
            services = {name: await stack.enter_async_context(self.service(url)) for name, url in store_urls.items()}
            sessions = {name: await self.open(service) for name, service in services.items()}
            for name, service in services.items():
                for _ in range(5):  # warm up
                    await self.chunk(service, sessions[name], [7])
            times: dict[str, list[float]] = {name: [] for name in services}
            for index in range(chunks):
                for name in alternated(list(services), index):
                    start = time.perf_counter()
                    await self.chunk(services[name], sessions[name], [(index % 500) + 1])
                    times[name].append(time.perf_counter() - start)
            for name, service in services.items():
                await service.close(OWNER, sessions[name])
        return {
            name: {
                "p50_s": percentile(values, 50),
                "p99_s": percentile(values, 99),
                "chunks": len(values),
                "paired_over_none_p50_ms": 1000
                * statistics.median(mine - none for mine, none in zip(values, times["none"], strict=True)),
            }
            for name, values in times.items()
        }

    async def reset(self, tier: bool) -> None:
        assert await self.engine.reset_prefix_cache(reset_connector=tier), "cache reset refused"

    async def resume(self, context: int, repeats: int, rng: random.Random) -> dict[str, Any]:
        store_url = f"sqlite:///{tempfile.mkdtemp(prefix='streamsess-bench-store-')}/sessions.db"
        times: dict[str, list[float]] = {"device": [], "cpu_tier": [], "restart_recompute": []}
        sources: dict[str, Any] = {}

        async def timed(service: Any, side: str, session_id: str) -> None:
            result = await self.chunk(service, session_id, random_tokens(rng, NEXT_CHUNK))
            times[side].append(result.time_to_first_token)
            sources[side] = result.usage.prompt_tokens_details.model_dump()
            await service.close(OWNER, session_id)

        async with self.service(store_url) as service:
            for side in ("device", "cpu_tier"):
                for _ in range(repeats):
                    session_id = await self.open(service)
                    await self.chunk(service, session_id, random_tokens(rng, context - 1))
                    if side == "cpu_tier":
                        await service.park(OWNER, session_id)
                        await self.reset(tier=False)
                    await timed(service, side, session_id)
            survivors = []
            for _ in range(repeats):
                survivors.append(await self.open(service))
                await self.chunk(service, survivors[-1], random_tokens(rng, context - 1))
        # The service stopped: its sessions are only in the store now. A restarted
        # server has neither their device blocks nor their CPU-tier copies.
        await self.reset(tier=True)
        async with self.service(store_url) as service:
            for session_id in survivors:
                await timed(service, "restart_recompute", session_id)
        summary: dict[str, Any] = {f"{side}_p50_s": percentile(values, 50) for side, values in times.items()}
        summary["sources"] = sources
        summary["restart_over_tier"] = summary["restart_recompute_p50_s"] / summary["cpu_tier_p50_s"]
        summary["tier_over_device"] = summary["cpu_tier_p50_s"] / summary["device_p50_s"]
        return summary


async def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset,
        kv_cache_gib=args.kv_cache_gib,
        cpu_tier_gib=args.cpu_tier_gib,
        dtype=args.dtype,
        max_model_len=max(4096, max(args.contexts) + 256),
    )
    engine, recorder, settings = in_process_engine(setup, "store-bench", session_park_after_s=3600)
    bench = Bench(engine, recorder, settings)
    try:
        sqlite_dir = tempfile.mkdtemp(prefix="streamsess-bench-sqlite-")
        stores = {"none": "none", "sqlite": f"sqlite:///{sqlite_dir}/sessions.db"}
        with contextlib.ExitStack() as stack:
            if postgres_bin_dir() is not None:
                stores["postgresql"] = stack.enter_context(postgres_server(fsync=True)).url
            overhead = await bench.per_chunk(stores, args.chunks)
        rng = random.Random(args.seed)
        resume = {str(context): await bench.resume(context, args.repeats, rng) for context in args.contexts}
    finally:
        release_engine(engine)
    base = overhead["none"]["p50_s"]
    for row in overhead.values():
        row["p50_over_none_ms"] = (row["p50_s"] - base) * 1000
        row["p50_ratio_vs_none"] = row["p50_s"] / base
        row["paired_ratio_vs_none"] = 1 + row["paired_over_none_p50_ms"] / 1000 / base
    return {
        "settings": {
            **setup.describe(),
            "chunks": args.chunks,
            "repeats": args.repeats,
            "next_chunk": NEXT_CHUNK,
            "sqlite": "WAL, synchronous=FULL",
            "postgresql": "Debian's server on loopback, fsync on" if "postgresql" in overhead else "absent",
        },
        "per_chunk": overhead,
        "resume": resume,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    stores = list(result["per_chunk"])
    left.bar(stores, [result["per_chunk"][s]["p50_s"] * 1000 for s in stores])
    left.set_ylabel("1-token chunk, p50 (ms)")
    left.set_title("per-chunk cost of the store")
    contexts = list(result["resume"])
    sides = ("device", "cpu_tier", "restart_recompute")
    for offset, side in zip((-0.27, 0, 0.27), sides):
        right.bar(
            [i + offset for i in range(len(contexts))],
            [result["resume"][c][f"{side}_p50_s"] * 1000 for c in contexts],
            width=0.27,
            label=side,
        )
    right.set_xticks(range(len(contexts)), [f"{c} tokens" for c in contexts])
    right.set_ylabel("resume, time to first token p50 (ms)")
    right.set_yscale("log")
    right.legend()
    figure.suptitle(f"session store ({result['settings']['model_preset']} model)")
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=1.0)
    parser.add_argument("--chunks", type=int, default=120, help="1-token chunks a store")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    args = parser.parse_args(argv)
    name = "store"
    if args.quick:
        quick_engine(args)
        args.chunks, args.repeats, args.contexts = 10, 1, [128]
        name = "store-quick"
    return name, args


async def run(name: str, args: argparse.Namespace) -> None:
    result = await measure_all(args)
    finish(name, result, args.out, plot)
    for store, row in result["per_chunk"].items():
        print(
            store,
            f"p50 {row['p50_s'] * 1000:.1f} ms (+{row['p50_over_none_ms']:.1f} ms;"
            f" paired +{row['paired_over_none_p50_ms']:.2f} ms, {row['paired_ratio_vs_none']:.3f}x)",
        )
    for context, row in result["resume"].items():
        print(context, {k: round(v, 3) for k, v in row.items() if isinstance(v, float)})


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
