"""Shared fixtures: one real vLLM engine per test session, built from test settings."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from app.settings import Settings

# Every server and service of a test run keeps its sessions in a fresh SQLite store
# (the default store), never in the user's own state directory.
os.environ.setdefault("STREAMSESS_STATE_DIR", tempfile.mkdtemp(prefix="streamsess-test-state-"))
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    # A store of its own per xdist worker (the controller's is in the environment the
    # workers inherit): one worker's idle-expiry would close the other's sessions.
    os.environ["STREAMSESS_STATE_DIR"] = tempfile.mkdtemp(prefix=f"streamsess-test-state-{worker}-")
# Mechanics tests run on the random-weight `tiny` preset, here and in every server
# process a test starts; tests about text and templates ask for the real default
# model by name (tests/server/test_fresh_server.py starts it as ./scripts/serve does).
os.environ.setdefault("STREAMSESS_MODEL_PRESET", "tiny")
# Under pytest-xdist (./scripts/test runs two workers on two cores), each worker's
# engines compute on a core of their own: vLLM's automatic binding would put every
# engine's compute thread on core 0, and the two workers would queue on it.
if worker and (cores := sorted(os.sched_getaffinity(0))):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[int(worker.removeprefix("gw")) % len(cores)]))

# Small enough for 2 cores, large enough that no test evicts by accident.
# float32: the shared engine's outputs are compared token for token with recomputes,
# which only float32 makes sound (bf16 checks compare a tier hit with a device hit,
# on engines of their own: tests/engine/test_tier_vs_device.py). The tiny model
# then keeps 4 KiB of KV per token.
TEST_ENGINE_SETTINGS: dict[str, Any] = {
    "dtype": "float32",
    "kv_cache_gib": 0.25,
    "cpu_tier_gib": 0.5,
    "block_size": 32,
    "max_model_len": 4096,
    "max_num_seqs": 16,
    "max_sessions": 8,
    "enforce_eager": True,
    # Lets tests read KV pages and attention kernels inside the worker.
    "engine_args": {"worker_extension_cls": "tests.kv_inspector.KVInspector"},
}


def make_settings(**overrides: Any) -> Settings:
    return Settings(_env_file=None, **{**TEST_ENGINE_SETTINGS, **overrides})


def pytest_report_header() -> str:
    from connectors.cpu_platform import kernel_flags

    return f"CPU flags that pick vLLM's CPU kernels: {' '.join(kernel_flags()) or 'none'}"


def pytest_configure(config: pytest.Config) -> None:
    from tests.helpers import RequestRestartLog

    logging.getLogger("app.sessions.session").addHandler(RequestRestartLog())


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.helpers import KERNELS_RAN, REQUEST_RESTARTS

    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand them to the controller
        session.config.workeroutput["kernels_ran"] = sorted(KERNELS_RAN)
        session.config.workeroutput["request_restarts"] = list(REQUEST_RESTARTS)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: the controller gathers its workers' records
def pytest_testnodedown(node: Any, error: Any) -> None:
    from tests.helpers import KERNELS_RAN, REQUEST_RESTARTS

    KERNELS_RAN.update(getattr(node, "workeroutput", {}).get("kernels_ran", []))
    REQUEST_RESTARTS.extend(getattr(node, "workeroutput", {}).get("request_restarts", []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from tests.helpers import KERNELS_RAN, REQUEST_RESTARTS

    ran = ", ".join(sorted(KERNELS_RAN)) or "none recorded"
    terminalreporter.write_line(f"CPU attention kernels the engine checks ran under: {ran}")
    counted = ", ".join(f"{test} ({REQUEST_RESTARTS.count(test)})" for test in sorted(set(REQUEST_RESTARTS)))
    terminalreporter.write_line(f"Engine requests that ended on their own, chunk sent again: {counted or 'none'}")


@pytest.fixture(scope="session")
def engine_settings() -> Settings:
    return make_settings()


@pytest_asyncio.fixture(scope="session")
async def engine(engine_settings: Settings) -> AsyncIterator[Any]:
    from app.engine import build_engine, shutdown_engine
    from tests.helpers import record_attention_kernels

    llm = build_engine(engine_settings)
    await record_attention_kernels(llm)
    yield llm
    shutdown_engine(llm)


@pytest.fixture(scope="session")
def anyio_backend() -> Iterator[str]:
    yield "asyncio"


API_KEYS = ("test-key-alice", "test-key-bob")


@pytest.fixture(scope="session")
def server_settings() -> Settings:
    return make_settings(api_keys=list(API_KEYS), session_idle_timeout_s=600.0)


@pytest_asyncio.fixture(scope="session")
async def server(engine: Any, server_settings: Settings) -> AsyncIterator[str]:
    """The real app over real HTTP on a loopback port, sharing the session's engine."""
    from tests.helpers import running_app

    async with running_app(server_settings, engine) as url:
        yield url


def auth(key: str = API_KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def tokenizer(engine: Any) -> Any:
    """The server's own tokenizer object (the engine's): a template set on it is the
    one the server renders with."""
    return engine.get_tokenizer()
