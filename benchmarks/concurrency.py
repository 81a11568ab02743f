"""Benchmark 3: concurrency. N sessions at once, against vLLM's server resending history.

N in (1, 4, 16, 32) concurrent sessions, each TURNS turns of CHUNK new tokens and GEN
generated tokens, on our server (SSE sessions) and on vLLM's own OpenAI server with
prefix caching, the client resending the whole history each turn. Reports aggregate
generated tokens per second and p50/p99 time to first token per chunk.

    python -m benchmarks.concurrency             # bench model
    python -m benchmarks.concurrency --quick     # tiny model, N in (1, 2), 2 turns
    python -m benchmarks.concurrency --disk-tier-gib 8 --skip-vllm   # the disk tier's write-through cost
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    API_KEY,
    EngineSetup,
    benchmark_parser,
    finish,
    our_server,
    percentile,
    pyplot,
    quick_engine,
    random_tokens,
    sse_completion,
    vllm_server,
)


async def ours_session(base_url: str, chunks: list[list[int]], gen: int, ttfts: list[float]) -> int:
    from clients import AsyncSessionsClient

    generated = 0
    async with AsyncSessionsClient(base_url, API_KEY, max_retries=0, timeout=1200) as client:
        async with client.sessions.create(defaults={"temperature": 0, "ignore_eos": True}) as session:
            for chunk in chunks:
                start = time.perf_counter()
                first = None
                async for delta in session.stream(chunk, max_tokens=gen):
                    if first is None:
                        first = time.perf_counter() - start
                    generated += len(delta.token_ids)
                ttfts.append(first if first is not None else time.perf_counter() - start)
    return generated


async def vllm_session(base_url: str, model: str, chunks: list[list[int]], gen: int, ttfts: list[float]) -> int:
    generated = 0
    history: list[int] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=1200) as http:
        for chunk in chunks:
            history += chunk
            ttft, _, output = await sse_completion(http, model, history, gen)
            history += output
            generated += len(output)
            ttfts.append(ttft)
    return generated


async def measure(run_one: Any, workloads: list[list[list[int]]]) -> dict[str, float]:
    ttfts: list[float] = []
    start = time.perf_counter()
    generated = sum(await asyncio.gather(*(run_one(chunks, ttfts) for chunks in workloads)))
    wall = time.perf_counter() - start
    return {
        "tokens_per_s": generated / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "wall_s": wall,
        "generated_tokens": generated,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib, dtype=args.dtype
    )
    rng = random.Random(args.seed)
    workloads = {
        n: [[random_tokens(rng, args.chunk) for _ in range(args.turns)] for _ in range(n)] for n in args.sessions
    }
    warmup = [[random_tokens(rng, args.chunk) for _ in range(2)]]
    log_dir = Path(args.out) / "logs"
    results: dict[str, dict[str, Any]] = {}

    async def ours(side: str, **settings: str) -> None:
        results[side] = {}
        with our_server(setup, log_dir, **settings) as server:

            async def run_ours(chunks: list[list[int]], ttfts: list[float]) -> int:
                return await ours_session(server.base_url, chunks, args.gen, ttfts)

            await measure(run_ours, warmup)
            for n, workload in workloads.items():
                results[side][str(n)] = await measure(run_ours, workload)

    await ours("ours-sse")
    if args.disk_tier_gib:
        # The same server with the disk tier on: every chunk the CPU tier stores is also
        # written to a file (write-through), which is what this side measures.
        with tempfile.TemporaryDirectory(prefix="streamsess-bench-disk-", dir=args.disk_tier_dir) as directory:
            await ours("ours-sse-disk-tier", disk_tier_gib=str(args.disk_tier_gib), disk_tier_dir=directory)

    if not args.skip_vllm:
        results["vllm-prefix-on"] = {}
        with vllm_server(setup, log_dir, prefix_caching=True) as server:

            async def run_vllm(chunks: list[list[int]], ttfts: list[float]) -> int:
                return await vllm_session(server.base_url, server.model, chunks, args.gen, ttfts)

            await measure(run_vllm, warmup)
            for n, workload in workloads.items():
                results["vllm-prefix-on"][str(n)] = await measure(run_vllm, workload)

    def ratios_of(side: str, peer: str, name: str) -> dict[str, dict[str, float]]:
        return {
            n: {
                f"throughput_{name}": results[side][n]["tokens_per_s"] / results[peer][n]["tokens_per_s"],
                f"ttft_p50_{name}": results[side][n]["ttft_p50_s"] / results[peer][n]["ttft_p50_s"],
            }
            for n in results[side]
        }

    ratios: dict[str, dict[str, float]] = {str(n): {} for n in args.sessions}
    for side, peer, name in (
        ("ours-sse", "vllm-prefix-on", "ours_vs_vllm"),
        ("ours-sse-disk-tier", "ours-sse", "disk_tier_vs_without"),
    ):
        if side in results and peer in results:
            for n, row in ratios_of(side, peer, name).items():
                ratios[n].update(row)
    return {
        "settings": {
            **setup.describe(),
            "sessions": args.sessions,
            "turns": args.turns,
            "chunk_tokens": args.chunk,
            "gen_tokens": args.gen,
            "seed": args.seed,
            "disk_tier_gib": args.disk_tier_gib,
        },
        "results": results,
        "ratios": ratios,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for side, by_n in result["results"].items():
        ns = [int(n) for n in by_n]
        left.plot(ns, [by_n[str(n)]["tokens_per_s"] for n in ns], marker="o", label=side)
        right.plot(ns, [by_n[str(n)]["ttft_p50_s"] * 1000 for n in ns], marker="o", label=f"{side} p50")
        right.plot(ns, [by_n[str(n)]["ttft_p99_s"] * 1000 for n in ns], marker="x", linestyle="--", label=f"{side} p99")
    left.set_xlabel("concurrent sessions")
    left.set_ylabel("generated tokens / s")
    right.set_xlabel("concurrent sessions")
    right.set_ylabel("time to first token per chunk (ms)")
    right.set_yscale("log")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.suptitle(f"Concurrency ({result['settings']['model_preset']} model)")
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=2.0)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument(
        "--disk-tier-gib", type=float, default=0.0, help="also run our server with a disk tier of this size (0: not)"
    )
    parser.add_argument("--disk-tier-dir", default=None, help="where that side's disk tier goes (a disk, not tmpfs)")
    parser.add_argument("--skip-vllm", action="store_true", help="our sides only")
    args = parser.parse_args(argv)
    name = "concurrency"
    if args.quick:
        args.sessions, args.turns, args.chunk, args.gen = [1, 2], 2, 64, 4
        quick_engine(args)
        name = "concurrency-quick"
    return name, args


async def run(name: str, args: argparse.Namespace) -> None:
    result = await main_async(args)
    finish(name, result, args.out, plot)
    for n, ratio in result["ratios"].items():
        print(n, ratio)


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
