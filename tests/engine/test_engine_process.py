"""The engine's processes on a CPU machine: the model worker runs inside the engine-core
process (``cpu_worker_in_engine_core``, on by default), bound as vLLM binds a worker.

Oracle: the operating system. The worker reports its own process (through the KV
inspector worker extension), and /proc says which processes this one started. With the
setting off, the same check sees vLLM's own layout (a worker process beside the engine
core): the negative control, so the check cannot pass whatever the layout."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import make_settings

pytestmark = pytest.mark.engine


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``: its id and its title (argv[0])."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                try:
                    found[child] = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode()
                except OSError:
                    continue
                frontier.append(child)
    return found


async def worker_layout(engine: Any) -> tuple[str, list[str]]:
    """(the title of the process the worker runs in, the titles of vLLM's processes)."""
    ((worker_pid, worker_title),) = await engine.collective_rpc("streamsess_process")
    titles = sorted(t for t in descendants(os.getpid()).values() if t.startswith("VLLM::"))
    assert worker_pid in descendants(os.getpid()), "the worker is not a process this test started"
    return worker_title, titles


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
