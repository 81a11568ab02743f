"""The session store's cost, and resuming after a restart.

1. Per-chunk overhead: one session, N chunks of 1 token with max_tokens=1 over REST,
   on our server with no store (``store_url=none``), with SQLite (the default:
   WAL, synchronous=FULL, on this machine's disk) and with PostgreSQL (Debian's
   server on loopback, fsync on). Every chunk takes a lease and commits its tokens:
   two transactions. Reports p50/p99 chunk time per store and the p50 over no store.
2. Resume after a restart against resume from the CPU tier: sessions of CONTEXT
   tokens, then a chunk of 16 tokens, timed to its first token, (a) never parked
   (device), (b) parked with the device cache reset (CPU tier), (c) after the
   server was killed (SIGKILL) and started again on the same SQLite store (the CPU
   tier is host memory, so the transcript is recomputed). A disk tier that would
   make (c) a disk hit is not built: see docs/benchmarks.md.

    python -m benchmarks.store            # bench model
    python -m benchmarks.store --quick    # tiny model (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    API_KEY,
    EngineSetup,
    RunningServer,
    benchmark_parser,
    finish,
    our_server,
    percentile,
    pyplot,
    quick_engine,
    random_tokens,
)
from benchmarks.postgres import postgres_bin_dir, postgres_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
NEXT_CHUNK = 16


def open_session(http: httpx.Client) -> str:
    created = http.post("/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}})
    created.raise_for_status()
    return str(created.json()["id"])


def chunk(http: httpx.Client, session_id: str, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    response = http.post(f"/v1/sessions/{session_id}/chunks", json={"input": tokens, "max_tokens": max_tokens})
    response.raise_for_status()
    return dict(response.json())


def timed_first_token(http: httpx.Client, session_id: str, tokens: list[int]) -> float:
    """Seconds to the first token of a 1-token answer (so, to the answer)."""
    start = time.perf_counter()
    chunk(http, session_id, tokens, max_tokens=1)
    return time.perf_counter() - start


def per_chunk_times(server: RunningServer, chunks: int) -> dict[str, float]:
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=300) as http:
        session_id = open_session(http)
        for _ in range(5):  # warm up
            chunk(http, session_id, [7], max_tokens=1)
        times = []
        for index in range(chunks):
            start = time.perf_counter()
            chunk(http, session_id, [(index % 500) + 1], max_tokens=1)
            times.append(time.perf_counter() - start)
    return {"p50_s": percentile(times, 50), "p99_s": percentile(times, 99), "chunks": chunks}


def build_sessions(http: httpx.Client, rng: random.Random, count: int, context: int) -> list[str]:
    sessions = []
    for _ in range(count):
        session_id = open_session(http)
        chunk(http, session_id, random_tokens(rng, context - 1), max_tokens=1)
        sessions.append(session_id)
    return sessions


@contextlib.contextmanager
def restartable(setup: EngineSetup, log_dir: Path, state_dir: str) -> Iterator[RunningServer]:
    with our_server(setup, log_dir, state_dir=state_dir, session_park_after_s="3600") as server:
        yield server


def resume_times(setup: EngineSetup, log_dir: Path, context: int, repeats: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    state_dir = tempfile.mkdtemp(prefix="streamsess-bench-store-")
    results: dict[str, list[float]] = {"device": [], "cpu_tier": [], "restart_recompute": []}
    sources: dict[str, list[dict[str, int]]] = {key: [] for key in results}
    with restartable(setup, log_dir, state_dir) as server, \
            httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=600) as http:
        for side in ("device", "cpu_tier"):
            for session_id in build_sessions(http, rng, repeats, context):
                if side == "cpu_tier":
                    http.post(f"/v1/sessions/{session_id}/park").raise_for_status()
                    http.post("/v1/admin/reset_device_cache").raise_for_status()
                start = time.perf_counter()
                reply = chunk(http, session_id, random_tokens(rng, NEXT_CHUNK), max_tokens=1)
                results[side].append(time.perf_counter() - start)
                sources[side].append(reply["usage"]["prompt_tokens_details"])
        survivors = build_sessions(http, rng, repeats, context)
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
    with restartable(setup, log_dir, state_dir) as server, \
            httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=600) as http:
        chunk(http, open_session(http), [1, 2, 3], max_tokens=1)  # the first request warms the engine
        for session_id in survivors:
            start = time.perf_counter()
            reply = chunk(http, session_id, random_tokens(rng, NEXT_CHUNK), max_tokens=1)
            results["restart_recompute"].append(time.perf_counter() - start)
            sources["restart_recompute"].append(reply["usage"]["prompt_tokens_details"])
    summary: dict[str, Any] = {f"{side}_p50_s": percentile(times, 50) for side, times in results.items()}
    summary["sources"] = {side: rows[-1] for side, rows in sources.items()}
    return summary


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    setup = EngineSetup(preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib,
                        dtype=args.dtype, max_model_len=max(args.contexts) + 256)
    log_dir = Path(args.out) / "logs"
    overhead: dict[str, dict[str, float]] = {}
    with our_server(setup, log_dir, store_url="none") as server:
        overhead["none"] = per_chunk_times(server, args.chunks)
    with our_server(setup, log_dir, state_dir=tempfile.mkdtemp(prefix="streamsess-bench-sqlite-")) as server:
        overhead["sqlite"] = per_chunk_times(server, args.chunks)
    if postgres_bin_dir() is not None:
        with postgres_server(fsync=True) as database, our_server(setup, log_dir, store_url=database.url) as server:
            overhead["postgresql"] = per_chunk_times(server, args.chunks)
    base = overhead["none"]["p50_s"]
    for row in overhead.values():
        row["p50_over_none_ms"] = (row["p50_s"] - base) * 1000
        row["p50_ratio_vs_none"] = row["p50_s"] / base
    resume = {str(context): resume_times(setup, log_dir, context, args.repeats, args.seed + context)
              for context in args.contexts}
    for row in resume.values():
        row["restart_over_tier"] = row["restart_recompute_p50_s"] / row["cpu_tier_p50_s"]
        row["tier_over_device"] = row["cpu_tier_p50_s"] / row["device_p50_s"]
    return {"settings": {**setup.describe(), "chunks": args.chunks, "repeats": args.repeats,
                         "next_chunk": NEXT_CHUNK, "sqlite": "WAL, synchronous=FULL",
                         "postgresql": "Debian's server on loopback, fsync on" if "postgresql" in overhead else "absent"},
            "per_chunk": overhead, "resume": resume}


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    stores = list(result["per_chunk"])
    left.bar(stores, [result["per_chunk"][s]["p50_s"] * 1000 for s in stores])
    left.set_ylabel("1-token chunk, p50 (ms)")
    left.set_title("per-chunk cost of the store")
    contexts = list(result["resume"])
    sides = ("device", "cpu_tier", "restart_recompute")
    for offset, side in zip((-0.27, 0, 0.27), sides):
        right.bar([i + offset for i in range(len(contexts))],
                  [result["resume"][c][f"{side}_p50_s"] * 1000 for c in contexts], width=0.27, label=side)
    right.set_xticks(range(len(contexts)), [f"{c} tokens" for c in contexts])
    right.set_ylabel("resume, time to first token p50 (ms)")
    right.set_yscale("log")
    right.legend()
    figure.suptitle(f"session store ({result['settings']['model_preset']} model)")
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, kv_cache_gib=1.0)
    parser.add_argument("--chunks", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    args = parser.parse_args()
    name = "store"
    if args.quick:
        quick_engine(args)
        args.chunks, args.repeats, args.contexts = 10, 1, [128]
        name = "store-quick"
    result = measure_all(args)
    finish(name, result, args.out, plot)
    for store, row in result["per_chunk"].items():
        print(store, f"p50 {row['p50_s'] * 1000:.1f} ms (+{row['p50_over_none_ms']:.1f} ms)")
    for context, row in result["resume"].items():
        print(context, {k: round(v, 3) for k, v in row.items() if isinstance(v, float)})


if __name__ == "__main__":
    main()
