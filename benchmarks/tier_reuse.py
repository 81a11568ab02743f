"""Benchmark 2: CPU-tier prefix reuse. How much cheaper is a prefix from the CPU tier?

For prefixes of 512, 1,024 and 2,048 tokens, time to first token (max_tokens=1) when:
- recompute: nothing cached (skip_reading_prefix_cache);
- device: the prefix is in the device prefix cache;
- cpu-tier: the device cache was reset and the prefix loads from our CPU tier.
One random prompt per size: recomputed once, then ``--repeats`` rounds of a device hit,
a reset and a tier hit; medians.

Each load path runs on an engine of its own, one after the other, in one run:
- synchronous (ours, the default): a tier hit is loaded and computed in the step that
  finds it, its pages copied on the host tier's copy thread while the forward pass runs,
  each layer waiting only for its own pages, if the load is 16 MiB or more
  (``tier_copy_thread_min_load_bytes``; smaller loads are copied inline);
- synchronous-thread-every-load: the same with every load on the copy thread;
- synchronous-inline (``tier_copy_thread=false``): the same step, with every page copied
  before the forward pass starts (the path before the copy thread);
- asynchronous (vLLM 0.32's protocol, ``async_tier_loads``, inline copies): the request
  waits a step for its load.

Also the tier's load bandwidth (vLLM's kv_offload_load_bytes / load_time, measured by our
host-tier worker around its page copies) against this machine's host memcpy bandwidth
(torch copy_ of 512 MiB), measured here with the same thread count as the model worker.

    python -m benchmarks.tier_reuse                   # bench model, every load path
    python -m benchmarks.tier_reuse --dtype float32   # where bf16 is slow (no AMX)
    python -m benchmarks.tier_reuse --quick           # tiny model, one size, synchronous only
    python -m benchmarks.tier_reuse --profile benchmarks/results/profiles   # and where the time goes

``--profile`` samples each load path's tier hits of the largest size with py-spy
(this process and the engine's) after its measurements, so the profiler does not touch
the figures above it; the result gets, per load path, the inclusive milliseconds per
tier hit of the worker's copies, its waits for them, the forward pass and the engine
core's step.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESERVED_CPUS,
    EngineSetup,
    benchmark_parser,
    finish,
    in_process_engine,
    py_spy_sampled,
    pyplot,
    quick_engine,
    random_tokens,
    release_engine,
    summarize_profile,
)

_ids = itertools.count()


def host_memcpy_gbps(threads: int, num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(num_bytes, dtype=torch.int8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in first
        best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    finally:
        torch.set_num_threads(previous)
    return num_bytes / best / 1e9


def _timed(work: Any) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def registry_total(name: str, model: str) -> float:
    from prometheus_client import REGISTRY

    return sum(
        sample.value
        for metric in REGISTRY.collect()
        for sample in metric.samples
        if sample.name == name and sample.labels.get("model_name") == model
    )


@dataclass(frozen=True)
class FirstToken:
    elapsed_s: float
    cached_tokens: int
    cpu_tier_tokens: int
    # Engine-core time from the request's arrival in the queue to its first step:
    # where vLLM 0.32's asynchronous load protocol spends its extra step.
    queued_to_scheduled_s: float | None


async def first_token(engine: Any, recorder: Any, prompt: list[int], recompute: bool = False) -> FirstToken:
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input

    request_id = f"tier-bench-{next(_ids)}"
    params = SamplingParams(max_tokens=1, temperature=0, skip_reading_prefix_cache=True if recompute else None)
    start = time.perf_counter()
    final = None
    async for output in engine.generate(prompt=tokens_input(prompt), sampling_params=params, request_id=request_id):
        final = output
    elapsed = time.perf_counter() - start
    sources = recorder.pop(request_id)
    assert final is not None
    stats = final.metrics
    wait = stats.scheduled_ts - stats.queued_ts if stats is not None and stats.scheduled_ts else None
    return FirstToken(elapsed, int(final.num_cached_tokens or 0), sources.cpu_tier_tokens if sources else 0, wait)


# Load path -> the settings that select it.
LOAD_PATHS: dict[str, dict[str, Any]] = {
    "synchronous": {},
    "synchronous-thread-every-load": {"tier_copy_thread_min_load_bytes": 0},
    "synchronous-inline": {"tier_copy_thread": False},
    "asynchronous": {"async_tier_loads": True, "tier_copy_thread": False},
}


async def measure_load_path(setup: EngineSetup, args: argparse.Namespace, load_path: str) -> list[dict[str, Any]]:
    engine, recorder, _ = in_process_engine(setup, "tier-bench", **LOAD_PATHS[load_path])
    # vLLM's metrics are labelled with the name the engine serves (a pooled engine's
    # is its first user's).
    served = engine.vllm_config.model_config.served_model_name
    rng = random.Random(args.seed)  # the same prompts on every path
    rows = []
    try:
        await first_token(engine, recorder, random_tokens(rng, 64))  # warm-up
        for length in args.sizes:
            samples: dict[str, list[float]] = {"recompute": [], "device": [], "cpu-tier": []}
            waits: dict[str, list[float]] = {"device": [], "cpu-tier": []}
            tier_tokens: list[int] = []
            load_gbps: list[float] = []
            load_bytes: list[float] = []
            prompt = random_tokens(rng, length + 1)
            # Recompute, the slow side, also fills both caches; its ratio needs no precision.
            for _ in range(args.recompute_repeats):
                samples["recompute"].append((await first_token(engine, recorder, prompt, recompute=True)).elapsed_s)
            for _ in range(args.repeats):
                # Each tier hit below brings the prompt back to the device cache.
                device = await first_token(engine, recorder, prompt)
                # A small request steps the engine once more so the deferred stores land.
                await first_token(engine, recorder, random_tokens(rng, 8))
                assert await engine.reset_prefix_cache(), "device cache reset refused"
                bytes_before = registry_total("vllm:kv_offload_load_bytes_total", served)
                time_before = registry_total("vllm:kv_offload_load_time_total", served)
                tier = await first_token(engine, recorder, prompt)
                await asyncio.sleep(0.2)  # let the step's stats reach the registry
                loaded = registry_total("vllm:kv_offload_load_bytes_total", served) - bytes_before
                load_time = registry_total("vllm:kv_offload_load_time_total", served) - time_before
                samples["device"].append(device.elapsed_s)
                samples["cpu-tier"].append(tier.elapsed_s)
                for side, sample in (("device", device), ("cpu-tier", tier)):
                    if sample.queued_to_scheduled_s is not None:
                        waits[side].append(sample.queued_to_scheduled_s)
                tier_tokens.append(tier.cpu_tier_tokens)
                if loaded > 0 and load_time > 0:
                    load_gbps.append(loaded / load_time / 1e9)
                    load_bytes.append(loaded)
            medians = {side: statistics.median(values) for side, values in samples.items()}
            rows.append(
                {
                    "prefix_tokens": length,
                    "ttft_s": medians,
                    "queued_to_scheduled_ms": {
                        side: 1000 * statistics.median(values) if values else None for side, values in waits.items()
                    },
                    "cpu_tier_tokens": statistics.median(tier_tokens),
                    "tier_load_bytes": statistics.median(load_bytes) if load_bytes else None,
                    "tier_load_gbps": statistics.median(load_gbps) if load_gbps else None,
                    "recompute_vs_tier": medians["recompute"] / medians["cpu-tier"],
                    "tier_vs_device": medians["cpu-tier"] / medians["device"],
                }
            )
        if args.profile:
            rows[-1]["profile"] = await profile_tier_hits(engine, recorder, prompt, args, load_path)
    finally:
        release_engine(engine)
    return rows


# Where a tier hit's time goes, by frame (inclusive): the worker's copies (inline or on
# the copy thread) and its waits for them, the forward pass, the engine core's steps and
# scheduling, and the worker's shared-memory wait for its next step (vLLM's spin).
PROFILED_FUNCTIONS = (
    "HostTierWorker._copy",
    "HostTierWorker.wait_for_tensor",
    "_CopyThread._run",
    "execute_model",
    "EngineCore.step",
    "Scheduler.schedule",
    "SpinCondition.wait",
)
PROFILE_RATE_HZ = 250  # lower rates disturb the engine less (3 processes on 2 CPUs)


async def profile_tier_hits(
    engine: Any, recorder: Any, prompt: list[int], args: argparse.Namespace, load_path: str
) -> dict[str, Any]:
    """py-spy over this process and the engine's (``--subprocesses``) during
    ``--profile-hits`` tier hits of the largest prompt, each after a device-cache reset."""
    out = Path(args.profile) / f"tier-hit-{args.dtype}-{load_path}.txt"
    elapsed = []
    with py_spy_sampled(os.getpid(), out, PROFILE_RATE_HZ, subprocesses=True) as profile:
        for _ in range(args.profile_hits):
            assert await engine.reset_prefix_cache(), "device cache reset refused"
            elapsed.append((await first_token(engine, recorder, prompt)).elapsed_s)
    return {
        "prefix_tokens": len(prompt) - 1,
        "tier_hits": args.profile_hits,
        "ttft_ms_under_profiler": 1000 * statistics.median(elapsed),
        **summarize_profile(profile, per=args.profile_hits, functions=PROFILED_FUNCTIONS),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib, dtype=args.dtype
    )
    by_load_path = {path: await measure_load_path(setup, args, path) for path in args.load_paths}
    threads = max(1, (os.cpu_count() or 1) - int(RESERVED_CPUS))
    memcpy = host_memcpy_gbps(threads)
    for rows in by_load_path.values():
        for row in rows:
            if not row["tier_load_gbps"]:
                continue
            row["tier_load_vs_memcpy"] = row["tier_load_gbps"] / memcpy
            # The same bytes in one copy: a load this small may run from the caches.
            same_size = host_memcpy_gbps(threads, num_bytes=int(row["tier_load_bytes"]))
            row["memcpy_same_bytes_gbps"] = same_size
            row["tier_load_vs_memcpy_same_bytes"] = row["tier_load_gbps"] / same_size
    return {
        "settings": {
            **setup.describe(),
            "repeats": args.repeats,
            "seed": args.seed,
            "worker_threads": threads,
            "load_paths": list(args.load_paths),
        },
        "host_memcpy_gbps": memcpy,
        "rows": by_load_path[args.load_paths[0]],
        "by_load_path": by_load_path,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()

    rows = result["rows"]
    bars = [("recompute", rows, "recompute"), ("device", rows, "device")]
    bars += [(f"cpu-tier, {path} load", path_rows, "cpu-tier") for path, path_rows in result["by_load_path"].items()]
    figure, axis = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(bars)
    for offset, (label, bar_rows, side) in enumerate(bars):
        axis.bar(
            [i + (offset - (len(bars) - 1) / 2) * width for i in range(len(rows))],
            [row["ttft_s"][side] * 1000 for row in bar_rows],
            width,
            label=label,
        )
    axis.set_xticks(range(len(rows)), [f"{row['prefix_tokens']} tokens" for row in rows])
    axis.set_yscale("log")
    axis.set_ylabel("time to first token (ms)")
    axis.set_title(
        f"Prefix reuse ({result['settings']['model_preset']} model, {result['settings']['dtype']}): recompute vs CPU tier vs device cache"
    )
    axis.grid(True, axis="y", which="both", alpha=0.3)
    axis.legend()
    return figure


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    parser = benchmark_parser(__doc__, kv_cache_gib=1.0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--recompute-repeats", type=int, default=1, help="recomputes per size")
    parser.add_argument(
        "--load-paths",
        nargs="+",
        choices=LOAD_PATHS,
        default=list(LOAD_PATHS),
        help="tier load paths to measure, each on its own engine (the first one is 'rows')",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="also sample each load path's tier hits with py-spy (stacks into DIR)"
    )
    parser.add_argument("--profile-hits", type=int, default=60, help="tier hits sampled per load path")
    args = parser.parse_args(argv)
    # bf16 is the embedded models' own dtype; other dtypes are recorded beside it.
    name = "tier_reuse" if args.dtype == "bfloat16" else f"tier_reuse-{args.dtype}"
    if args.quick:
        args.sizes, args.repeats, args.load_paths = [256], 1, ["synchronous"]
        quick_engine(args)
        name = "tier_reuse-quick"
    return name, args


async def run(name: str, args: argparse.Namespace) -> None:
    result = await main_async(args)
    finish(name, result, args.out, plot)
    print(f"host memcpy: {result['host_memcpy_gbps']:.1f} GB/s")
    for path, rows in result["by_load_path"].items():
        for row in rows:
            print(path, row)


def main() -> None:
    asyncio.run(run(*parse_args()))


if __name__ == "__main__":
    main()
