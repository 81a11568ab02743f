"""Benchmark: a Responses API chain (``previous_response_id``), ours against vLLM's own.

TURNS turns, each about CHUNK new tokens of text (random words) and GEN generated, every turn
continuing the previous response, streamed; time to first token and total per turn:

- ours: /v1/responses on our server: a chain is a session, a turn one chunk;
- vllm-store-prefix-on / -off: vLLM's own server with its response store on
  (VLLM_ENABLE_RESPONSES_API_STORE=1), which re-renders and re-sends the whole history
  each turn, with prefix caching on and off.

    python -m benchmarks.responses_chain          # bench model, 16 turns of 128 tokens
    python -m benchmarks.responses_chain --turns 4 --chunk 32 --preset tiny

Writes benchmarks/results/responses_chain.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    API_HEADERS,
    SWITCH_SETTLE_S,
    EngineSetup,
    PerTurn,
    benchmark_parser,
    enter_together,
    finish,
    median_per_turn,
    our_server,
    plot_ttft_per_turn,
    vllm_server,
    word_text,
)

Turns = PerTurn


async def run_chain(base_url: str, model: str, texts: list[str], gen: int, headers: dict[str, str]) -> Turns:
    turns: Turns = []
    previous: str | None = None
    async with httpx.AsyncClient(base_url=base_url, timeout=600, headers=headers) as http:
        for text in texts:
            body = {
                "model": model,
                "input": text,
                "max_output_tokens": gen,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "previous_response_id": previous,
            }
            start = time.perf_counter()
            first: float | None = None
            final: dict[str, Any] = {}
            async with http.stream("POST", "/v1/responses", json=body) as stream:
                assert stream.status_code == 200, await stream.aread()
                async for line in stream.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if event["type"] == "response.output_text.delta" and first is None:
                        first = time.perf_counter() - start
                    if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                        final = event["response"]
            total = time.perf_counter() - start
            assert final.get("status") in ("completed", "incomplete"), final
            usage = final["usage"]
            turns.append(
                {
                    "ttft_s": first if first is not None else total,
                    "total_s": total,
                    "input_tokens": usage["input_tokens"],
                    "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
                }
            )
            previous = final["id"]
    return turns


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib, dtype=args.dtype
    )
    rng = random.Random(args.seed)

    def text() -> str:
        return word_text(rng, args.chunk)

    warmup = [text() for _ in range(2)]
    chains = [[text() for _ in range(args.turns)] for _ in range(args.repeats)]
    log_dir = Path(args.out) / "logs"
    sides: dict[str, Turns] = {}
    # ours-no-store: the same server keeping its sessions in memory only, to tell the
    # store's cost per turn (the lease, the chunk's commit, the stored response). The two
    # run side by side, their chains alternating, so that the machine's drift falls on
    # both alike, with a pause at each switch so that neither runs beside the other's
    # engine still spinning after its last step (vLLM's busy_loop_s).
    with contextlib.ExitStack() as stack:
        ours = dict(
            zip(
                ("ours", "ours-no-store"),
                enter_together(
                    stack,
                    [our_server(setup, log_dir), our_server(setup, log_dir, name="ours-no-store", store_url="none")],
                ),
            )
        )
        runs: dict[str, list[Turns]] = {label: [] for label in ours}
        for server in ours.values():
            await run_chain(server.base_url, server.model, warmup, args.gen, API_HEADERS)
        for chain in chains:
            for label, server in ours.items():
                await asyncio.sleep(SWITCH_SETTLE_S)
                runs[label].append(await run_chain(server.base_url, server.model, chain, args.gen, API_HEADERS))
        sides.update({label: median_per_turn(label_runs) for label, label_runs in runs.items()})
    for prefix_caching in (True, False):
        label = f"vllm-store-prefix-{'on' if prefix_caching else 'off'}"
        with vllm_server(
            setup, log_dir, prefix_caching, label=label, env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
        ) as server:
            await run_chain(server.base_url, server.model, warmup, args.gen, {})
            sides[label] = median_per_turn(
                [await run_chain(server.base_url, server.model, chain, args.gen, {}) for chain in chains]
            )
    last = args.turns - 1
    ours = sides["ours"][last]["ttft_s"]
    return {
        "settings": {
            **setup.describe(),
            "turns": args.turns,
            "chunk_tokens": args.chunk,
            "gen_tokens": args.gen,
            "repeats": args.repeats,
            "seed": args.seed,
        },
        "summary": {
            "last_turn_ttft_s": {side: turns[last]["ttft_s"] for side, turns in sides.items()},
            "last_turn_ours_vs_vllm_store_prefix_on": ours / sides["vllm-store-prefix-on"][last]["ttft_s"],
            "last_turn_vllm_store_prefix_off_vs_ours": sides["vllm-store-prefix-off"][last]["ttft_s"] / ours,
            "last_turn_input_tokens": sides["ours"][last]["input_tokens"],
            # the store's share of a turn, over all turns (total time, ours against ours-no-store)
            "store_cost_share_of_turn": 1
            - sum(t["total_s"] for t in sides["ours-no-store"]) / sum(t["total_s"] for t in sides["ours"]),
        },
        "per_turn": sides,
    }


def plot(result: dict[str, Any]) -> Any:
    settings = result["settings"]
    return plot_ttft_per_turn(
        result["per_turn"],
        f"Responses chain: about {settings['chunk_tokens']} new tokens "
        f"+ {settings['gen_tokens']} generated per turn ({settings['model_preset']} model)",
    )


def main() -> None:
    parser = benchmark_parser(__doc__, kv_cache_gib=1.0)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    finish("responses_chain", result, args.out, plot)


if __name__ == "__main__":
    main()
