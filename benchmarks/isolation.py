"""Cross-key cache probing, timed: does key B's request on key A's prompt run as a
cache hit (a leak) or as a cold prefill?

Our server with two API keys, per-key isolation on (the default) and then off
(``cache_isolation=shared``, the negative control). Key A runs a session on a
PROMPT-token prompt; then, timed to the first token of a 1-token completion on the
same prompt: B (the probe), A itself (a warm hit), and B on a fresh prompt of the
same length (a cold prefill). With isolation the probe must time like the cold
prefill; shared, like the warm hit.

    python -m benchmarks.isolation            # bench model
    python -m benchmarks.isolation --quick    # tiny model
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    EngineSetup,
    benchmark_parser,
    finish,
    our_server,
    pyplot,
    quick_engine,
    random_tokens,
)

KEYS = ("bench-key-a", "bench-key-b")


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def timed_completion(http: httpx.Client, model: str, tokens: list[int], key: str) -> tuple[float, int]:
    start = time.perf_counter()
    reply = http.post(
        "/v1/completions",
        headers=headers(key),
        json={"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0},
    )
    reply.raise_for_status()
    return time.perf_counter() - start, int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def probe(base_url: str, model: str, rng: random.Random, prompt: int, repeats: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"cross_key_probe": [], "same_key_hit": [], "cold_prefill": []}
    cached: dict[str, list[int]] = {side: [] for side in samples}
    with httpx.Client(base_url=base_url, timeout=600) as http:
        for _ in range(repeats):
            secret = random_tokens(rng, prompt)
            session = http.post("/v1/sessions", headers=headers(KEYS[0]), json={"defaults": {"temperature": 0}})
            session_id = session.json()["id"]
            http.post(
                f"/v1/sessions/{session_id}/chunks", headers=headers(KEYS[0]), json={"input": secret, "max_tokens": 1}
            ).raise_for_status()
            http.delete(f"/v1/sessions/{session_id}", headers=headers(KEYS[0]))
            for side, tokens, key in (
                ("cross_key_probe", secret, KEYS[1]),
                ("same_key_hit", secret, KEYS[0]),
                ("cold_prefill", random_tokens(rng, prompt), KEYS[1]),
            ):
                elapsed, hit = timed_completion(http, model, tokens, key)
                samples[side].append(elapsed)
                cached[side].append(hit)
    medians = {side: statistics.median(values) for side, values in samples.items()}
    return {
        "ttft_s": medians,
        "cached_tokens": {side: statistics.median(v) for side, v in cached.items()},
        "probe_vs_cold": medians["cross_key_probe"] / medians["cold_prefill"],
        "probe_vs_hit": medians["cross_key_probe"] / medians["same_key_hit"],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset,
        kv_cache_gib=args.kv_cache_gib,
        cpu_tier_gib=args.cpu_tier_gib,
        dtype=args.dtype,
        max_model_len=args.prompt + 256,
    )
    log_dir = Path(args.out) / "logs"
    rng = random.Random(args.seed)
    results = {}
    for isolation in ("per_key", "shared"):
        with our_server(setup, log_dir, api_keys=",".join(KEYS), cache_isolation=isolation) as server:
            results[isolation] = probe(server.base_url, server.model, rng, args.prompt, args.repeats)
    return {"settings": {**setup.describe(), "prompt_tokens": args.prompt, "repeats": args.repeats}, "results": results}


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(8, 4))
    modes = list(result["results"])
    sides = ("cross_key_probe", "same_key_hit", "cold_prefill")
    for offset, side in zip((-0.27, 0, 0.27), sides):
        axis.bar(
            [i + offset for i in range(len(modes))],
            [result["results"][m]["ttft_s"][side] * 1000 for m in modes],
            width=0.27,
            label=side,
        )
    axis.set_xticks(range(len(modes)), [f"cache_isolation={m}" for m in modes])
    axis.set_ylabel("time to first token (ms)")
    axis.legend()
    figure.suptitle(f"cross-key probe on a {result['settings']['prompt_tokens']}-token prompt")
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, kv_cache_gib=1.0)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    name = "isolation"
    if args.quick:
        quick_engine(args)
        args.prompt, args.repeats = 256, 1
        name = "isolation-quick"
    result = measure(args)
    finish(name, result, args.out, plot)
    for mode, row in result["results"].items():
        print(
            mode,
            {k: round(v, 3) for k, v in row["ttft_s"].items()},
            "probe/cold",
            round(row["probe_vs_cold"], 2),
            "cached",
            row["cached_tokens"],
        )


if __name__ == "__main__":
    main()
