"""Benchmark 1: multi-turn resume. Does a resumed chunk cost the chunk, not the context?

Each session runs TURNS turns; each turn appends CHUNK new tokens and generates GEN.
Time to first token (TTFT) and total time per turn, for:

- ours-sse, ours-ws: our sessions over HTTP (SSE) and over the websocket;
- vllm-prefix-on, vllm-prefix-off: vLLM's own OpenAI server, the client resending the
  whole history each turn, with prefix caching on and off;
- in-process: an AsyncLLM streaming-input session in this process (the floor: no HTTP).

    python -m benchmarks.resume                   # bench model, 16 turns (about 10 minutes)
    python -m benchmarks.resume --quick           # tiny model, 3 turns (the test suite's smoke run)

Writes benchmarks/results/resume[-quick].json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    API_HEADERS,
    API_KEY,
    EngineSetup,
    benchmark_parser,
    finish,
    in_process_engine,
    our_server,
    plot_ttft_per_turn,
    quick_engine,
    random_tokens,
    release_engine,
    sse_completion,
    vllm_server,
)

Turns = list[tuple[float, float]]  # per turn: (ttft_s, total_s)


async def run_ours(base_url: str, transport: str, chunks: list[list[int]], gen: int) -> Turns:
    from clients import AsyncSessionsClient

    turns: Turns = []
    async with AsyncSessionsClient(base_url, API_KEY, max_retries=0, timeout=600) as client:
        async with client.sessions.create(
            defaults={"temperature": 0, "ignore_eos": True},
            transport=transport,  # type: ignore[arg-type]
        ) as session:
            for chunk in chunks:
                start = time.perf_counter()
                first: float | None = None
                async for _ in session.stream(chunk, max_tokens=gen):
                    if first is None:
                        first = time.perf_counter() - start
                total = time.perf_counter() - start
                turns.append((first if first is not None else total, total))
    return turns


async def reset_device_cache(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, headers=API_HEADERS) as http:
        (await http.post("/v1/admin/reset_device_cache")).raise_for_status()


async def run_vllm_resend(base_url: str, model: str, chunks: list[list[int]], gen: int) -> Turns:
    turns: Turns = []
    history: list[int] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        for chunk in chunks:
            history += chunk
            ttft, total, output = await sse_completion(http, model, history, gen)
            history += output
            turns.append((ttft, total))
    return turns


async def run_in_process(setup: EngineSetup, sessions: list[list[list[int]]], gen: int) -> list[Turns]:
    from vllm import SamplingParams
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind

    engine, _, _ = in_process_engine(setup, f"embedded-{setup.preset}", max_num_seqs=setup.max_num_seqs)
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    results: list[Turns] = []
    try:
        for number, chunks in enumerate(sessions):
            inputs: asyncio.Queue[StreamingInput | None] = asyncio.Queue()

            async def feed(queue: asyncio.Queue[StreamingInput | None] = inputs) -> Any:
                while (item := await queue.get()) is not None:
                    yield item

            outputs = engine.generate(prompt=feed(), sampling_params=params, request_id=f"bench-{number}")
            turns: Turns = []
            for chunk in chunks:
                start = time.perf_counter()
                # A copy: vLLM extends the first chunk's prompt list in place.
                inputs.put_nowait(StreamingInput(prompt=tokens_input(list(chunk)), sampling_params=params))
                first: float | None = None
                async for output in outputs:
                    if first is None and output.outputs[0].token_ids:
                        first = time.perf_counter() - start
                    if output.outputs[0].finish_reason is not None:
                        break
                total = time.perf_counter() - start
                turns.append((first if first is not None else total, total))
            inputs.put_nowait(None)
            async for _ in outputs:
                pass
            results.append(turns)
    finally:
        release_engine(engine)
    return results


def median_turns(runs: list[Turns]) -> list[dict[str, float]]:
    return [
        {
            "ttft_s": statistics.median(run[i][0] for run in runs),
            "total_s": statistics.median(run[i][1] for run in runs),
        }
        for i in range(len(runs[0]))
    ]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib, dtype=args.dtype
    )
    rng = random.Random(args.seed)
    # One warm-up session (2 turns) and REPEATS measured sessions, the same on every side.
    warmup = [random_tokens(rng, args.chunk) for _ in range(2)]
    sessions = [[random_tokens(rng, args.chunk) for _ in range(args.turns)] for _ in range(args.repeats)]
    log_dir = Path(args.out) / "logs"
    sides: dict[str, list[Turns]] = {}

    runs = await run_in_process(setup, [warmup, *sessions], args.gen)
    sides["in-process"] = runs[1:]

    with our_server(setup, log_dir) as server:
        for transport, side in (("rest", "ours-sse"), ("websocket", "ours-ws")):
            await run_ours(server.base_url, transport, warmup, args.gen)
            # Both transports replay the same chunks: drop the device prefix cache
            # first, or the second would find its first turn cached.
            await reset_device_cache(server.base_url)
            sides[side] = [await run_ours(server.base_url, transport, chunks, args.gen) for chunks in sessions]

    # --quick runs vLLM with prefix caching only: the other side is the same code.
    for prefix_caching in (True,) if args.quick else (True, False):
        with vllm_server(setup, log_dir, prefix_caching) as server:
            await run_vllm_resend(server.base_url, server.model, warmup, args.gen)
            sides[server.name] = [
                await run_vllm_resend(server.base_url, server.model, chunks, args.gen) for chunks in sessions
            ]

    per_turn = {side: median_turns(runs) for side, runs in sides.items()}
    last = args.turns - 1
    floor = per_turn["in-process"]
    summary = {
        "http_overhead_ttft_ratio_max": max(
            per_turn[s][i]["ttft_s"] / floor[i]["ttft_s"] for s in ("ours-sse", "ours-ws") for i in range(args.turns)
        ),
        "in_process_last_vs_first_ttft": floor[last]["ttft_s"] / floor[0]["ttft_s"],
        "last_turn_ttft_s": {side: turns[last]["ttft_s"] for side, turns in per_turn.items()},
        "last_turn_ours_sse_vs_vllm_prefix_on": per_turn["ours-sse"][last]["ttft_s"]
        / per_turn["vllm-prefix-on"][last]["ttft_s"],
    }
    if "vllm-prefix-off" in per_turn:
        summary["last_turn_vllm_prefix_off_vs_ours_sse"] = (
            per_turn["vllm-prefix-off"][last]["ttft_s"] / per_turn["ours-sse"][last]["ttft_s"]
        )
    return {
        "settings": {
            **setup.describe(),
            "turns": args.turns,
            "chunk_tokens": args.chunk,
            "gen_tokens": args.gen,
            "repeats": args.repeats,
            "seed": args.seed,
        },
        "summary": summary,
        "per_turn": per_turn,
    }


def plot(result: dict[str, Any]) -> Any:
    settings = result["settings"]
    return plot_ttft_per_turn(
        result["per_turn"],
        f"Resume: {settings['chunk_tokens']} new tokens + "
        f"{settings['gen_tokens']} generated per turn ({settings['model_preset']} model)",
    )


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=1.0)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    name = "resume"
    if args.quick:
        args.turns, args.repeats, args.chunk, args.gen = 3, 1, 64, 4
        quick_engine(args)
        name = "resume-quick"
    return name, args


async def run(name: str, args: argparse.Namespace) -> None:
    result = await main_async(args)
    finish(name, result, args.out, plot)


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
