"""``./scripts/serve``'s LD_PRELOAD (connectors/cpu_preload.py): tcmalloc and Intel's OpenMP
runtime are added where missing, what is there is kept, and never a second OpenMP runtime.
The bug this guards: a server started by a process whose vLLM had set LD_PRELOAD to
PyTorch's libgomp (vLLM's CPU platform does that for the processes it starts) got Intel's
runtime too, and vLLM refused to start (``assert not (self.use_iomp and self.use_gomp)``);
the suite's fresh-server test caught it. Oracle: vLLM's own reading of LD_PRELOAD."""

from __future__ import annotations

import pytest

from connectors import cpu_preload
from connectors.cpu_preload import preload_value

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
IOMP = "/venv/lib/libiomp5.so"
GOMP = "/venv/lib/python3.11/site-packages/torch/lib/libgomp-a34b3233.so.1"


def vllm_reads(ld_preload: str) -> tuple[bool, bool]:
    """(Intel's, GNU's) as vLLM's OMPProcessManager tells them apart."""
    return "libiomp" in ld_preload or "libomp" in ld_preload, "libgomp" in ld_preload


@pytest.fixture(autouse=True)
def found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_preload, "tcmalloc", lambda: TCMALLOC)
    monkeypatch.setattr(cpu_preload, "iomp5", lambda: IOMP)


def test_both_are_added_to_an_empty_preload() -> None:
    assert preload_value("") == f"{TCMALLOC}:{IOMP}"


def test_gnus_runtime_already_there_stays_the_only_one() -> None:
    value = preload_value(GOMP)
    assert value == f"{TCMALLOC}:{GOMP}"
    assert vllm_reads(value) == (False, True)


def test_nothing_is_added_twice() -> None:
    value = f"{TCMALLOC}:{IOMP}"
    assert preload_value(value) == value
    assert preload_value(preload_value("")) == preload_value("")


def test_nothing_found_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_preload, "tcmalloc", lambda: None)
    monkeypatch.setattr(cpu_preload, "iomp5", lambda: None)
    assert preload_value("") == "" and preload_value(GOMP) == GOMP
