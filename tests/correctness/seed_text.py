"""The seed PR's end-to-end validation on the real default model, shown as text.

A three-chunk streaming session (real English text, each chunk followed by a short
greedy answer) fills the CPU tier; the device prefix cache is reset (the tier kept);
a greedy request on a prefix of the session's context is then served from the tier,
and compared with a recompute of the same prefix. The recompute reads no cache and is
salted, so it can neither read nor store under the session's block hashes. float32,
so that the comparison is token for token (docs/correctness.md).

Run once with our streaming fix and once without (``disable_streaming_session_fix``):
with the fix the two answers are the same text; without it the tier serves chunk 1's
KV under chunks 2 and 3's keys and the answer differs.

    python -m tests.correctness.seed_text            # writes docs/results/seed-text-smollm2.json
"""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

CHUNKS = [
    "Minutes of the planning meeting, Tuesday. Anna opened the meeting at nine and reviewed the "
    "schedule for the spring release. The team agreed that the new search page must ship first, "
    "because customers asked for it in every survey since last autumn. Ben said the database work is "
    "two weeks late, mostly because the migration scripts had to be rewritten after the audit.",
    " Carla presented the budget. Travel costs went down by a third, but the cloud bill doubled after "
    "the load tests in March. She proposed to move the nightly reports to the old servers, which sit "
    "idle after six in the evening, and to stop the test clusters every weekend. Nobody objected, and "
    "Ben offered to write the scripts that switch the clusters off and on again.",
    " Then David raised the question of hiring. Two engineers leave in June, and the support queue is "
    "already longer than it was in winter. Anna asked him to write the job descriptions by Friday and "
    "to talk to the recruiting agency about the budget. The meeting closed at half past ten, and the "
    "next one will be held on Thursday of the following week in the large room.",
]
CHUNK_OUTPUT_TOKENS = 8
PROBE_OUTPUT_TOKENS = 32
PREFIX_LENGTHS = (192, 288)
OUT = Path(__file__).resolve().parents[2] / "docs" / "results" / "seed-text-smollm2.json"


async def validate(disable_fix: bool) -> dict[str, Any]:
    from app.engine import build_engine, shutdown_engine
    from app.settings import Settings
    from tests.helpers import reset_device_prefix_cache, run_streaming_session

    settings = Settings(
        _env_file=None,
        model_preset="smollm2-135m-instruct",
        dtype="float32",
        kv_cache_gib=0.5,
        cpu_tier_gib=1.0,
        max_model_len=4096,
        max_num_seqs=8,
        disable_streaming_session_fix=disable_fix,
    )
    engine = build_engine(settings)
    try:
        tokenizer = engine.get_tokenizer()
        chunks = [list(tokenizer.encode(text, add_special_tokens=False)) for text in CHUNKS]
        context, _ = await run_streaming_session(engine, chunks, max_tokens=CHUNK_OUTPUT_TOKENS)
        await reset_device_prefix_cache(engine)
        probes = []
        for length in PREFIX_LENGTHS:
            served = await greedy(engine, context[:length], salt=None)
            recomputed = await greedy(engine, context[:length], salt=f"recompute-{secrets.token_hex(8)}")
            probes.append(
                {
                    "prefix_tokens": length,
                    "prefix_text_tail": tokenizer.decode(context[length - 24 : length]),
                    "cpu_tier_tokens": served.num_cached_tokens,
                    "recompute_cached_tokens": recomputed.num_cached_tokens,
                    "served_from_tier": served.outputs[0].text,
                    "recomputed": recomputed.outputs[0].text,
                    "equal": list(served.outputs[0].token_ids) == list(recomputed.outputs[0].token_ids),
                }
            )
        return {"streaming_fix": not disable_fix, "context_tokens": len(context), "probes": probes}
    finally:
        shutdown_engine(engine)


async def greedy(engine: Any, prompt: list[int], salt: str | None) -> Any:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=PROBE_OUTPUT_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        skip_reading_prefix_cache=salt is not None or None,
    )
    request: dict[str, Any] = {"prompt_token_ids": list(prompt), **({"cache_salt": salt} if salt else {})}
    final = None
    async for output in engine.generate(
        prompt=request, sampling_params=params, request_id=f"seed-text-{secrets.token_hex(6)}"
    ):
        final = output
    return final


def main() -> None:
    from connectors.cpu_platform import kernel_flags

    runs = [asyncio.run(validate(disable_fix=False)), asyncio.run(validate(disable_fix=True))]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {"model": "smollm2-135m-instruct", "dtype": "float32", "cpu_flags": " ".join(kernel_flags()), "runs": runs},
            indent=2,
        )
    )
    for run in runs:
        print(f"\nstreaming fix {'on' if run['streaming_fix'] else 'OFF'}:")
        for probe in run["probes"]:
            print(
                f"  prefix {probe['prefix_tokens']} (tier {probe['cpu_tier_tokens']} tokens), "
                f"equal={probe['equal']}\n    tier:      {probe['served_from_tier']!r}\n"
                f"    recompute: {probe['recomputed']!r}"
            )
    print(OUT)


if __name__ == "__main__":
    main()
