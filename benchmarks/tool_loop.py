"""Benchmark: an agent's tool loop, ours against vLLM's own server.

ROUNDS rounds; in each the model calls a tool (``tool_choice`` required, Hermes format,
arguments pinned to the tool's schema) and the tool answers with about OUTPUT tokens of
text, which the next round sends back. Streamed; per round, the time to the call's first
streamed delta (its name) and the round's total:

- ours: /v1/responses chained by ``previous_response_id``: the loop is one session, a
  round appends the tool's output and the turn's framing only;
- vllm-prefix-on: vLLM's own /v1/chat/completions (the same parser, template and
  strictness), the client resending the whole history each round, prefix caching on.

    python -m benchmarks.tool_loop             # the default model, 10 rounds, 256-token outputs
    python -m benchmarks.tool_loop --quick     # the suite's smoke run

Writes benchmarks/results/tool_loop.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx

from app.models.smollm2 import CHAT_TEMPLATE
from benchmarks.common import (
    API_HEADERS,
    WORDS,
    EngineSetup,
    PerTurn,
    benchmark_parser,
    finish,
    median_per_turn,
    our_server,
    plot_ttft_per_turn,
    quick_engine,
    vllm_server,
)

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
FUNCTION = {"name": "lookup", "description": "Look a city up.", "parameters": CITY}
QUESTION = "Look up Paris, then each city the results mention."
Rounds = PerTurn


async def ours(http: httpx.AsyncClient, model: str, outputs: list[str], gen: int) -> Rounds:
    rounds: Rounds = []
    previous, call_id = None, None
    for output in [None, *outputs[:-1]]:
        body: dict[str, Any] = {
            "model": model,
            "tools": [{"type": "function", **FUNCTION}],
            "tool_choice": "required",
            "max_output_tokens": gen,
            "temperature": 0,
            "stream": True,
            "previous_response_id": previous,
            "input": QUESTION
            if output is None
            else [{"type": "function_call_output", "call_id": call_id, "output": output}],
        }
        start, first, final = time.perf_counter(), None, {}
        async with http.stream("POST", "/v1/responses", json=body) as stream:
            assert stream.status_code == 200, await stream.aread()
            async for line in stream.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if first is None and event["type"] == "response.output_item.added":
                    first = time.perf_counter() - start
                if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                    final = event["response"]
        calls = [item for item in final.get("output", []) if item["type"] == "function_call"]
        assert final.get("status") == "completed" and calls, final
        usage = final["usage"]
        rounds.append(
            {
                "ttft_s": first or 0.0,
                "total_s": time.perf_counter() - start,
                "input_tokens": usage["input_tokens"],
                "output_tokens": usage["output_tokens"],
                "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
            }
        )
        previous, call_id = final["id"], calls[0]["call_id"]
    return rounds


async def vllm_chat(http: httpx.AsyncClient, model: str, outputs: list[str], gen: int) -> Rounds:
    rounds: Rounds = []
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for output in outputs:
        body = {
            "model": model,
            "messages": messages,
            "tools": [{"type": "function", "function": FUNCTION}],
            "tool_choice": "required",
            "max_tokens": gen,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start, first = time.perf_counter(), None
        calls: dict[int, dict[str, str]] = {}
        usage: dict[str, Any] = {}
        async with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert stream.status_code == 200, await stream.aread()
            async for line in stream.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    for call in choice["delta"].get("tool_calls") or []:
                        if first is None:
                            first = time.perf_counter() - start
                        entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                        entry["id"] = call.get("id") or entry["id"]
                        function = call.get("function") or {}
                        entry["name"] += function.get("name") or ""
                        entry["arguments"] += function.get("arguments") or ""
        assert calls, "no tool call"
        rounds.append(
            {
                "ttft_s": first or 0.0,
                "total_s": time.perf_counter() - start,
                "input_tokens": usage.get("prompt_tokens", 0),
                "output_tokens": usage.get("completion_tokens", 0),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            }
        )
        call = calls[0]
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": output},
        ]
    return rounds


def tool_outputs(setup: EngineSetup, rounds: int, size: int, rng: random.Random) -> list[str]:
    """``rounds`` texts of about ``size`` tokens each, of the model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(setup.model_dir())
    texts = []
    for _ in range(rounds):
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < size:
            words += [rng.choice(WORDS) for _ in range(8)]
        texts.append(" ".join(words))
    return texts


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib, dtype=args.dtype
    )
    # Each run's tool outputs are new text (as a real tool's are): a run never finds
    # another run's outputs in a prefix cache. The same runs on every side.
    rng = random.Random(args.seed)
    warmup, *runs = [tool_outputs(setup, args.rounds, args.output_tokens, rng) for _ in range(args.repeats + 1)]
    log_dir = Path(args.out) / "logs"
    name = f"embedded-{setup.preset}"
    template = str(CHAT_TEMPLATE)  # the default model's own; named, for another preset
    tools = {"tool_call_parser": "hermes", "tool_strict_level": "parameter", "chat_template": template}
    sides: dict[str, Rounds] = {}
    # ours-no-tier: the same server without its CPU tier (connector none), to tell the
    # tier's share of a round from the session's; ours-inline-copies: with the tier, its
    # copies on the model's thread instead of a copy thread on the CPU it shares with the
    # engine core and the API server.
    for label, connector, extra in (
        ("ours", "offloading", {}),
        ("ours-no-tier", "none", {}),
        ("ours-inline-copies", "offloading", {"tier_copy_thread": "false"}),
    ):
        with our_server(setup, log_dir, connector, served_model_name=name, **tools, **extra) as server:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=600, headers=API_HEADERS) as http:
                await ours(http, name, warmup[:2], args.gen)
                sides[label] = median_per_turn([await ours(http, name, outputs, args.gen) for outputs in runs])
    flags = [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--tool-strict-level",
        "parameter",
        "--chat-template",
        template,
        "--enable-prompt-tokens-details",
    ]
    with vllm_server(setup, log_dir, True, extra_args=flags, label="vllm-prefix-on") as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as http:
            await vllm_chat(http, name, warmup[:2], args.gen)
            sides["vllm-prefix-on"] = median_per_turn(
                [await vllm_chat(http, name, outputs, args.gen) for outputs in runs]
            )
    last = args.rounds - 1
    return {
        "settings": {
            **setup.describe(),
            "rounds": args.rounds,
            "output_tokens": args.output_tokens,
            "gen": args.gen,
            "repeats": args.repeats,
            "seed": args.seed,
        },
        "summary": {
            "last_round_ttft_s": {side: rounds[last]["ttft_s"] for side, rounds in sides.items()},
            "last_round_ours_vs_vllm": sides["ours"][last]["ttft_s"] / sides["vllm-prefix-on"][last]["ttft_s"],
            "total_s": {side: sum(r["total_s"] for r in rounds) for side, rounds in sides.items()},
            "total_ours_vs_vllm": sum(r["total_s"] for r in sides["ours"])
            / sum(r["total_s"] for r in sides["vllm-prefix-on"]),
            "last_round_input_tokens": sides["ours"][last]["input_tokens"],
        },
        "per_round": sides,
    }


def plot(result: dict[str, Any]) -> Any:
    settings = result["settings"]
    return plot_ttft_per_turn(
        result["per_round"],
        f"Tool loop: a call per round, {settings['output_tokens']}-token "
        f"tool outputs ({settings['model_preset']}); time to the call's first delta",
    )


def main() -> None:
    parser = benchmark_parser(__doc__, kv_cache_gib=1.0)
    parser.set_defaults(preset="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--gen", type=int, default=64, help="most tokens a call may take")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        quick_engine(args)
        args.rounds, args.output_tokens, args.repeats, args.gen = 3, 32, 1, 160
    result = asyncio.run(main_async(args))
    finish("tool_loop", result, args.out, plot)


if __name__ == "__main__":
    main()
