"""The floor of the transport benchmarks: one streaming session fed chunk by chunk on an
AsyncLLM, in the process that holds it, with no transport at all.

Two places hold it:

- ``EngineSession(engine)`` on an engine of the benchmark's own (``in_process_engine``);
- our server with ``POST /bench/floor`` added (``python -m benchmarks.floor serve``): the
  same session driven inside the server's process, on the server's own engine. The body
  is ``{"inputs": [[token, ...], ...]}``; the answer, ``{"spans": [[start, end], ...]}``,
  each chunk's as the server measured it (``time.perf_counter_ns``).

Why both: two engine processes of the same settings, on the same core, take different
times for the same step, by 0.1 to 0.8 ms from run to run here (the EPYC, seen by
benchmarks.chunk_timeline's engine stamps), as much as a transport costs. A floor on the
server's own engine has the same engine as the transports it is compared with.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

FLOOR_ROUTE = "/bench/floor"
# Our server with the floor's route (``serve`` below).
SERVE_COMMAND = [sys.executable, "-m", "benchmarks.floor", "serve"]


class EngineSession:
    """One streaming session on ``engine``, fed chunk by chunk, kept open across rounds."""

    def __init__(self, engine: Any, request_id: str = "transport-floor"):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        # skip_clone as the server's chunks have it: vLLM's deep copy of the params
        # per chunk (about 20 us) is not a transport's cost.
        self.params = SamplingParams(
            max_tokens=1, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA, skip_clone=True
        )
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        # vLLM drops a chunk's last sampled token when the next chunk comes (it has no KV
        # yet); a session sends it again at the next chunk's head (app/sessions/session.py),
        # so every chunk after the first is one token longer: the floor's are too.
        self.unsent: list[int] = []
        self.outputs = engine.generate(prompt=self._feed(), sampling_params=self.params, request_id=request_id)

    async def _feed(self) -> Any:
        while (item := await self.queue.get()) is not None:
            yield item

    async def run(self, inputs: list[list[int]]) -> list[float]:
        """Each chunk's time, in seconds."""
        return seconds(await self.spans(inputs))

    async def spans(self, inputs: list[list[int]]) -> list[tuple[int, int]]:
        """Each chunk's (start, end) on ``time.perf_counter_ns`` (CLOCK_MONOTONIC: the
        same clock in every process here)."""
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs.engine import tokens_input

        spans = []
        for chunk in inputs:
            start = time.perf_counter_ns()
            prompt = tokens_input(self.unsent + list(chunk))
            self.queue.put_nowait(StreamingInput(prompt=prompt, sampling_params=self.params))
            async for output in self.outputs:
                if output.outputs[0].token_ids:
                    self.unsent = list(output.outputs[0].token_ids[-1:])
                if output.outputs[0].finish_reason is not None:
                    break
            spans.append((start, time.perf_counter_ns()))
        return spans

    async def close(self) -> None:
        self.queue.put_nowait(None)
        async for _ in self.outputs:
            pass


def with_floor_route(app: Any) -> Any:
    """``app`` with ``POST /bench/floor``: chunks on an ``EngineSession`` of the app's own
    engine (one, made at the first call, kept for the server's life)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    sessions: list[EngineSession] = []

    async def floor(request: Request) -> JSONResponse:
        if not sessions:
            sessions.append(EngineSession(request.app.state.engine_client, request_id="server-floor"))
        return JSONResponse({"spans": await sessions[0].spans((await request.json())["inputs"])})

    app.router.routes.insert(0, Route(FLOOR_ROUTE, floor, methods=["POST"]))
    return app


def seconds(spans: list[tuple[int, int]]) -> list[float]:
    """Each (start, end) span in nanoseconds as its length in seconds."""
    return [(end - start) / 1e9 for start, end in spans]


async def spans_in_server(http: Any, inputs: list[list[int]]) -> list[tuple[int, int]]:
    """The floor's chunks run by the server ``http`` talks to (an aiohttp session with the
    API key): each chunk's (start, end) as the server measured it."""
    async with http.post(FLOOR_ROUTE, json={"inputs": inputs}) as response:
        response.raise_for_status()
        return [(int(start), int(end)) for start, end in (await response.json())["spans"]]


def serve() -> None:
    """``python -m app.main`` with the floor's route added to the app it builds."""
    from fastapi import FastAPI

    from app import main
    from app.settings import Settings

    create_app = main.create_app

    def create_app_with_floor(settings: Settings, engine: Any | None = None) -> FastAPI:
        return with_floor_route(create_app(settings, engine))

    main.create_app = create_app_with_floor
    main.cli([])


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve()
