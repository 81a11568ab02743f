"""Prefill and decode speed of each model preset, bf16 and float32, in one run.

For each preset and dtype, one in-process engine (the servers' thread count):

- prefill: a fresh prompt of P tokens (no cache can hold it), ``max_tokens=1``, timed
  to its end: P / time is prefill tokens/s;
- decode: one request of a short prompt generating N tokens with ``ignore_eos``,
  timed from its first token to its last: (N - 1) / time is decode tokens/s.

Each is the median of ``--repeats``. Prompts are token ids drawn below 700, which every
preset's vocabulary has.

    python -m benchmarks.models                   # all presets, bf16 and float32
    python -m benchmarks.models --quick           # tiny only, float32 (the suite's smoke run)
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
    random_tokens,
    release_engine,
)

PRESETS = ("tiny", "bench", "smollm2-135m-instruct")
DTYPES = ("bfloat16", "float32")


async def measure(
    setup: EngineSetup, prefill_tokens: int, decode_tokens: int, repeats: int, rng: random.Random
) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input

    engine, _, _ = in_process_engine(setup, f"models-{setup.preset}")
    try:

        async def run(prompt: list[int], max_tokens: int) -> tuple[float, float]:
            """(seconds to the first token, seconds from the first token to the last)."""
            params = SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True, skip_reading_prefix_cache=True
            )
            start = time.perf_counter()
            first = last = start
            async for output in engine.generate(
                prompt=tokens_input(prompt), sampling_params=params, request_id=f"models-{rng.random()}"
            ):
                last = time.perf_counter()
                if len(output.outputs[0].token_ids) == 1:
                    first = last
            return first - start, last - first

        await run(random_tokens(rng, 64), 8)  # warm-up: the first step of an engine is slow
        prefill = [await run(random_tokens(rng, prefill_tokens), 1) for _ in range(repeats)]
        decode = [await run(random_tokens(rng, 16), decode_tokens) for _ in range(repeats)]
    finally:
        release_engine(engine)
    prefill_s = statistics.median(first for first, _ in prefill)
    decode_s = statistics.median(rest for _, rest in decode)
    return {
        "prefill_tokens": prefill_tokens,
        "prefill_s": prefill_s,
        "prefill_tok_s": prefill_tokens / prefill_s,
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "decode_tok_s": (decode_tokens - 1) / decode_s,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    rows = result["rows"]
    labels = [f"{row['preset']}\n{row['dtype']}" for row in rows]
    for axis, key, title in (
        (axes[0], "prefill_tok_s", "prefill tokens/s"),
        (axes[1], "decode_tok_s", "decode tokens/s"),
    ):
        axis.bar(range(len(rows)), [row[key] for row in rows])
        axis.set_xticks(range(len(rows)), labels, fontsize=7)
        axis.set_title(title)
    figure.suptitle(f"one request, {result['cpu_flags']}")
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=1.0)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.presets, args.dtypes, args.prefill_tokens, args.decode_tokens, args.repeats = "tiny", "float32", 256, 16, 1
        args.kv_cache_gib, args.cpu_tier_gib = 0.25, 0.5
    return "models", args


async def run(name: str, args: argparse.Namespace) -> None:
    await run_all(args, name)


def main() -> None:
    asyncio.run(run(*parse_args()))


async def run_all(args: argparse.Namespace, name: str = "models") -> None:
    from connectors.cpu_platform import kernel_flags

    rng = random.Random(args.seed)
    rows = []
    for preset in args.presets.split(","):
        for dtype in args.dtypes.split(","):
            setup = EngineSetup(
                preset=preset,
                kv_cache_gib=args.kv_cache_gib,
                cpu_tier_gib=args.cpu_tier_gib,
                dtype=dtype,
                max_model_len=max(4096, args.prefill_tokens + 64),
            )
            row = {
                "preset": preset,
                "dtype": dtype,
                **await measure(setup, args.prefill_tokens, args.decode_tokens, args.repeats, rng),
            }
            print(row, flush=True)
            rows.append(row)
    finish(name, {"cpu_flags": " ".join(kernel_flags()), "repeats": args.repeats, "rows": rows}, args.out, plot)


if __name__ == "__main__":
    main()
