"""What one loopback hop costs on this machine after its processes have idled as long as
an engine step: the bare hop (benchmarks.bare_hop) with the server waiting before it answers.

benchmarks.transport's ``*-bare`` sides answer at once, so neither the client nor the server
ever sleeps; a chunk's round trip has both asleep for the engine's step (4 ms for the
tiny model here), and waking a process from idle costs time on some machines (a VM's idle
vCPU halts). Here the server waits ``--waits-ms`` before answering (an asyncio sleep, its
length measured in the server and sent back), and the hop is the round trip less that
wait: per wait, the p50 over ``--chunks`` requests in ``--rounds`` rounds, for the REST
client of benchmarks.transport (aiohttp) and its websocket client's library.

    python -m benchmarks.idle_hop            # waits 0, 1, 2, 4 and 8 ms; about 1 minute
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import websockets

from benchmarks import bare_hop
from benchmarks.common import (
    add_loop_option,
    finish,
    free_port,
    percentile,
    pyplot,
    run_on_loop,
    serve,
)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers after the wait its path names (``/wait/{microseconds}``; any other path, such
    as the start's ``/health``, at once), with the time it really waited: over HTTP in the
    body, over a websocket in each reply."""
    if scope["type"] == "http":
        await receive()
        path: str = scope["path"]
        waited = await _wait(int(path.removeprefix("/wait/")) if path.startswith("/wait/") else 0)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps({"waited_ns": waited}).encode()})
    elif scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while (message := await receive())["type"] == "websocket.receive":
            waited = await _wait(int(json.loads(message["text"])["wait_us"]))
            await send({"type": "websocket.send", "text": json.dumps({"waited_ns": waited})})
    elif scope["type"] == "lifespan":
        await bare_hop.lifespan(receive, send)


async def _wait(microseconds: int) -> int:
    start = time.perf_counter_ns()
    if microseconds:
        await asyncio.sleep(microseconds / 1e6)
    return time.perf_counter_ns() - start


async def rest_hops(base: str, wait_us: int, count: int) -> list[float]:
    import aiohttp

    hops = []
    async with aiohttp.ClientSession(base) as http:
        for _ in range(count):
            start = time.perf_counter_ns()
            async with http.post(f"/wait/{wait_us}", json={"input": [1], "max_tokens": 1}) as response:
                waited = (await response.json())["waited_ns"]
            hops.append((time.perf_counter_ns() - start - waited) / 1e6)
    return hops


async def websocket_hops(base: str, wait_us: int, count: int) -> list[float]:
    hops = []
    async with websockets.connect(base.replace("http://", "ws://") + "/ws", compression=None) as ws:
        for _ in range(count):
            start = time.perf_counter_ns()
            await ws.send(json.dumps({"type": "input.append", "input": [1], "wait_us": wait_us}))
            waited = json.loads(await ws.recv())["waited_ns"]
            hops.append((time.perf_counter_ns() - start - waited) / 1e6)
    return hops


CLIENTS = {"rest": rest_hops, "websocket": websocket_hops}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    hops: dict[str, dict[str, list[float]]] = {side: {str(w): [] for w in args.waits_ms} for side in CLIENTS}
    command = [sys.executable, "-m", "benchmarks.idle_hop", "serve", str(port)]
    with serve("idle-hop", command, dict(os.environ), port, "none", args.log):
        base = f"http://127.0.0.1:{port}"
        for warm_up in CLIENTS.values():
            await warm_up(base, 0, 20)  # connections and caches warm
        # Round-robin over the waits and clients, so drift in this machine's speed hits all alike.
        for _ in range(args.rounds):
            for wait in args.waits_ms:
                for side, client in CLIENTS.items():
                    hops[side][str(wait)] += await client(base, int(wait * 1000), args.chunks // args.rounds)
    return {
        "settings": {"waits_ms": args.waits_ms, "chunks": args.chunks, "rounds": args.rounds},
        "hop_p50_ms": {
            side: {wait: percentile(values, 50) for wait, values in per_wait.items()} for side, per_wait in hops.items()
        },
        "hop_p90_ms": {
            side: {wait: percentile(values, 90) for wait, values in per_wait.items()} for side, per_wait in hops.items()
        },
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    for side, per_wait in result["hop_p50_ms"].items():
        axis.plot([float(w) for w in per_wait], [1000 * v for v in per_wait.values()], marker="o", label=side)
    axis.set_xlabel("the server's wait before it answers (ms)")
    axis.set_ylabel("round trip less the wait, p50 (us)")
    axis.set_title("a loopback hop after idling")
    axis.set_ylim(bottom=0)
    axis.grid(True, alpha=0.3)
    axis.legend()
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waits-ms", type=float, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument("--chunks", type=int, default=600, help="requests per wait and client")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="a few requests (the test suite's smoke run)")
    add_loop_option(parser)
    args = parser.parse_args(argv)
    name = "idle_hop"
    if args.quick:
        args.waits_ms, args.chunks, args.rounds, name = [0, 4], 20, 2, "idle_hop-quick"
    args.log = Path(args.out) / "logs" / f"{name}.log"
    return name, args


async def run(name: str, args: argparse.Namespace) -> None:
    result = await main_async(args)
    finish(name, result, args.out, plot)
    for side, per_wait in result["hop_p50_ms"].items():
        print(side, "  ".join(f"wait {wait} ms: {1000 * hop:.0f} us" for wait, hop in per_wait.items()))


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        bare_hop.run(app, int(sys.argv[2]))
        return
    name, args = parse_args()
    run_on_loop(run(name, args), args.loop)


if __name__ == "__main__":
    main()
