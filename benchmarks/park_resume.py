"""Resume from park: what a parked session's next chunk costs.

A session's first chunk has C tokens of context (C in 512, 1,024, 2,048); its next
chunk (32 tokens, max_tokens=1) is timed to its first token when the session:

- never-parked: kept its engine request (its KV on the device);
- parked, device: was parked; the device prefix cache still holds its blocks;
- parked, cpu-tier: was parked, and the device cache was reset: its KV loads from
  our CPU tier (including its last chunk's outputs, the session tail store);
- recompute: the same prompt as one request that may read no cache.

In process, through our SessionService, on one engine, so the ratios come from one run.

    python -m benchmarks.park_resume            # bench model
    python -m benchmarks.park_resume --quick    # tiny model, one size (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from benchmarks.common import (
    EngineSetup,
    benchmark_parser,
    finish,
    in_process_engine,
    pyplot,
    quick_engine,
    random_tokens,
    release_engine,
)

SIDES = ("never-parked", "parked-device", "parked-cpu-tier", "recompute")
NEXT_CHUNK = 32
OWNER = "bench"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input

    from app.protocol import SamplingOptions, SessionCreateRequest, SessionDefaults
    from app.wiring import session_service

    setup = EngineSetup(
        preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib, dtype=args.dtype
    )
    engine, recorder, settings = in_process_engine(setup, "park-bench", session_park_after_s=3600)
    service = session_service(engine, settings, recorder=recorder)
    await service.start()
    rng = random.Random(args.seed)
    defaults = SessionDefaults(temperature=0.0, ignore_eos=True)

    async def chunk(session_id: str, ids: list[int]) -> Any:
        run = await service.start_chunk(
            OWNER, session_id, ids, SamplingOptions(max_tokens=1), transport="bench", wait=True
        )
        return await run.result()

    async def resume(context: int, side: str) -> tuple[float, int]:
        """(time to first token of the next chunk, its CPU-tier tokens)."""
        first, following = random_tokens(rng, context), random_tokens(rng, NEXT_CHUNK)
        if side == "recompute":
            params = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True)
            start = time.perf_counter()
            async for _ in engine.generate(
                prompt=tokens_input(first + following), sampling_params=params, request_id=f"recompute-{rng.random()}"
            ):
                pass
            return time.perf_counter() - start, 0
        session = await service.create(OWNER, SessionCreateRequest(defaults=defaults))
        try:
            await chunk(session.id, first)
            if side != "never-parked":
                await service.park(OWNER, session.id)
            if side == "parked-cpu-tier":
                assert await engine.reset_prefix_cache(), "device cache reset refused"
            result = await chunk(session.id, following)
        finally:
            await service.close(OWNER, session.id)
        assert result.time_to_first_token is not None
        return result.time_to_first_token, result.usage.prompt_tokens_details.cpu_tier_tokens

    rows = []
    try:
        await resume(64, "never-parked")  # warm-up
        for context in args.sizes:
            samples: dict[str, list[float]] = {side: [] for side in SIDES}
            tier_tokens: list[int] = []
            for _ in range(args.repeats):
                for side in SIDES:
                    elapsed, from_tier = await resume(context, side)
                    samples[side].append(elapsed)
                    if side == "parked-cpu-tier":
                        tier_tokens.append(from_tier)
            medians = {side: statistics.median(values) for side, values in samples.items()}
            rows.append(
                {
                    "context_tokens": context,
                    "ttft_s": medians,
                    "cpu_tier_tokens": statistics.median(tier_tokens),
                    "tier_vs_never_parked": medians["parked-cpu-tier"] / medians["never-parked"],
                    "device_vs_never_parked": medians["parked-device"] / medians["never-parked"],
                    "recompute_vs_tier": medians["recompute"] / medians["parked-cpu-tier"],
                }
            )
    finally:
        await service.stop()
        release_engine(engine)
    return {
        "settings": {**setup.describe(), "repeats": args.repeats, "seed": args.seed, "next_chunk": NEXT_CHUNK},
        "rows": rows,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    rows = result["rows"]
    figure, axis = plt.subplots(figsize=(9, 5))
    width = 0.2
    for offset, side in enumerate(SIDES):
        axis.bar(
            [i + (offset - 1.5) * width for i in range(len(rows))],
            [row["ttft_s"][side] * 1000 for row in rows],
            width,
            label=side,
        )
    axis.set_xticks(range(len(rows)), [f"{row['context_tokens']} tokens" for row in rows])
    axis.set_yscale("log")
    axis.set_ylabel("next chunk: time to first token (ms)")
    axis.set_title(f"Resume from park ({result['settings']['model_preset']} model)")
    axis.grid(True, axis="y", which="both", alpha=0.3)
    axis.legend()
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=1.0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    name = "park_resume"
    if args.quick:
        args.sizes, args.repeats = [256], 1
        quick_engine(args)
        name = "park_resume-quick"
    return name, args


async def run(name: str, args: argparse.Namespace) -> None:
    result = await main_async(args)
    finish(name, result, args.out, plot)
    for row in result["rows"]:
        print(row)


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
