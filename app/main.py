"""The server: vLLM's own OpenAI app plus our session routes, on one AsyncLLM.

``create_app`` builds the FastAPI app with vLLM's ``build_app`` (so
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/health`` and
``/metrics`` are vLLM's code), adds our routers and middleware, and starts the
engine in the lifespan (or uses the one it is given, as the tests do).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from argparse import Namespace
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from app.api.responses.protocol import declare_stored_response_rules
from app.api.routes import api_router
from app.api.sessions import rest
from app.api.sessions.protocol import ChunkRequest
from app.engine import EngineConfigError, flush_disk_tier, kv_transfer_config, shutdown_engine
from app.http import log_context
from app.http.auth import APIKeyMiddleware
from app.http.direct_route import DirectRoute
from app.http.errors import declare_error_codes, install_error_handlers
from app.http.middleware import (
    AnthropicErrorMiddleware,
    BodySizeLimitMiddleware,
    EngineDeadMiddleware,
    RateLimitMiddleware,
    ReplicaHeaderMiddleware,
)
from app.http.uvicorn_protocol import CoalescingHttpToolsProtocol
from app.models.smollm2 import ModelUnavailable
from app.sessions.service import SessionService
from app.settings import Settings, load_settings
from app.store.cluster import ReplicaConflict
from app.vllm_routes import fixes as vllm_fixes
from app.vllm_routes.requests import OpenAIRequestMiddleware
from app.vllm_routes.routes import (
    drop_replaced_routes,
    drop_routes_the_model_cannot_serve,
    drop_unserved_routes,
    metrics_read_only,
    openai_body_routes,
    rebuild_middleware_stack,
)
from app.vllm_routes.schema import (
    declare_filled_in_fields,
    declare_model_limits,
    declare_server_features,
    declare_vllm_input_rules,
    patch_openapi,
)
from app.vllm_routes.usage import UsageProvenanceMiddleware
from app.wiring import EdgeParts, build_serving

logger = logging.getLogger(__name__)

SUPPORTED_TASKS: tuple[Any, ...] = ("generate",)
# How often the server checks its engine, and its exit status once the engine died.
ENGINE_CHECK_S = 1.0
ENGINE_DEAD_EXIT = 3


def vllm_server_args(settings: Settings, model_path: str) -> Namespace:
    """vLLM's own server arguments, so its serving layer behaves as under `vllm serve`."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    args = [
        "--model",
        model_path,
        "--served-model-name",
        settings.resolved_served_model_name(),
        "--max-model-len",
        str(settings.max_model_len),
        # cached_tokens in usage; our middleware adds the source split.
        "--enable-prompt-tokens-details",
    ]
    if (tool_call_parser := settings.resolved_tool_call_parser()) is not None:
        args += [
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            tool_call_parser,
            "--tool-strict-level",
            settings.tool_strict_level,
        ]
    if settings.reasoning_parser:
        args += ["--reasoning-parser", settings.reasoning_parser]
    if (chat_template := settings.resolved_chat_template()) is not None:
        args += ["--chat-template", chat_template]
    return parser.parse_args(args)


def renderer_features(renderer: Any) -> dict[str, bool]:
    """What vLLM's online renderer was started with, as declare_server_features takes it:
    whether it parses tool calls (a tool parser, a Mistral tokenizer or harmony, as its
    own tool_choice check reads them), serves harmony, takes prompt embeddings, images,
    renders a completion's suffix (fill-in-the-middle)."""
    from vllm.utils.mistral import is_mistral_tokenizer

    parser = getattr(renderer.parser, "tool_parser_cls", None)
    return {
        "tool_parsing": (
            parser is not None or renderer.use_harmony or is_mistral_tokenizer(renderer.renderer.tokenizer)
        ),
        "harmony": bool(renderer.use_harmony),
        "prompt_embeds": bool(renderer.model_config.enable_prompt_embeds),
        "multimodal": bool(renderer.model_config.is_multimodal_model),
        "fim": renderer.renderer.render_completion_suffix("", "") is not None,
    }


def create_app(settings: Settings, engine: Any | None = None) -> FastAPI:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    vllm_fixes.apply()
    model_path = settings.resolved_model()
    args = vllm_server_args(settings, model_path)
    app = build_app(args, supported_tasks=SUPPORTED_TASKS)
    app.title = "streaming-sessions"
    app.description = "Streaming-input LLM sessions over REST and websocket, beside vLLM's OpenAI API."
    vllm_lifespan = app.router.lifespan_context
    edge = EdgeParts.from_settings(settings)  # one limits and one salter, shared with the services

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from app.engine import build_engine

        owns_engine = engine is None
        llm = engine if engine is not None else build_engine(settings)
        await init_app_state(llm, app.state, args, SUPPORTED_TASKS)
        drop_routes_the_model_cannot_serve(app)
        serving = build_serving(llm, settings, edge)
        serving.install(app.state)
        service = serving.sessions
        try:
            await service.start()
        except ReplicaConflict as conflict:
            logger.error("cannot start beside the other replicas: %s", conflict)  # one line that names the fix
            raise
        watchdog = asyncio.create_task(_exit_when_the_engine_dies(app, llm)) if owns_engine else None
        try:
            async with vllm_lifespan(app):
                yield
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await service.stop()
            if owns_engine:
                await flush_disk_tier(llm)  # the sessions just parked, on disk for the next server
                shutdown_engine(llm)

    app.router.lifespan_context = lifespan
    drop_unserved_routes(app)
    metrics_read_only(app)
    # Our routes first: Starlette's router and vLLM's metrics instrumentator each walk
    # the routes in order, matching every path pattern before ours otherwise. No path
    # of ours is one of vLLM's (tests/unit/test_settings_and_models.py checks).
    vllm_routes = list(app.router.routes)
    app.include_router(api_router)
    app.router.routes[:] = [route for route in app.router.routes if route not in vllm_routes] + vllm_routes
    install_error_handlers(app)
    patch_openapi(
        app,
        declare_error_codes,
        declare_filled_in_fields,
        lambda schema: declare_stored_response_rules(
            schema, settings.resolved_tool_call_parser() is not None, bool(app.state.online_renderer.use_harmony)
        ),
        lambda schema: declare_vllm_input_rules(schema, reasoning=bool(settings.reasoning_parser)),
        lambda schema: app.state.session_service.declare_bounds(schema),
        lambda schema: declare_model_limits(
            schema,
            app.state.session_service.vocab_size,
            app.state.session_service.max_model_len,
            app.state.online_renderer.model_config.max_logprobs,
        ),
        lambda schema: declare_server_features(schema, **renderer_features(app.state.online_renderer)),
    )
    # vLLM's build_app (its SageMaker bootstrap) prebuilds the middleware stack from
    # app.user_middleware; it is built again with ours once they are added.
    prebuilt, app.middleware_stack = app.middleware_stack, None
    # Added last runs first: Anthropic's error shape, keys, rate limits, body size,
    # cache salts and token counts, a dead engine, usage rewriting, then chunk appends
    # served without FastAPI's request machinery where FastAPI would take them as sent.
    if settings.http_direct_chunk_route:
        app.add_middleware(
            DirectRoute, prefix="/v1/sessions/", suffix="/chunks", model=ChunkRequest, handler=rest.direct_chunk_answer
        )
    app.add_middleware(UsageProvenanceMiddleware)
    app.add_middleware(EngineDeadMiddleware)
    body_routes = openai_body_routes(
        app,
        strict=settings.openai_strict_validation,
        generating=edge.salter is not None or edge.limits.counts_tokens,
    )
    drop_replaced_routes(app)
    if body_routes:
        app.add_middleware(
            OpenAIRequestMiddleware,
            routes=body_routes,
            salter=edge.salter,
            limits=edge.limits if edge.limits.counts_tokens else None,
            default_max_tokens=settings.max_chunk_output_tokens,
        )
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    app.add_middleware(RateLimitMiddleware, limits=edge.limits)
    if settings.replica_name:
        app.add_middleware(ReplicaHeaderMiddleware, replica_name=settings.replica_name)
    app.add_middleware(
        APIKeyMiddleware,
        keys=[key.get_secret_value() for key in settings.api_keys],
        guard_metrics=settings.guard_metrics,
    )
    app.add_middleware(AnthropicErrorMiddleware)
    if settings.log_format == "json":
        app.add_middleware(log_context.RequestContextMiddleware)  # first: every record of the request
    if settings.otlp_traces_endpoint:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        # A server span a request (its traceparent honoured), outermost; the tracer provider
        # is vLLM's, set when the engine starts (the instrumentation's tracer defers to it).
        FastAPIInstrumentor.instrument_app(app, excluded_urls="health,ready,metrics")
    rebuild_middleware_stack(app, prebuilt)
    return app


async def _exit_when_the_engine_dies(app: FastAPI, engine: Any) -> None:
    """A dead engine does not come back: answer 503 engine_dead meanwhile (see
    EngineDeadMiddleware), then shut down and exit non-zero, so that compose's
    restart policy or any supervisor starts the server again. Durable sessions
    are in the store and go on after the restart."""
    while not engine.errored:  # noqa: ASYNC110 (the engine offers no event to wait on)
        await asyncio.sleep(ENGINE_CHECK_S)
    delay = app.state.settings.engine_dead_exit_delay_s
    logger.error("the engine has died; exiting with status %d in %.0f s, to be restarted", ENGINE_DEAD_EXIT, delay)
    server = getattr(app.state, "uvicorn_server", None)
    await asyncio.sleep(delay)
    if isinstance(server, AppServer):
        server.exit_status = ENGINE_DEAD_EXIT
        server.should_exit = True  # uvicorn's graceful shutdown; cli() then exits with the status
    else:
        os.kill(os.getpid(), signal.SIGTERM)  # served some other way: ask for a stop


def uvicorn_config(app: FastAPI, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """How the app is served: its websocket message limit is uvicorn's (1009 over it).
    The lifespan is required ("on"): under uvicorn's "auto" an exception the app raises
    outside Starlette's own lifespan handling reads as "lifespan unsupported", and the
    server would answer with no engine behind it (seen once here, not reproduced)."""
    options: dict[str, Any] = {
        "lifespan": "on",
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "ws": "websockets-sansio",
        "ws_max_size": settings.ws_max_message_bytes,
        "ws_per_message_deflate": settings.ws_per_message_deflate,
        "http": CoalescingHttpToolsProtocol if settings.http_coalesce_writes else "auto",
        # After the drain, requests still open (vLLM's own) get as long again.
        "timeout_graceful_shutdown": settings.drain_timeout_s,
        # JSON logs: uvicorn's loggers are configured with the others (app.http.log_context).
        **({"log_config": None} if settings.log_format == "json" else {}),
        **overrides,
    }
    return uvicorn.Config(app, **options)


class AppServer(uvicorn.Server):
    """uvicorn's server, with the status the process exits with once it stops, and a
    drain before uvicorn's own shutdown: on the first SIGTERM (or SIGINT) the server
    keeps listening while ``/ready`` answers 503 and new work is refused, so a proxy
    moves its conversations elsewhere without a refused connection; chunks in flight
    finish (``drain_timeout_s``); then uvicorn stops: it closes the listener and every
    websocket (1012, "service restart": reconnect), and the lifespan parks every
    session. A second signal skips what is left of the drain."""

    exit_status = 0
    _drain: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if sockets and self.started:
            self._log_started_message(sockets)  # uvicorn says where only on a socket of its own

    def handle_exit(self, sig: int, frame: Any) -> None:
        app = self.config.app
        state = app.state if isinstance(app, FastAPI) else None
        service = getattr(state, "session_service", None)
        if self._drain is not None or self.should_exit or service is None:
            super().handle_exit(sig, frame)
            return
        # In a signal handler: the drain starts on the loop, at its next turn.
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self._start_drain, service, state.settings)  # type: ignore[union-attr]

    def _start_drain(self, service: SessionService, settings: Settings) -> None:
        if self._drain is None and not self.should_exit:
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit(service, settings))

    async def _drain_then_exit(self, service: SessionService, settings: Settings) -> None:
        timeout_s = settings.drain_timeout_s
        logger.warning(
            "draining: /ready answers 503, new work is refused in %.1f s; chunks in flight have %.0f s",
            settings.drain_notice_s,
            timeout_s,
        )
        if not await service.drain(timeout_s, settings.drain_notice_s):
            logger.warning("drain: chunks still running after %.0f s are undone", timeout_s)
        self.should_exit = True


# The exit status when the model or the engine cannot be had (a one-line reason on stderr).
MODEL_UNAVAILABLE_EXIT = 2
# The exit status when the start failed after the engine was built (uvicorn's own).
STARTUP_FAILED_EXIT = 4
# The exit status when the server's address cannot be bound (a port in use).
PORT_UNAVAILABLE_EXIT = 5


def bound_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound as uvicorn binds it and not yet listening: connections
    are refused until uvicorn listens on it, once the engine has started."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def cli(argv: list[str] | None = None) -> None:
    settings = load_settings(sys.argv[1:] if argv is None else argv)
    log_context.configure(settings.log_format, settings.log_level, settings.resolved_state_dir(), settings.replica_name)
    # Models are local directories: nothing is looked up on a hub, at start or later.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # vLLM's caches (torch.compile's among them) beside the sessions: a volume that keeps
    # the state keeps them, so a compiled engine's next start can load what the first made.
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(settings.resolved_state_dir(), "vllm-cache"))
    try:
        # The port first, held from here on: a busy one fails now, not after the engine's start.
        listener = bound_socket(settings.host, settings.port)
    except OSError as error:
        print(
            f"streamsess-server: cannot listen on {settings.host}:{settings.port}: {error.strerror or error} "
            "(another server there? set --port or STREAMSESS_PORT)",
            file=sys.stderr,
        )
        sys.exit(PORT_UNAVAILABLE_EXIT)
    try:
        app = create_app(settings)
        kv_transfer_config(settings)  # the connector's vLLM surface, before the engine starts
    except (ModelUnavailable, EngineConfigError) as error:
        # One line that names the cause and the fix, not a traceback from deep inside.
        what = "load the model" if isinstance(error, ModelUnavailable) else "start the engine"
        print(f"streamsess-server: cannot {what}: {error}", file=sys.stderr)
        sys.exit(MODEL_UNAVAILABLE_EXIT)
    app.state.uvicorn_server = server = AppServer(uvicorn_config(app, settings))
    server.run(sockets=[listener])
    # A start that failed (the lifespan raised: a replica conflict, the store) is not a clean stop.
    sys.exit(server.exit_status if server.started else STARTUP_FAILED_EXIT)


if __name__ == "__main__":
    cli()
