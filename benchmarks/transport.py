"""What each transport adds to a chunk: REST, SSE and websocket against the same
session driven in process on AsyncLLM (the floor: the engine's own streaming input).
Two floors (benchmarks/floor.py): ``in-server``, driven inside our server's process on
its own engine, the one the transports use (the gap to it is what a transport adds);
and ``in-process``, on an engine of the benchmark's own, as before 2026-12-05 (commit 555f9d5; two
engine processes of the same settings differ in speed from run to run by as much as
a transport costs). benchmarks/transport_paired.py pairs each chunk with the floor's
around it instead of p50 with p50: the figure that holds still between runs.

--chunks chunks of one token each with max_tokens=1 (so the engine's work is as small
as it gets and what is left is the transport), after --warmup chunks, in --rounds
round-robin rounds over the sides (a session per side and round, its first chunks
unmeasured; the floor's engine and the server's run side by side, each idle while the
other works, with a pause between them so that neither spins beside the other: see
SWITCH_SETTLE_S); per side the p50 and p90 of the chunk's round trip (send to the
chunk's end), the p50 over each floor in milliseconds (and per round, over the floor's
p50 of the same round: this machine's speed drifts within a run), the client's own CPU time per
chunk, and the API server process's CPU time per chunk (its engine's processes not
counted). Clients: aiohttp for REST and SSE, websockets for the websocket (keep-alive,
no wrapper of ours); ``rest-httpx`` and ``sse-httpx`` repeat REST and SSE with httpx,
whose client costs several milliseconds of CPU per request here. No store
(store_url=none), so the figures are the transport's, not the database's
(benchmarks/store.py measures that).

The server offers permessage-deflate (``ws_per_message_deflate``, off by default), so
one run measures the websocket both ways: ``websocket`` with a client that does not
offer it (what every client gets from a default server) and ``websocket-deflate``
with one that does (the websockets library's and browsers' default).

``--profile DIR`` samples the API server with py-spy during each side and round, writes
the last round's collapsed stacks there, and per side and round the busiest functions
(self time) to the result.

    python -m benchmarks.transport            # tiny model, float32, 120 chunks in 8 rounds
    python -m benchmarks.transport --profile benchmarks/results/profiles
    python -m benchmarks.transport --quick    # 8 chunks (the test suite's smoke run)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import websockets

from benchmarks.common import (
    API_HEADERS,
    SWITCH_SETTLE_S,
    EngineSetup,
    RunningServer,
    add_loop_option,
    app_server,
    benchmark_parser,
    finish,
    free_port,
    in_process_engine,
    our_settings,
    percentile,
    py_spy_sampled,
    pyplot,
    quick_engine,
    release_engine,
    run_on_loop,
    serve,
    summarize_profile,
)
from benchmarks.floor import SERVE_COMMAND, EngineSession, seconds, spans_in_server

# Two floors (benchmarks/floor.py): the session on an engine of this process's own, and
# on the server's own engine, driven inside the server's process (``in-server``), which
# the transports are compared with first: the same engine, so its speed is not the gap.
SIDES = (
    "in-process",
    "in-server",
    "rest",
    "sse",
    "websocket",
    "websocket-deflate",
    "rest-httpx",
    "sse-httpx",
    "rest-bare",
    "sse-bare",
    "websocket-bare",
)
FLOORS = SIDES[:2]
SERVER_SIDES = SIDES[1:]
# The hop alone: the same client against benchmarks/bare_hop.py (uvicorn as the app
# serves, an ASGI app that answers at once). A transport's own cost is what it adds
# over the floor beyond that hop; the hop is this machine's (its loopback and its
# process wake-ups), and no server can take less.
BARE = "-bare"
BARE_HOP_OF = {
    "rest": "rest-bare",
    "sse": "sse-bare",
    "websocket": "websocket-bare",
    "websocket-deflate": "websocket-bare",
}  # the same client library
PROFILE_RATE_HZ = 250
# The floor's engine and the server's run side by side: between them the benchmark
# waits out the spin (common.SWITCH_SETTLE_S), then warms the next side up with
# unmeasured chunks.
WARM_CHUNKS = 3


def chunks(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 700)] for _ in range(count)]


# One chunk's round trip, in seconds, on a session a client holds open.
Chunk = Callable[[list[int]], Awaitable[float]]
GREEDY = {"temperature": 0, "ignore_eos": True}


async def rest(base: str, inputs: list[list[int]], stream: bool) -> list[float]:
    """REST or SSE chunks with aiohttp's client (keep-alive)."""
    import aiohttp

    async with aiohttp.ClientSession(base, headers=API_HEADERS, timeout=aiohttp.ClientTimeout(total=60)) as http:
        session_id, chunk = await http_session(http, stream)
        times = [await chunk(ids) for ids in inputs]
        async with http.delete(f"/v1/sessions/{session_id}"):
            pass
    return times


async def http_session(http: Any, stream: bool) -> tuple[str, Chunk]:
    """A new session's id, and its chunks over REST (SSE with ``stream``) on ``http``, an
    aiohttp session (keep-alive)."""
    async with http.post("/v1/sessions", json={"defaults": GREEDY}) as response:
        session_id = (await response.json())["id"]

    async def chunk(ids: list[int]) -> float:
        start = time.perf_counter()
        async with http.post(
            f"/v1/sessions/{session_id}/chunks", json={"input": ids, "max_tokens": 1, "stream": stream}
        ) as response:
            response.raise_for_status()
            if stream:
                async for line in response.content:
                    if line.rstrip() == b"data: [DONE]":
                        break
            else:
                await response.read()
        return time.perf_counter() - start

    return session_id, chunk


async def rest_httpx(base: str, inputs: list[list[int]], stream: bool) -> list[float]:
    """The same with httpx's client, to show what a client library costs."""
    times = []
    async with httpx.AsyncClient(base_url=base, headers=API_HEADERS, timeout=60) as http:
        session_id = (await http.post("/v1/sessions", json={"defaults": GREEDY})).json()["id"]
        for chunk in inputs:
            body = {"input": chunk, "max_tokens": 1, "stream": stream}
            start = time.perf_counter()
            if stream:
                async with http.stream("POST", f"/v1/sessions/{session_id}/chunks", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if line == "data: [DONE]":
                            break
            else:
                (await http.post(f"/v1/sessions/{session_id}/chunks", json=body)).raise_for_status()
            times.append(time.perf_counter() - start)
        await http.delete(f"/v1/sessions/{session_id}")
    return times


async def websocket(base: str, inputs: list[list[int]], deflate: bool) -> list[float]:
    url = base.replace("http://", "ws://") + "/v1/sessions/ws"
    async with websockets.connect(
        url, additional_headers=API_HEADERS, compression="deflate" if deflate else None
    ) as ws:
        chunk = await websocket_session(ws)
        times = [await chunk(ids) for ids in inputs]
        await ws.send(json.dumps({"type": "session.close"}))
    return times


async def websocket_session(ws: Any) -> Chunk:
    """The chunks of the session a new ``/v1/sessions/ws`` connection opened."""
    json.loads(await ws.recv())  # session.created
    await ws.send(json.dumps({"type": "session.update", "session": GREEDY}))
    json.loads(await ws.recv())

    async def chunk(ids: list[int]) -> float:
        start = time.perf_counter()
        await ws.send(json.dumps({"type": "input.append", "input": ids, "max_tokens": 1}))
        while (event := json.loads(await ws.recv()))["type"] != "response.done":
            if event["type"] == "error":  # a refused append has no response.done: fail, not wait
                raise RuntimeError(f"websocket chunk refused: {event['error']}")
        return time.perf_counter() - start

    return chunk


async def main_async(args: Any) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib, dtype=args.dtype
    )
    inputs = chunks(args.seed, args.warmup + args.chunks)
    warmup, measured = inputs[: args.warmup], inputs[args.warmup :]
    warm = warmup[:WARM_CHUNKS]  # each side's unmeasured chunks in every round
    rounds = [measured[i :: args.rounds] for i in range(args.rounds)]
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    by_round: dict[str, list[float]] = {side: [] for side in SIDES}  # each round's p50
    profiles: dict[str, Any] = {}
    # This process's CPU time while a side runs: the client's own work (the floor's
    # engine here is idle meanwhile), which the round trip includes; and the API
    # server process's own (not its engine's): what the transport costs the server.
    # For the floor, this process is the client and AsyncLLM's front end in one: the
    # server's CPU per chunk beyond it is what serving over a transport costs.
    client_cpu: dict[str, float] = dict.fromkeys(SIDES, 0.0)
    server_cpu: dict[str, float] = dict.fromkeys(SERVER_SIDES, 0.0)
    floor = EngineSession(in_process_engine(setup, f"embedded-{setup.preset}")[0])
    try:
        log_dir = Path(args.out) / "logs"
        with transport_server(setup, log_dir, extra=dict(args.server_setting)) as ours, bare_hop(log_dir) as bare:

            def server_of(side: str) -> RunningServer:
                return bare if side.endswith(BARE) else ours

            await floor.run(warmup)
            for side in SERVER_SIDES:
                await run_side(server_of(side).base_url, side, warmup)
            # Round-robin, every side in every round (the floor too, its engine idle
            # meanwhile), so drift in this machine's speed hits all sides alike.
            for round_inputs in rounds:
                await asyncio.sleep(SWITCH_SETTLE_S)
                cpu_before = time.process_time()
                round_times = (await floor.run(warm + round_inputs))[len(warm) :]
                times["in-process"] += round_times
                by_round["in-process"].append(percentile(round_times, 50))
                client_cpu["in-process"] += time.process_time() - cpu_before
                await asyncio.sleep(SWITCH_SETTLE_S)
                for side in SERVER_SIDES:
                    server = server_of(side)
                    with contextlib.ExitStack() as stack:
                        if args.profile:
                            profile = stack.enter_context(
                                py_spy_sampled(server.process.pid, Path(args.profile) / f"{side}.txt", PROFILE_RATE_HZ)
                            )
                        cpu_before, server_before = time.process_time(), process_cpu_s(server.process.pid)
                        round_times = (await run_side(server.base_url, side, warm + round_inputs))[len(warm) :]
                        times[side] += round_times
                        by_round[side].append(percentile(round_times, 50))
                        client_cpu[side] += time.process_time() - cpu_before
                        server_cpu[side] += process_cpu_s(server.process.pid) - server_before
                    if args.profile:
                        profiles.setdefault(side, []).append(summarize_profile(profile, per=len(round_inputs)))
    finally:
        await floor.close()
        release_engine(floor.engine)
    per_side = {
        side: {
            "p50_ms": 1000 * percentile(values, 50),
            "p90_ms": 1000 * percentile(values, 90),
            **{key: value for name in FLOORS for key, value in over_floor(name, side, times, by_round).items()},
            # Warm-up chunks included: CPU is counted over a whole side.
            "client_cpu_ms_per_chunk": 1000 * client_cpu[side] / (len(values) + args.rounds * len(warm)),
            "server_cpu_ms_per_chunk": 1000 * server_cpu[side] / (len(values) + args.rounds * len(warm))
            if side in server_cpu
            else None,
        }
        for side, values in times.items()
    }
    return {
        "settings": {
            **setup.describe(),
            "chunks": args.chunks,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "chunk_tokens": 1,
            "max_tokens": 1,
            "server_settings": dict(args.server_setting),
        },
        "per_side": per_side,
        "samples_ms": {side: [round(1000 * t, 3) for t in values] for side, values in times.items()},
        "profiles": profiles,
    }


def over_floor(
    floor: str, side: str, times: dict[str, list[float]], by_round: dict[str, list[float]]
) -> dict[str, Any]:
    """``side``'s p50 over ``floor``'s, in milliseconds: over the whole run, paired by
    round (the floor's p50 of the same round, seconds apart: this machine's speed drifts
    by more than a transport costs within a run), and beyond the bare hop of its client."""
    key = floor.replace("-", "_")
    mine, floor_p50 = percentile(times[side], 50), percentile(times[floor], 50)
    hop = BARE_HOP_OF.get(side)
    return {
        f"p50_over_{key}_ms": 1000 * (mine - floor_p50),
        f"round_p50_over_{key}_ms": [
            round(1000 * (a - b), 3) for a, b in zip(by_round[side], by_round[floor], strict=True)
        ],
        f"p50_over_{key}_and_bare_hop_ms": 1000 * (mine - floor_p50 - percentile(times[hop], 50)) if hop else None,
    }


def transport_server(
    setup: EngineSetup, log_dir: Path, name: str = "ours", extra: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[RunningServer]:
    """Our server as the transport benchmarks run it, with the floor's route
    (benchmarks/floor.py): no store, websocket compression offered, no per-connection
    event limit (a long run's appends come faster than its default). The same settings
    for every such benchmark, so the smoke run starts it once."""
    settings = {
        **our_settings(setup),
        "store_url": "none",
        "ws_per_message_deflate": "true",
        "ws_events_per_second": "0",
        **(extra or {}),
    }
    return app_server(name, log_dir / f"{name}.log", settings, model=f"embedded-{setup.preset}", command=SERVE_COMMAND)


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process's threads have run, to the nanosecond (the scheduler's own
    count in /proc/<pid>/task/*/schedstat; /proc's stat counts in 10 ms ticks)."""
    total_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total_ns += int((task / "schedstat").read_text().split()[0])
    return total_ns / 1e9


@contextlib.contextmanager
def bare_hop(log_dir: Path) -> Iterator[RunningServer]:
    port = free_port()
    with serve(
        "bare-hop",
        [sys.executable, "-m", "benchmarks.bare_hop", str(port)],
        dict(os.environ),
        port,
        "none",
        log_dir / "bare-hop.log",
    ) as server:
        yield server


async def run_side(base: str, side: str, inputs: list[list[int]]) -> list[float]:
    side = side.removesuffix(BARE)
    if side == "in-server":
        import aiohttp

        async with aiohttp.ClientSession(base, headers=API_HEADERS) as http:
            return seconds(await spans_in_server(http, inputs))
    if side.startswith("websocket"):
        return await websocket(base, inputs, deflate=side == "websocket-deflate")
    if side.endswith("-httpx"):
        return await rest_httpx(base, inputs, stream=side.startswith("sse"))
    return await rest(base, inputs, stream=side == "sse")


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    sides = list(result["per_side"])
    axis.boxplot([result["samples_ms"][side] for side in sides], showfliers=False)
    axis.set_xticks(range(1, len(sides) + 1), sides, rotation=20)
    axis.set_ylabel("1-token chunk round trip (ms)")
    axis.set_title("per-chunk cost of each transport (max_tokens=1)")
    axis.grid(True, axis="y", alpha=0.3)
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=0.25)
    parser.set_defaults(preset="tiny", dtype="float32", cpu_tier_gib=0.5)
    parser.add_argument("--chunks", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--rounds", type=int, default=8, help="round-robin rounds over the sides (more: less drift between sides)"
    )
    parser.add_argument("--profile", metavar="DIR", help="sample the API server with py-spy, stacks into DIR")
    parser.add_argument(
        "--server-setting",
        metavar="NAME=VALUE",
        action="append",
        default=[],
        type=lambda text: tuple(text.split("=", 1)),
        help="a setting of the server (e.g. http_coalesce_writes=false); repeatable",
    )
    add_loop_option(parser)
    args = parser.parse_args(argv)
    name = "transport"
    if args.quick:
        quick_engine(args)
        args.chunks, args.warmup, args.rounds = 8, 2, 2
        name = "transport-quick"
    return name, args


async def run(name: str, args: argparse.Namespace) -> None:
    result = await main_async(args)
    finish(name, result, args.out, plot)
    for side, row in result["per_side"].items():
        gaps = []
        for floor in FLOORS if side not in FLOORS else ():
            key = floor.replace("-", "_")
            beyond_hop, paired = row[f"p50_over_{key}_and_bare_hop_ms"], sorted(row[f"round_p50_over_{key}_ms"])
            gaps.append(
                f"over {floor} {row[f'p50_over_{key}_ms']:+.2f} ms"
                + (f" ({beyond_hop:+.2f} beyond the bare hop)" if beyond_hop is not None else "")
                + f", by round {percentile(paired, 50):+.2f} ({paired[0]:+.2f} to {paired[-1]:+.2f})"
            )
        print(f"{side}: p50 {row['p50_ms']:.2f} ms" + "".join(f"; {gap}" for gap in gaps))


def main() -> None:
    name, args = parse_args()
    run_on_loop(run(name, args), args.loop)


if __name__ == "__main__":
    main()
