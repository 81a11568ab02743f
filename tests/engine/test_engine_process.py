"""The engine's processes on a CPU machine: the model worker runs inside the engine-core
process (``cpu_worker_in_engine_core``, on by default), bound as vLLM binds a worker.

Oracle: the operating system. The worker reports its own process (through the KV
inspector worker extension), and psutil says which processes this one started. With the
setting off, the same check sees vLLM's own layout (a worker process beside the engine
core): the negative control, so the check cannot pass whatever the layout."""

from __future__ import annotations

import contextlib
from typing import Any

import psutil
import pytest

from tests.conftest import make_settings

pytestmark = pytest.mark.engine


def descendants() -> dict[int, str]:
    """Every process below this one: its id and its title (argv[0])."""
    found = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # ended meanwhile
            found[child.pid] = (child.cmdline() or [""])[0]
    return found


async def worker_layout(engine: Any) -> tuple[str, list[str]]:
    """(the title of the process the worker runs in, the titles of vLLM's processes)."""
    ((worker_pid, worker_title),) = await engine.collective_rpc("streamsess_process")
    processes = descendants()
    assert worker_pid in processes, "the worker is not a process this test started"
    return worker_title, sorted(t for t in processes.values() if t.startswith("VLLM::"))


async def test_the_worker_runs_in_the_engine_core_process(engine: Any) -> None:
    worker_title, titles = await worker_layout(engine)
    assert worker_title == "VLLM::EngineCore"
    assert "VLLM::Worker" not in titles, titles


async def test_negative_control_vllms_default_gives_the_worker_a_process() -> None:
    from app.engine import build_engine, shutdown_engine

    llm = build_engine(make_settings(cpu_worker_in_engine_core=False))
    try:
        worker_title, titles = await worker_layout(llm)
    finally:
        shutdown_engine(llm)
    assert worker_title == "VLLM::Worker" and "VLLM::EngineCore" in titles, (worker_title, titles)
