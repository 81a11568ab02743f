"""Capacity: far more open sessions than the device holds, served by parking.

Our server on the embedded tiny model with a device KV cache that holds at most
``--device-sessions`` of the sessions below at their final size. Two phases:

1. **Many sessions, in turn.** ``--sessions`` sessions are opened; each answers a
   chunk in turn, then each answers a second one. Idle sessions park (least
   recently used first) when a chunk would not fit; their next chunk resumes them
   from the CPU tier. Every chunk must answer 200.
2. **A full device** (what hung before parking): sessions of 1,800 tokens until
   their sum is several times the device, then a 500-token ``/v1/completions``.
   Every request must answer, none may wait unboundedly.

Writes errors, parks and resumes by cause (from ``/metrics``), what the CPU tier
held, and chunk latencies by phase.

    python -m benchmarks.capacity            # 1,000 sessions
    python -m benchmarks.capacity --quick    # 40 sessions (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import (
    API_HEADERS,
    EngineSetup,
    benchmark_parser,
    finish,
    our_server,
    percentile,
    pyplot,
    random_tokens,
)

KV_BYTES_PER_TOKEN = 2048  # the tiny model in bf16: 4 layers x 2 KV heads x 64 x 2 (K, V) x 2 bytes


def metric_samples(text: str, *prefixes: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefixes) and not sample.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


async def chunk(
    http: httpx.AsyncClient, session_id: str, tokens: list[int], max_tokens: int
) -> tuple[int, float, dict[str, Any]]:
    start = time.perf_counter()
    response = await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": tokens, "max_tokens": max_tokens})
    elapsed = time.perf_counter() - start
    body = response.json()
    return response.status_code, elapsed, body


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    final_tokens = 2 * (args.chunk + args.gen)
    blocks_per_session = -(-final_tokens // 32)
    dtype_bytes = 4 if args.dtype == "float32" else 2
    kv_gib = args.device_sessions * blocks_per_session * 32 * KV_BYTES_PER_TOKEN * dtype_bytes / 2 / (1 << 30)
    setup = EngineSetup(
        preset="tiny", kv_cache_gib=kv_gib, cpu_tier_gib=args.cpu_tier_gib, max_model_len=2048, dtype=args.dtype
    )
    errors: Counter[str] = Counter()
    latencies: dict[str, list[float]] = {"turn 1": [], "turn 2": [], "full device": []}
    log_dir = Path(args.out) / "logs"
    with our_server(setup, log_dir, name="capacity", session_park_after_s="600", admission_timeout_s="30") as server:
        async with httpx.AsyncClient(base_url=server.base_url, headers=API_HEADERS, timeout=300) as http:
            limit = asyncio.Semaphore(args.concurrency)

            async def one(session_id: str, phase: str, tokens: list[int], gen: int) -> None:
                async with limit:
                    status, elapsed, body = await chunk(http, session_id, tokens, gen)
                if status != 200:
                    errors[f"{phase}: {status} {body.get('error', {}).get('code')}"] += 1
                latencies[phase].append(elapsed)

            created = [
                (await http.post("/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}}))
                for _ in range(args.sessions)
            ]
            errors.update(f"create: {r.status_code}" for r in created if r.status_code != 201)
            ids = [r.json()["id"] for r in created if r.status_code == 201]
            started = time.perf_counter()
            for turn in ("turn 1", "turn 2"):
                await asyncio.gather(*(one(i, turn, random_tokens(rng, args.chunk), args.gen) for i in ids))
            phase1_s = time.perf_counter() - started
            states = Counter([(await http.get(f"/v1/sessions/{i}")).json()["status"] for i in ids])
            after_phase1 = metric_samples((await http.get("/metrics")).text, "streamsess_", "vllm:kv_offload")

            # Phase 2: sessions of 1,800 tokens, several devices' worth, then a completion.
            full_ids = []
            for _ in range(args.full_device_sessions):
                created_one = await http.post("/v1/sessions", json={"defaults": {"temperature": 0}})
                full_ids.append(created_one.json()["id"])
                await one(full_ids[-1], "full device", random_tokens(rng, 1800), 4)
            start = time.perf_counter()
            completion = await http.post(
                "/v1/completions",
                json={
                    "model": server.model,
                    "prompt": random_tokens(rng, 500),
                    "max_tokens": 8,
                    "temperature": 0,
                },
            )
            completion_s = time.perf_counter() - start
            if completion.status_code != 200:
                errors[f"completion: {completion.status_code}"] += 1
            metrics = metric_samples((await http.get("/metrics")).text, "streamsess_", "vllm:kv_offload")
            for session_id in ids + full_ids:
                await http.delete(f"/v1/sessions/{session_id}")
    return {
        "settings": {
            **setup.describe(),
            "sessions": args.sessions,
            "chunk_tokens": args.chunk,
            "gen_tokens": args.gen,
            "concurrency": args.concurrency,
            "device_holds_sessions": args.device_sessions,
            "full_device_sessions": args.full_device_sessions,
        },
        "errors": dict(errors),
        "chunks_answered": sum(len(v) for v in latencies.values()) - sum(errors.values()),
        "phase1_seconds": phase1_s,
        "session_states_after_phase1": dict(states),
        "completion_on_full_device_s": completion_s,
        "latency_s": {
            phase: {"p50": percentile(v, 50), "p99": percentile(v, 99), "n": len(v)} for phase, v in latencies.items()
        },
        "metrics_after_phase1": after_phase1,
        "metrics_at_end": metrics,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    phases = list(result["latency_s"])
    positions = range(len(phases))
    for offset, key in ((-0.2, "p50"), (0.2, "p99")):
        values = [result["latency_s"][p][key] * 1000 for p in phases]
        left.bar([x + offset for x in positions], values, width=0.4, label=key)
    left.set_xticks(list(positions), phases)
    left.legend()
    left.set_ylabel("chunk latency (ms)")
    left.set_title(
        f"{result['settings']['sessions']} sessions, device holds {result['settings']['device_holds_sessions']}"
    )
    metrics = result["metrics_at_end"]
    parks = {
        k.split("reason=")[1].rstrip("}"): v
        for k, v in metrics.items()
        if k.startswith("streamsess_session_parks_total")
    }
    resumes = {
        k.split("source=")[1].rstrip("}"): v
        for k, v in metrics.items()
        if k.startswith("streamsess_session_resumes_total")
    }
    right.bar(
        [f"park: {k}" for k in parks] + [f"resume: {k}" for k in resumes], list(parks.values()) + list(resumes.values())
    )
    right.set_title(f"errors: {sum(result['errors'].values())}")
    right.tick_params(axis="x", rotation=30)
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=0.0)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--device-sessions", type=int, default=50, help="sessions the device holds at their final size")
    parser.add_argument("--full-device-sessions", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--gen", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    name = "capacity"
    if args.quick:
        # The device must still hold one max_model_len request (2,048 tokens).
        args.sessions, args.device_sessions, args.full_device_sessions = 40, 16, 4
        name = "capacity-quick"
    return name, args


async def run(name: str, args: argparse.Namespace) -> None:
    result = await main_async(args)
    finish(name, result, args.out, plot)
    print({"errors": result["errors"], "states": result["session_states_after_phase1"]})


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
