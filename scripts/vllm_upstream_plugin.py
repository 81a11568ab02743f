"""pytest plugin: vLLM's own connector unit tests, run against our connector classes.

Loaded by ``scripts/vllm-upstream-tests`` into vLLM's test suite (from the sdist of the
vLLM release installed beside it). Before any test module is imported it puts our
subclasses where vLLM's tests (and vLLM's connector factory) look the upstream classes
up, so every connector and scheduler those tests build is ours:

- ``OffloadingConnector`` -> ``StreamingSafeOffloadingConnector``
- ``OffloadingConnectorScheduler`` -> ``StreamingSafeOffloadingScheduler``
- ``SimpleCPUOffloadConnector`` -> ``StreamingSafeSimpleCPUOffloadConnector``
- ``SimpleCPUOffloadScheduler`` -> ``StreamingSafeSimpleCPUOffloadScheduler``

``STREAMSESS_UPSTREAM_MODE=forced`` also turns our streaming fix on where the installed
vLLM already has its own (our overrides then run on top of upstream's fix, which is
what a detection error would do); ``shipped`` keeps our detection; ``upstream`` puts
nothing in place (the baseline).

In every mode, one shim for a machine without a GPU: vLLM's platform is then
"unspecified", which supports no hybrid KV cache manager and names no device, and
most scheduler tests ask for both when they build their config (they never touch a
device). The shim answers as the CUDA platform does, for all modes alike.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The repository root, so ``connectors`` imports from the checkout under test.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODE_VARIABLE = "STREAMSESS_UPSTREAM_MODE"


def pytest_configure(config: object) -> None:
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        type(current_platform).support_hybrid_kv_cache = classmethod(lambda cls: True)  # type: ignore[method-assign]
        type(current_platform).device_type = "cpu"
        print("[ours-in-place] no GPU platform: hybrid KV cache manager allowed, device type 'cpu'")
    mode = os.environ.get(MODE_VARIABLE, "shipped")
    if mode == "upstream":
        return
    from vllm.distributed.kv_transfer.kv_connector.v1 import (
        offloading_connector,
        simple_cpu_offload_connector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler
    from vllm.v1.simple_kv_offload import manager

    from connectors import compat, offloading, simple

    replacements = [
        (offloading_connector, "OffloadingConnector", offloading.StreamingSafeOffloadingConnector),
        (scheduler, "OffloadingConnectorScheduler", offloading.StreamingSafeOffloadingScheduler),
        (simple_cpu_offload_connector, "SimpleCPUOffloadConnector", simple.StreamingSafeSimpleCPUOffloadConnector),
        (manager, "SimpleCPUOffloadScheduler", simple.StreamingSafeSimpleCPUOffloadScheduler),
    ]
    for module, name, ours in replacements:
        assert issubclass(ours, getattr(module, name)), f"{ours.__name__} no longer subclasses {name}"
        setattr(module, name, ours)
    if mode == "forced":
        compat.upstream_has_streaming_fix.cache_clear()
        compat.upstream_has_streaming_fix = lambda: False  # type: ignore[assignment]
    elif mode != "shipped":
        raise SystemExit(f"{MODE_VARIABLE} must be 'upstream', 'shipped' or 'forced', not {mode!r}")
    print(
        f"[ours-in-place] mode={mode}, streaming fix on: {compat.streaming_fix_wanted(None)}; "
        + ", ".join(f"{name} -> {ours.__name__}" for _, name, ours in replacements)
    )


def pytest_report_header(config: object) -> str:
    import vllm

    return f"vLLM {vllm.__version__}; our connector classes in place of upstream's ({__file__})"
