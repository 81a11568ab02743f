"""Where a REST chunk's time goes: stamps along its path in the client, the API server
and the engine core, beside the same chunks on the floor driven inside the server's process,
on the same engine (benchmarks/floor.py).

Every process stamps one clock, CLOCK_MONOTONIC (``time.perf_counter_ns`` here, and
vLLM's ``EngineCoreOutputs.timestamp``, ``time.monotonic`` in the engine core), so stamps
from different processes line up. The stamps, in the order a chunk passes them:

    recv      the API server reads the request (uvicorn's protocol)
    route     our middlewares have passed it to the chunk route (DirectRoute)
    admitted  start_chunk has checked it and taken its session (ChunkRun made)
    run       the chunk's task has started
    add0/1    vLLM's front end sends the chunk to the engine core (begin, end)
    engine    the engine core has its output (the step done)
    out       the front end has the output (ZMQ, decoded)
    stats0/1  vLLM's stat loggers record the step (begin, end)
    released  the chunk's task has ended and released its session
    answered  the route has its response
    written   the response goes to the socket

The floor has add0 to stats1 and its own start and end. The server runs in a process of its
own (``python -m benchmarks.chunk_timeline serve FILE``) with the stamps patched in and the
floor's route added, and writes them to FILE; floor and REST chunks alternate by rounds. Per segment: the p50 over the chunks, in microseconds. A diagnostic: the
patches cost a few microseconds each; benchmarks.transport measures the round trips.

    python -m benchmarks.chunk_timeline                # 200 chunks a side, in 5 rounds
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import bisect
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import floor
from benchmarks.common import (
    API_HEADERS,
    EngineSetup,
    add_loop_option,
    app_server,
    benchmark_parser,
    finish,
    our_settings,
    percentile,
    pyplot,
    quick_engine,
    run_on_loop,
)

SERVER_PATH = (
    "start",
    "recv",
    "route",
    "admitted",
    "run",
    "add0",
    "add1",
    "engine",
    "out",
    "stats0",
    "stats1",
    "released",
    "answered",
    "written",
    "end",
)
FLOOR_PATH = ("start", "add0", "add1", "engine", "out", "stats0", "stats1", "end")
# Stamps a chunk passes more than once (a delta before its result): the first counts
# before the engine, the last after it.
AFTER_ENGINE = {"engine", "out", "stats0", "stats1", "released", "answered", "written"}
STAMPS: list[tuple[str, int]] = []


def stamp(name: str) -> None:
    STAMPS.append((name, time.perf_counter_ns()))


def _around(owner: Any, name: str, before: str | None, after: str | None) -> None:
    """Stamp ``before`` and ``after`` around ``owner.name`` (a function or coroutine function)."""
    original = getattr(owner, name)
    if asyncio.iscoroutinefunction(original):

        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            if before:
                stamp(before)
            result = await original(*args, **kwargs)
            if after:
                stamp(after)
            return result

        setattr(owner, name, wrapped_async)
    else:

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if before:
                stamp(before)
            result = original(*args, **kwargs)
            if after:
                stamp(after)
            return result

        setattr(owner, name, wrapped)


def stamp_vllm() -> None:
    """vLLM's front end stamped (in this process: the server's)."""
    from vllm.v1.engine.core_client import AsyncMPClient
    from vllm.v1.metrics.loggers import StatLoggerManager

    _around(AsyncMPClient, "add_request_async", "add0", "add1")
    _around(StatLoggerManager, "record", "stats0", "stats1")
    get_output = AsyncMPClient.get_output_async

    async def get_output_async(self: Any) -> Any:
        outputs = await get_output(self)
        if outputs.outputs:
            STAMPS.append(("engine", int(outputs.timestamp * 1e9)))
            stamp("out")
        return outputs

    AsyncMPClient.get_output_async = get_output_async


def stamp_server() -> None:
    from app.api.sessions import rest
    from app.http import uvicorn_protocol as http_protocol
    from app.http.direct_route import DirectRoute
    from app.sessions.run import ChunkRun
    from app.sessions.service import SessionService

    stamp_vllm()
    _around(http_protocol.CoalescingHttpToolsProtocol, "data_received", "recv", None)
    _around(DirectRoute, "__call__", "route", None)
    _around(SessionService, "start_chunk", None, "admitted")
    _around(ChunkRun, "_drive", "run", None)
    _around(ChunkRun, "_on_done", "released", None)
    _around(rest, "direct_chunk_answer", None, "answered")  # before create_app takes it
    flush = http_protocol.CoalescingTransport.flush

    def flush_stamped(self: Any) -> None:
        if self._pending:
            stamp("written")
        flush(self)

    http_protocol.CoalescingTransport.flush = flush_stamped  # type: ignore[method-assign]


def serve(out: str) -> None:
    """The API server with its stamps, written to ``out`` every second and at exit."""

    def write() -> None:
        Path(out + ".tmp").write_text(json.dumps(list(STAMPS)))
        os.replace(out + ".tmp", out)

    def keep_writing() -> None:
        while True:
            time.sleep(1)
            write()

    stamp_server()
    atexit.register(write)
    threading.Thread(target=keep_writing, daemon=True).start()
    floor.serve()


def segments(path: tuple[str, ...], stamps: list[tuple[str, int]], spans: list[tuple[int, int]]) -> dict[str, float]:
    """Each segment's p50 in microseconds, over the chunks ``spans`` (start, end) bound."""
    stamps = sorted(stamps, key=lambda item: item[1])
    times = [at for _, at in stamps]
    rows = []
    for start, end in spans:
        row = {"start": start, "end": end}
        for name, at in stamps[bisect.bisect_left(times, start) : bisect.bisect_right(times, end)]:
            if name in path and (name in AFTER_ENGINE or name not in row):
                row[name] = at
        rows.append(row)
    return {
        f"{a}->{b}": percentile([(row[b] - row[a]) / 1e3 for row in rows if a in row and b in row], 50)
        for a, b in itertools.pairwise(path)
    }


async def rest_chunks(base: str, inputs: list[list[int]]) -> list[tuple[int, int]]:
    """REST chunks on a new session, with benchmarks.transport's client: each one's (start, end)."""
    import aiohttp

    from benchmarks.transport import http_session

    spans = []
    async with aiohttp.ClientSession(base, headers=API_HEADERS) as http:
        session_id, chunk = await http_session(http, stream=False)
        for ids in inputs:
            start = time.perf_counter_ns()
            await chunk(ids)
            spans.append((start, time.perf_counter_ns()))
        # Closed as transport's sides close theirs (an open session keeps its engine request).
        async with http.delete(f"/v1/sessions/{session_id}"):
            pass
    return spans


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    from benchmarks.transport import chunks

    setup = EngineSetup(
        preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib, dtype=args.dtype
    )
    inputs = chunks(args.seed, args.chunks + 10)
    per_round = args.chunks // args.rounds
    server_stamps = Path(args.out) / "logs" / "server-stamps.json"
    server_stamps.parent.mkdir(parents=True, exist_ok=True)
    floor_spans: list[tuple[int, int]] = []
    rest_spans: list[tuple[int, int]] = []
    command = [sys.executable, "-m", "benchmarks.chunk_timeline", "serve", str(server_stamps)]
    settings = {**our_settings(setup), "store_url": "none"}
    with app_server(
        "ours", server_stamps.parent / "ours.log", settings, model=f"embedded-{setup.preset}", command=command
    ) as server:
        async with aiohttp.ClientSession(server.base_url, headers=API_HEADERS) as http:
            await floor.spans_in_server(http, inputs[:10])
            await rest_chunks(server.base_url, inputs[:10])
            for index in range(args.rounds):
                part = inputs[10 + index * per_round : 10 + (index + 1) * per_round]
                floor_spans += await floor.spans_in_server(http, part)
                rest_spans += await rest_chunks(server.base_url, part)
        await asyncio.sleep(1.5)  # the server's next write of its stamps
    server_side = json.loads(server_stamps.read_text())
    return {
        "settings": {**setup.describe(), "chunks": args.chunks, "rounds": args.rounds, "max_tokens": 1},
        "floor_us": segments(FLOOR_PATH, server_side, floor_spans),
        "rest_us": segments(SERVER_PATH, server_side, rest_spans),
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(8, 4.5))
    sides = {"in-process": "floor_us", "REST": "rest_us"}
    for row, key in enumerate(sides.values()):
        left = 0.0
        for segment, width in result[key].items():
            if width != width or segment == "add1->engine":  # NaN, or the engine's step (off the scale)
                continue
            axis.barh(row, width, left=left)
            axis.text(left + width / 2, row, segment.split("->")[1], ha="center", va="center", fontsize=6, rotation=90)
            left += width
    axis.set_yticks(range(len(sides)), list(sides))
    axis.set_xlabel(
        "microseconds along one 1-token chunk: p50 per segment, each named by the stamp it ends at "
        "(the engine's step left out)"
    )
    axis.set_title("where a chunk's time goes")
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=0.25)
    parser.set_defaults(preset="tiny", dtype="float32", cpu_tier_gib=0.5)
    parser.add_argument("--chunks", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    add_loop_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        quick_engine(args)
        args.chunks, args.rounds = 10, 2
        return "chunk_timeline-quick", args
    return "chunk_timeline", args


async def run(name: str, args: argparse.Namespace) -> None:
    result = await main_async(args)
    finish(name, result, args.out, plot)
    for key in ("floor_us", "rest_us"):
        print(key.removesuffix("_us"), "  ".join(f"{segment} {value:.0f}" for segment, value in result[key].items()))


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
        return
    name, args = parse_args()
    run_on_loop(run(name, args), args.loop)


if __name__ == "__main__":
    main()
