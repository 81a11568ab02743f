"""Benchmark: one stream's decode speed on this CPU, step by step of what the server is started with.

Our server on the same model and engine settings, started five ways, each adding one step:
eager with vLLM's own linear kernels (``enforce_eager``, ``cpu_linear=onednn``: what
vLLM does by itself); with vLLM's packed bf16 linear kernel (``cpu_linear=auto``,
``connectors/cpu_linear.py``: on an AVX-512-BF16 CPU without AMX; elsewhere the same as
without); compiled (``--no-enforce-eager``: torch.compile and vLLM's CPU graph mode)
without, then with the packed kernel; and with vLLM's recommended CPU runtime preloaded
(tcmalloc and Intel OpenMP, ``connectors.cpu_preload``): the last is what ``./scripts/serve``
serves (on a CPU where the packed kernel does not apply, the steps without it, the last
compiled with the runtime preloaded). Each server starts alone (its start to ``/health``
timed; a compiled one with an empty compile cache, then once more with the cache its first
start filled: a warm start),
then the rounds run side after side: one request of a short prompt generating N tokens
(``ignore_eos``, greedy), streamed, timed from its first token to its last.

    python -m benchmarks.cpu_decode                  # default model, bf16, 256 tokens, 4 rounds
    python -m benchmarks.cpu_decode --quick          # tiny model (the suite's smoke run)

Writes benchmarks/results/cpu_decode.json and .png: tokens/s per side and round, the
median, each side's ratio to eager, start times.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    SWITCH_SETTLE_S,
    EngineSetup,
    RunningServer,
    alternated,
    benchmark_parser,
    cpu_caption,
    decode_speed,
    finish,
    machine,
    our_server,
    plot_decode_rounds,
    pyplot,
    quick_engine,
    random_tokens,
    served_model,
    tagged,
)
from connectors.cpu_linear import packed_kernel_helps
from connectors.cpu_preload import preload_value
from tests.helpers import environment

SIDES: dict[str, tuple[bool, bool, bool]] = {  # name: (compiled, packed linear kernel, preloaded)
    "eager": (False, False, False),
    "eager+packed": (False, True, False),
    "compiled": (True, False, False),
    "compiled+packed": (True, True, False),
    "compiled+packed+preload": (True, True, True),
    "compiled+preload": (True, False, True),  # what ./scripts/serve serves where the packed kernel does not apply
}


def default_sides() -> list[str]:
    """Every step on a CPU where the packed kernel applies; elsewhere ``cpu_linear=auto`` is
    vLLM's own choice, so the steps without it."""
    if packed_kernel_helps():
        return [side for side in SIDES if side != "compiled+preload"]
    return [side for side, (_, packed, _) in SIDES.items() if not packed]


def start_side(
    stack: contextlib.ExitStack, setup: EngineSetup, log_dir: Path, side: str, cache_root: Path, warm: bool = False
) -> tuple[RunningServer, float]:
    """A server of this side, healthy, and the seconds its start took (``warm``: a second
    start, on the compile cache the first filled)."""
    compiled, packed, preloaded = SIDES[side]
    env = {"VLLM_CACHE_ROOT": str(cache_root), "LD_PRELOAD": preload_value("") if preloaded else ""}
    name = side.replace("+", "-") + ("-warm" if warm else "")
    started = time.perf_counter()
    with environment(**env):
        server = stack.enter_context(
            our_server(
                setup,
                log_dir,
                name=name,
                enforce_eager=str(not compiled).lower(),
                cpu_linear="auto" if packed else "onednn",
            )
        )
    return server, time.perf_counter() - started


def run(args: Any) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset,
        kv_cache_gib=args.kv_cache_gib,
        cpu_tier_gib=args.cpu_tier_gib,
        dtype=args.dtype,
        max_num_seqs=8,
    )
    rng = random.Random(args.seed)
    sides = [side for side in SIDES if side in (args.sides or default_sides())]
    log_dir = Path(tempfile.mkdtemp(prefix="bench-cpu-decode-"))
    starts: dict[str, dict[str, float]] = {}
    rounds: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    with contextlib.ExitStack() as stack:
        servers: dict[str, RunningServer] = {}
        for side in sides:
            cache_root = log_dir / f"cache-{side}"
            servers[side], seconds = start_side(stack, setup, log_dir, side, cache_root)
            starts[side] = {"cold_s": seconds}
            if SIDES[side][0]:  # compiled: the same start again, on the compile cache the first one filled
                with contextlib.ExitStack() as again:
                    _, warm = start_side(again, setup, log_dir, side, cache_root, warm=True)
                starts[side]["warm_s"] = warm
            print(f"{side}: started in {starts[side]}")
        models = {side: served_model(server) for side, server in servers.items()}
        for side, server in servers.items():
            decode_speed(server, models[side], random_tokens(rng, args.prompt), 8)  # warm-up: first steps are slow
        for index in range(args.rounds):
            prompt = random_tokens(rng, args.prompt)
            for side in alternated(sides, index):
                time.sleep(SWITCH_SETTLE_S)
                rounds[side].append(decode_speed(servers[side], models[side], prompt, args.tokens))
                print(f"round {index} {side}: {rounds[side][-1]}")
    median = {side: statistics.median(r["decode_tokens_per_s"] for r in rounds[side]) for side in sides}
    base = median.get("eager")
    summary = {
        side: {
            "decode_tokens_per_s": round(median[side], 2),
            "ratio_to_eager": round(median[side] / base, 3) if base else None,
            "start_s": {k: round(v, 1) for k, v in starts[side].items()},
        }
        for side in sides
    }
    return {
        "benchmark": "cpu_decode",
        "machine": machine(),
        "engine": setup.describe(),
        "preloaded": preload_value("").split(":"),
        "packed_kernel_applies": packed_kernel_helps(),
        "prompt_tokens": args.prompt,
        "decode_tokens": args.tokens,
        "rounds": rounds,
        "starts": starts,
        "summary": summary,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    plot_decode_rounds(axis, result["rounds"])
    axis.set_title(f"{result['engine']['model_preset']} {result['engine']['dtype']}, {cpu_caption(result)}", fontsize=8)
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, kv_cache_gib=0.5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=256, help="tokens decoded a round")
    parser.add_argument("--sides", nargs="*", choices=list(SIDES), help="a subset of the sides")
    parser.set_defaults(preset="smollm2-135m-instruct", cpu_tier_gib=1.0)
    args = parser.parse_args()
    if args.quick:
        quick_engine(args)
        args.rounds, args.tokens = 2, 16
        args.sides = args.sides or ["eager", "eager+packed"]
    finish(tagged("cpu_decode-quick" if args.quick else "cpu_decode", args), run(args), args.out, plot)


if __name__ == "__main__":
    main()
