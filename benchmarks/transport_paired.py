"""What each transport adds to a chunk, paired chunk by chunk with the floor on the same engine.

benchmarks.transport compares each side's p50 with the floor's over rounds of chunks;
on a VM whose engine step for the same chunk varies 2x from one chunk to the next and
drifts over seconds, those p50s move by a few tenths of a millisecond between runs.
Here every chunk is a group: the floor (benchmarks/floor.py, inside our server's
process, on its engine), then the same chunk over REST, SSE and the websocket (one
keep-alive connection and one session each, open for the whole run), then the floor
again; each transport's gap is its chunk's round trip less the mean of the two floor
chunks around it, milliseconds apart. Per side: the median, p25 and p75 of those gaps.
1-token chunks with ``max_tokens=1``, tiny model, float32, no store; clients as
benchmarks.transport's (aiohttp for REST and SSE, websockets for the websocket).

    python -m benchmarks.transport_paired            # 300 groups, about 1 minute
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import websockets

from benchmarks.common import (
    API_HEADERS,
    EngineSetup,
    add_loop_option,
    benchmark_parser,
    finish,
    percentile,
    pyplot,
    quick_engine,
    run_on_loop,
)
from benchmarks.floor import seconds, spans_in_server
from benchmarks.transport import chunks, http_session, transport_server, websocket_session

SIDES = ("rest", "sse", "websocket")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    setup = EngineSetup(
        preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib, dtype=args.dtype
    )
    inputs = chunks(args.seed, args.warmup + args.groups)
    floors: list[float] = []
    gaps: dict[str, list[float]] = {side: [] for side in SIDES}
    # benchmarks.transport's server (the smoke run shares it); this websocket client
    # offers no compression, so none is used.
    with transport_server(setup, Path(args.out) / "logs", name="ours-paired") as server:
        async with aiohttp.ClientSession(server.base_url, headers=API_HEADERS) as http:
            url = server.base_url.replace("http://", "ws://") + "/v1/sessions/ws"
            async with websockets.connect(url, additional_headers=API_HEADERS, compression=None) as ws:
                sides = {
                    "rest": (await http_session(http, stream=False))[1],
                    "sse": (await http_session(http, stream=True))[1],
                    "websocket": await websocket_session(ws),
                }

                async def floor(chunk: list[int]) -> float:
                    (floor_seconds,) = seconds(await spans_in_server(http, [chunk]))
                    return floor_seconds

                for index, chunk in enumerate(inputs):
                    before = await floor(chunk)
                    times = {side: await run(chunk) for side, run in sides.items()}
                    around = (before + await floor(chunk)) / 2
                    if index >= args.warmup:
                        floors.append(around)
                        for side, elapsed in times.items():
                            gaps[side].append(elapsed - around)
    return {
        "settings": {
            **setup.describe(),
            "groups": args.groups,
            "warmup": args.warmup,
            "chunk_tokens": 1,
            "max_tokens": 1,
        },
        "floor_p50_ms": 1000 * percentile(floors, 50),
        "per_side": {
            side: {
                "paired_gap_p50_ms": 1000 * percentile(values, 50),
                "paired_gap_p25_ms": 1000 * percentile(values, 25),
                "paired_gap_p75_ms": 1000 * percentile(values, 75),
            }
            for side, values in gaps.items()
        },
        "gaps_ms": {side: [round(1000 * value, 3) for value in values] for side, values in gaps.items()},
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.boxplot([result["gaps_ms"][side] for side in SIDES], showfliers=False)
    axis.set_xticks(range(1, len(SIDES) + 1), SIDES)
    axis.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axis.set_ylabel("round trip less the floor's around it (ms)")
    axis.set_title(f"per-chunk transport gap, paired (floor p50 {result['floor_p50_ms']:.2f} ms)")
    axis.grid(True, axis="y", alpha=0.3)
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=0.25)
    parser.set_defaults(preset="tiny", dtype="float32", cpu_tier_gib=0.5)
    parser.add_argument("--groups", type=int, default=300, help="measured chunks per side, each paired with the floor")
    parser.add_argument("--warmup", type=int, default=20)
    add_loop_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        quick_engine(args)
        args.groups, args.warmup = 8, 2
        return "transport_paired-quick", args
    return "transport_paired", args


async def run(name: str, args: argparse.Namespace) -> None:
    result = await main_async(args)
    finish(name, result, args.out, plot)
    print(f"floor p50 {result['floor_p50_ms']:.2f} ms")
    for side, row in result["per_side"].items():
        print(
            f"{side}: paired gap p50 {row['paired_gap_p50_ms']:+.2f} ms "
            f"(p25 {row['paired_gap_p25_ms']:+.2f}, p75 {row['paired_gap_p75_ms']:+.2f})"
        )


def main() -> None:
    name, args = parse_args()
    run_on_loop(run(name, args), args.loop)


if __name__ == "__main__":
    main()
