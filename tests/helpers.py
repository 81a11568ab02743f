"""Helpers shared by the engine-backed tests: drive AsyncLLM directly."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psutil
import pytest
from vllm import SamplingParams
from vllm.engine.protocol import StreamingInput
from vllm.sampling_params import RequestOutputKind
from websockets.exceptions import ConnectionClosed

from app.settings import Settings
from connectors.cpu_platform import ATTENTION_ENV, cpu_has_amx

_ids = itertools.count()

# The CPU attention kernels the bf16 checks run under: vLLM's own choice ("auto":
# AMX where the CPU has it) and, on an AMX CPU, the kernel vLLM picks without it.
# fp32 never runs the AMX kernel (vLLM uses it for bf16 only).
ATTENTION_KERNELS = ["auto", "no-amx"] if cpu_has_amx() else ["auto"]
# The session services of the apps running_app serves in this process (on the shared
# engine), whose idle sessions reset_device_prefix_cache parks.
RUNNING_SERVICES: list[tuple[Any, Any]] = []
# The apps running_app serves in this process, by URL: a test that needs a hook inside
# the server (a race made certain) reaches its serving objects here.
RUNNING_APPS: dict[str, Any] = {}
# Which kernels the engines of this test run actually ran, for the summary line.
KERNELS_RAN: set[str] = set()
# The tests during which a session's engine request ended on its own and its chunk was
# sent again (app/sessions/session.py), for the summary line: one fast test does it on
# purpose; any other names where the cause, not yet found, struck.
REQUEST_RESTARTS: list[str] = []


class RequestRestartLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "sent again on a new request" in record.getMessage():
            REQUEST_RESTARTS.append(os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0])


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables while an engine starts: its processes copy them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.asynccontextmanager
async def started_engine(settings: Any, attention: str = "auto") -> AsyncIterator[Any]:
    """A real AsyncLLM of its own for one test, shut down after it."""
    from app.engine import build_engine, shutdown_engine

    with environment(**{ATTENTION_ENV: attention}):
        llm = build_engine(settings)
    try:
        yield llm
    finally:
        shutdown_engine(llm)


async def record_attention_kernels(engine: Any) -> list[str]:
    """The attention kernels the engine's workers run (needs the KV inspector
    worker extension), remembered for the test run's summary."""
    kernels = sorted({k for worker in await engine.collective_rpc("streamsess_attention_kernels") for k in worker})
    KERNELS_RAN.update(kernels)
    return kernels


def greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def random_tokens(rng: random.Random, count: int, vocab: int = 700) -> list[int]:
    # Ids from 1: id 0 is the embedded tokenizer's end-of-text token.
    return [rng.randrange(1, vocab) for _ in range(count)]


class EngineSession:
    """One streaming-input session straight on AsyncLLM, kept open between chunks,
    so a test can look at it while it is idle (its KV still on the device)."""

    def __init__(self, engine: Any, max_tokens: int):
        self.engine = engine
        self.request_id = f"session-{next(_ids)}"
        self.params = greedy(max_tokens, output_kind=RequestOutputKind.DELTA)
        self.context: list[int] = []
        self.outputs: list[list[int]] = []
        self._inputs: asyncio.Queue[StreamingInput | None] = asyncio.Queue()
        self._stream = engine.generate(prompt=self._feed(), sampling_params=self.params, request_id=self.request_id)

    async def _feed(self) -> AsyncIterator[StreamingInput]:
        while (item := await self._inputs.get()) is not None:
            yield item

    async def send(self, chunk: list[int]) -> list[int]:
        """Append a chunk; return its output once the chunk has finished."""
        self._inputs.put_nowait(StreamingInput(prompt={"prompt_token_ids": list(chunk)}, sampling_params=self.params))
        output: list[int] = []
        async for out in self._stream:
            output.extend(out.outputs[0].token_ids)
            if out.outputs[0].finish_reason is not None:
                break
        self.outputs.append(output)
        # The engine keeps every output token but the last sampled one.
        self.context += list(chunk) + output[:-1]
        return output

    def internal_request_id(self) -> str:
        """vLLM's own id of this session's request (it suffixes ours)."""
        states = self.engine.output_processor.request_states
        return next(key for key, state in states.items() if getattr(state, "external_req_id", key) == self.request_id)

    async def close(self) -> None:
        self._inputs.put_nowait(None)
        async for _ in self._stream:
            pass


async def run_streaming_session(
    engine: Any, chunks: list[list[int]], max_tokens: int
) -> tuple[list[int], list[list[int]]]:
    """Run one streaming-input session of ``chunks`` and close it.

    Returns the context the engine holds at the end (each chunk's input and its
    output minus the last sampled token, which vLLM discards on resume) and each
    chunk's output tokens."""
    session = EngineSession(engine, max_tokens)
    for chunk in chunks:
        await session.send(chunk)
    await session.close()
    return session.context, session.outputs


async def generate_once(engine: Any, prompt_ids: list[int], max_tokens: int, recompute: bool = False) -> Any:
    """One greedy request; ``recompute`` forbids every cache (device and CPU tier) and
    salts the request, so its blocks are stored under hashes of their own: a recompute
    can neither read a session's KV nor put its own where the session's would be."""
    params = greedy(max_tokens, skip_reading_prefix_cache=True if recompute else None)
    request_id = f"once-{next(_ids)}"
    prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
    if recompute:
        prompt["cache_salt"] = f"recompute-{request_id}"
    final = None
    async for out in engine.generate(prompt=prompt, sampling_params=params, request_id=request_id):
        final = out
    assert final is not None and final.finished
    return final


def live_request_ids(engine: Any) -> set[str]:
    """External ids of the requests the engine still tracks (vLLM suffixes its
    internal ids, so the raw keys never equal ours)."""
    return {
        getattr(state, "external_req_id", None) or key for key, state in engine.output_processor.request_states.items()
    }


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; return whether it held."""
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def park_idle_sessions_of_running_apps(engine: Any | None = None) -> None:
    """Park the idle sessions of the apps ``running_app`` serves in this process (on
    ``engine``, or on any), as their servers' idle reapers would: another module's open
    session, such as a Responses chain, which stays live by design, holds device blocks
    that a device-cache reset would be refused for (clean-clone CI runs found it)."""
    for service, its_engine in RUNNING_SERVICES:
        if engine is None or its_engine is engine:
            await service.parking.park_idle(time.time() + 1, "idle")


async def reset_device_prefix_cache(engine: Any, timeout_s: float = 10.0) -> None:
    """Reset the device prefix cache (the CPU tier keeps its blocks). vLLM refuses while
    any block is in use. The idle sessions of the apps running on the shared engine are
    parked first (``park_idle_sessions_of_running_apps``); an aborted
    request (a parked session's) frees its blocks in the engine core a moment after the
    front end drops it, so refusals are retried for ``timeout_s``; a block held longer
    is a live request, named in the failure."""
    await park_idle_sessions_of_running_apps(engine)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await engine.reset_prefix_cache():
        assert asyncio.get_running_loop().time() < deadline, (
            f"device cache reset refused for {timeout_s} s: live requests {sorted(live_request_ids(engine))}"
        )
        await asyncio.sleep(0.05)


async def wait_until_gone(engine: Any, request_id: str, timeout_s: float = 10.0) -> bool:
    return await until(lambda: request_id not in live_request_ids(engine), timeout_s)


async def wait_until_closed(http: Any, session_id: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Poll GET /v1/sessions/{id} until the session is closed; return its last state."""
    state: dict[str, Any] = {}
    for _ in range(int(timeout_s / 0.05)):
        state = (await http.get(f"/v1/sessions/{session_id}")).json()
        if state.get("status") == "closed":
            break
        await asyncio.sleep(0.05)
    return state


@contextlib.asynccontextmanager
async def running_app(settings: Settings, engine: Any) -> AsyncIterator[str]:
    """The real app over real HTTP on a loopback port, on ``engine``; yields its URL.

    uvicorn runs as a task on the test's event loop, so async tests talk to it with
    real sockets; sync clients must run in a thread (asyncio.to_thread).
    """
    import uvicorn

    from app.main import create_app, uvicorn_config

    app = create_app(settings, engine=engine)
    uv_server = uvicorn.Server(
        uvicorn_config(app, settings, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(uv_server.serve())
    while not uv_server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.05)
    port = uv_server.servers[0].sockets[0].getsockname()[1]
    running = (app.state.session_service, engine)
    RUNNING_SERVICES.append(running)
    url = f"http://127.0.0.1:{port}"
    RUNNING_APPS[url] = app
    try:
        yield url
    finally:
        RUNNING_APPS.pop(url, None)
        RUNNING_SERVICES.remove(running)
        uv_server.should_exit = True
        await asyncio.wait_for(task, 30)


async def close_code(ws: Any) -> int:
    """The close code the server sent, once the next read finds the connection closed
    (it must close rather than send another message)."""
    with pytest.raises(ConnectionClosed) as closed:
        await ws.recv()
    assert closed.value.rcvd is not None, "closed without a close frame"
    return int(closed.value.rcvd.code)


@contextlib.contextmanager
def paused_engine(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """Stop a server's engine (every process under its API server), and continue it
    afterwards. The API server runs on: it takes leases and sends requests, which the
    engine answers only once continued."""
    engine = psutil.Process(process.pid).children(recursive=True)
    assert engine, "the replica's API server has no engine process under it"
    for child in engine:
        child.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for child in engine:
            with contextlib.suppress(psutil.NoSuchProcess):  # killed meanwhile
                child.send_signal(signal.SIGCONT)
