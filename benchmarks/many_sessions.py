"""Many sessions: more context than the device holds, three ways.

S sessions run at once, each T turns of CHUNK new tokens and GEN generated tokens;
their total context is several times the device KV cache, so a server cannot keep
every session's KV on the device. Sides, one server at a time, same engine settings:

- ours: our server, SSE sessions; idle sessions park and resume from the CPU tier;
- vllm: vLLM's own OpenAI server, prefix caching on, the client resending the
  whole history every turn (its device cache thrashes);
- vllm+tier: the same vLLM server with our connector and CPU tier behind it.

Reports generated tokens/s and chunk TTFT p50/p99 per side, and ratios against vllm.

    python -m benchmarks.many_sessions            # bench model
    python -m benchmarks.many_sessions --quick    # tiny model (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path
from typing import Any

from app.settings import GIB
from benchmarks.common import (
    EngineSetup,
    benchmark_parser,
    finish,
    our_server,
    pyplot,
    quick_engine,
    random_tokens,
    vllm_server,
)
from benchmarks.concurrency import measure, ours_session, vllm_session

KV_BYTES_PER_TOKEN = {"bench": 12 * 1024, "tiny": 2 * 1024}  # bf16; twice as much in float32


def our_tier_config(setup: EngineSetup) -> str:
    """Our connector and host tier, as vLLM's --kv-transfer-config takes them."""
    from app.engine import kv_transfer_config
    from app.settings import Settings

    settings = Settings(
        _env_file=None, kv_cache_gib=setup.kv_cache_gib, cpu_tier_gib=setup.cpu_tier_gib, block_size=setup.block_size
    )
    return json.dumps(kv_transfer_config(settings))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    total_context = args.sessions * args.turns * (args.chunk + args.gen)
    dtype_bytes = 4 if args.dtype == "float32" else 2
    kv_gib = total_context / args.context_per_device * KV_BYTES_PER_TOKEN[args.preset] * dtype_bytes / 2 / GIB
    setup = EngineSetup(
        preset=args.preset,
        kv_cache_gib=kv_gib,
        cpu_tier_gib=args.cpu_tier_gib,
        dtype=args.dtype,
        max_model_len=args.turns * (args.chunk + args.gen) + 256,
    )
    rng = random.Random(args.seed)
    workloads = [[random_tokens(rng, args.chunk) for _ in range(args.turns)] for _ in range(args.sessions)]
    log_dir = Path(args.out) / "logs"
    results: dict[str, dict[str, float]] = {}

    # The workload oversubscribes the device on purpose; vLLM's server queues without
    # bound, so ours queues for as long as the run instead of failing fast with 503.
    with our_server(setup, log_dir, admission_timeout_s="3600") as server:
        results["ours"] = await measure(lambda c, t: ours_session(server.base_url, c, args.gen, t), workloads)
    for label, extra in (("vllm", []), ("vllm+tier", ["--kv-transfer-config", our_tier_config(setup)])):
        with vllm_server(setup, log_dir, prefix_caching=True, extra_args=extra, label=label) as server:
            results[label] = await measure(
                lambda c, t, url=server.base_url, model=server.model: vllm_session(url, model, c, args.gen, t),
                workloads,
            )
    base = results["vllm"]
    return {
        "settings": {
            **setup.describe(),
            "sessions": args.sessions,
            "turns": args.turns,
            "chunk": args.chunk,
            "gen": args.gen,
            "total_context_tokens": total_context,
            "context_over_device": args.context_per_device,
        },
        "results": results,
        "ratios_vs_vllm": {
            side: {
                "throughput": r["tokens_per_s"] / base["tokens_per_s"],
                "ttft_p50": r["ttft_p50_s"] / base["ttft_p50_s"],
                "ttft_p99": r["ttft_p99_s"] / base["ttft_p99_s"],
            }
            for side, r in results.items()
        },
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    sides = list(result["results"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(sides, [result["results"][s]["tokens_per_s"] for s in sides])
    left.set_ylabel("generated tokens / s")
    for offset, key in ((-0.2, "ttft_p50_s"), (0.2, "ttft_p99_s")):
        right.bar(
            [i + offset for i in range(len(sides))],
            [result["results"][s][key] * 1000 for s in sides],
            width=0.4,
            label=key.replace("ttft_", "").replace("_s", ""),
        )
    right.set_xticks(range(len(sides)), sides)
    right.set_ylabel("chunk time to first token (ms)")
    right.set_yscale("log")
    right.legend()
    settings = result["settings"]
    figure.suptitle(
        f"{settings['sessions']} sessions x {settings['turns']} turns, context "
        f"{settings['context_over_device']}x the device ({settings['model_preset']} model)"
    )
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, kv_cache_gib=0.0)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--context-per-device", type=float, default=4.0, help="total context / device cache")
    args = parser.parse_args()
    name = "many_sessions"
    if args.quick:
        quick_engine(args)
        # The device must still hold one max_model_len request.
        args.sessions, args.turns, args.chunk, args.gen, args.context_per_device = 4, 3, 200, 4, 2.0
        name = "many_sessions-quick"
    result = asyncio.run(main_async(args))
    finish(name, result, args.out, plot)
    for side, ratios in result["ratios_vs_vllm"].items():
        print(side, ratios)


if __name__ == "__main__":
    main()
