"""A steady-rate soak of our server: errors, chunk latency and memory over time.

Workers run sessions back to back, each for --chunks-per-session chunks at a fixed
pace (--rate chunks per second in all), then close it and open the next: most over
the websocket, one over REST (SSE-less JSON), so session churn, parking and both
transports run the whole time. Every chunk is fresh random input. Per window
(--window-s): chunks, errors, p50/p99 latency (append to the chunk's end), and the
RSS of the server's process tree (API server, engine core, worker) and of the API
server process alone (where a session leak would show).

The figures that matter: 0 errors, RSS growth from the end of warm-up (the first
window) to the end within the bound (--rss-bound-pct), latency flat over time, and
afterwards no session left open.

    python -m benchmarks.soak                 # 10 minutes, tiny model, float32
    python -m benchmarks.soak --quick         # 8 s (the test suite's smoke run)
    python -m benchmarks.soak --duration-s 900 --chunks-per-session=4 --name soak-churn --out docs/results
                                              # past the 1,024 closed sessions remembered
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import websockets

from benchmarks.common import (
    API_HEADERS,
    EngineSetup,
    benchmark_parser,
    finish,
    our_server,
    percentile,
    pyplot,
    quick_engine,
    random_tokens,
)


@dataclass
class Record:
    """What the workers saw: (time since start, latency) per chunk, and errors."""

    start: float = field(default_factory=time.monotonic)
    chunks: list[tuple[float, float]] = field(default_factory=list)
    errors: list[tuple[float, str]] = field(default_factory=list)
    sessions: int = 0  # sessions opened (and closed) by the workers

    def now(self) -> float:
        return time.monotonic() - self.start

    def error(self, what: str | BaseException) -> None:
        text = f"{type(what).__name__}: {what}" if isinstance(what, BaseException) else what
        self.errors.append((self.now(), text[:300]))


async def paced(record: Record, interval_s: float, deadline: float, step: Any) -> None:
    """Run ``step`` every ``interval_s`` until ``deadline`` (late steps do not bunch up)."""
    next_at = time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        began = time.monotonic()
        try:
            await step()
        except Exception as exc:  # every failure is a recorded error; the soak goes on
            record.error(exc)
        else:
            record.chunks.append((record.now(), time.monotonic() - began))
        next_at = max(next_at + interval_s, time.monotonic())


async def websocket_worker(url: str, args: Any, record: Record, seed: int, interval_s: float, deadline: float) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        async with websockets.connect(f"{url}/v1/sessions/ws", additional_headers=API_HEADERS, max_size=2**22) as ws:
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created", created
            record.sessions += 1
            sent = 0

            async def step() -> None:
                nonlocal sent
                sent += 1
                chunk = random_tokens(rng, args.chunk)
                await ws.send(
                    json.dumps({"type": "input.append", "input": chunk, "max_tokens": args.gen, "ignore_eos": True})
                )
                while (event := json.loads(await ws.recv()))["type"] != "response.done":
                    if event["type"] == "error":
                        raise RuntimeError(event["error"]["code"])

            session_deadline = min(deadline, time.monotonic() + args.chunks_per_session * interval_s)
            await paced(record, interval_s, session_deadline, step)
            await ws.send(json.dumps({"type": "session.close"}))
            # The close is answered before the connection ends: a close that failed is an error.
            try:
                while (event := json.loads(await ws.recv()))["type"] != "session.closed":
                    if event["type"] == "error":
                        raise RuntimeError(f"session.close: {event['error']['code']}: {event['error']['message']}")
            except Exception as exc:
                record.error(exc)


async def rest_worker(base: str, args: Any, record: Record, seed: int, interval_s: float, deadline: float) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, headers=API_HEADERS, timeout=120) as http:
        while time.monotonic() < deadline:
            session_id = (await http.post("/v1/sessions", json={})).json()["id"]
            record.sessions += 1

            async def step(session_id: str = session_id) -> None:
                body = {"input": random_tokens(rng, args.chunk), "max_tokens": args.gen, "ignore_eos": True}
                response = await http.post(f"/v1/sessions/{session_id}/chunks", json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"{response.status_code} {response.text[:200]}")

            session_deadline = min(deadline, time.monotonic() + args.chunks_per_session * interval_s)
            await paced(record, interval_s, session_deadline, step)
            deleted = await http.delete(f"/v1/sessions/{session_id}")
            if deleted.status_code != 200:
                record.error(f"DELETE {deleted.status_code} {deleted.text[:200]}")


def rss_mb(pid: int) -> tuple[float, float]:
    """(the whole server tree's RSS, the API server process's own) in MiB."""
    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / 2**20, root.memory_info().rss / 2**20


async def sample_rss(
    pid: int, record: Record, deadline: float, every_s: float, samples: list[tuple[float, float, float]]
) -> None:
    while time.monotonic() < deadline:
        samples.append((record.now(), *rss_mb(pid)))
        await asyncio.sleep(every_s)


def windows(
    record: Record, rss: list[tuple[float, float, float]], window_s: float, duration_s: float
) -> list[dict[str, Any]]:
    rows = []
    start = 0.0
    while start < duration_s - 1e-6:
        end = min(start + window_s, duration_s)
        latencies = [latency for t, latency in record.chunks if start <= t < end]
        in_window = [(tree, api) for t, tree, api in rss if start <= t < end]
        rows.append(
            {
                "t_end_s": round(end, 1),
                "chunks": len(latencies),
                "errors": sum(1 for t, _ in record.errors if start <= t < end),
                "p50_s": percentile(latencies, 50),
                "p99_s": percentile(latencies, 99),
                "rss_mb": max(tree for tree, _ in in_window) if in_window else float("nan"),
                "api_server_rss_mb": max(api for _, api in in_window) if in_window else float("nan"),
            }
        )
        start = end
    return rows


async def main_async(args: Any) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset,
        kv_cache_gib=args.kv_cache_gib,
        cpu_tier_gib=args.cpu_tier_gib,
        dtype=args.dtype,
        max_num_seqs=16,
    )
    log_dir = Path(args.out) / "logs"
    # As users run it: the default SQLite store, so its writes are soaked too.
    with our_server(setup, log_dir, name="soak", admission_timeout_s="120") as server:
        base = server.base_url
        ws_base = base.replace("http://", "ws://")
        record = Record()
        deadline = time.monotonic() + args.duration_s
        interval_s = (args.websocket_workers + 1) / args.rate
        rss: list[tuple[float, float, float]] = []
        await asyncio.gather(
            sample_rss(server.process.pid, record, deadline, 2.0, rss),
            rest_worker(base, args, record, args.seed, interval_s, deadline),
            *(
                websocket_worker(ws_base, args, record, args.seed + 1 + n, interval_s, deadline)
                for n in range(args.websocket_workers)
            ),
        )
        async with httpx.AsyncClient(base_url=base, headers=API_HEADERS, timeout=30) as http:
            left_open = [
                {k: s[k] for k in ("id", "status", "num_chunks")}
                for s in (await http.get("/v1/sessions")).json()["data"]
                if s["status"] != "closed"
            ]
    rows = windows(record, rss, args.window_s, args.duration_s)
    warm, end = rows[0]["rss_mb"], rows[-1]["rss_mb"]
    growth_pct = 100 * (end - warm) / warm
    latencies = [latency for _, latency in record.chunks]
    return {
        "setup": setup.describe(),
        "load": {
            "duration_s": args.duration_s,
            "rate_chunks_per_s": args.rate,
            "websocket_workers": args.websocket_workers,
            "rest_workers": 1,
            "chunk_tokens": args.chunk,
            "gen_tokens": args.gen,
            "chunks_per_session": args.chunks_per_session,
        },
        "windows": rows,
        "errors_sample": record.errors[:20],
        "sessions_left_open": left_open,
        "summary": {
            "chunks": len(record.chunks),
            "errors": len(record.errors),
            "achieved_rate": len(record.chunks) / args.duration_s,
            "p50_s": percentile(latencies, 50),
            "p99_s": percentile(latencies, 99),
            "rss_after_warmup_mb": warm,
            "rss_end_mb": end,
            "rss_growth_pct": growth_pct,
            "api_server_rss_after_warmup_mb": rows[0]["api_server_rss_mb"],
            "api_server_rss_end_mb": rows[-1]["api_server_rss_mb"],
            "rss_bound_pct": args.rss_bound_pct,
            "rss_within_bound": growth_pct <= args.rss_bound_pct,
            "sessions_opened": record.sessions,
            "sessions_left_open": len(left_open),
        },
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, (latency, memory) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    rows = result["windows"]
    t = [row["t_end_s"] for row in rows]
    latency.plot(t, [row["p50_s"] * 1000 for row in rows], marker="o", label="p50")
    latency.plot(t, [row["p99_s"] * 1000 for row in rows], marker="o", label="p99")
    latency.set_ylabel("chunk latency (ms)")
    latency.set_title(f"soak: {result['summary']['chunks']} chunks, {result['summary']['errors']} errors")
    latency.grid(True, alpha=0.3)
    latency.legend()
    memory.plot(t, [row["rss_mb"] for row in rows], marker="o", color="tab:green", label="server tree")
    memory.plot(
        t, [row["api_server_rss_mb"] for row in rows], marker="o", color="tab:purple", label="API server process"
    )
    memory.set_ylabel("RSS (MiB)")
    memory.legend()
    memory.set_xlabel("time (s)")
    memory.grid(True, alpha=0.3)
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=0.25)
    parser.set_defaults(preset="tiny", dtype="float32", cpu_tier_gib=0.5)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=10.0, help="chunks per second, all workers together")
    parser.add_argument("--websocket-workers", type=int, default=7)
    parser.add_argument("--chunks-per-session", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--gen", type=int, default=8)
    parser.add_argument("--rss-bound-pct", type=float, default=5.0)
    parser.add_argument("--name", default="soak", help="the result files' name")
    args = parser.parse_args(argv)
    name = args.name
    if args.quick:
        quick_engine(args)
        args.duration_s, args.window_s, args.websocket_workers = 8.0, 2.0, 3
        name = "soak-quick"
    return name, args


async def run(name: str, args: argparse.Namespace) -> None:
    result = await main_async(args)
    finish(name, result, args.out, plot)


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
