"""Every serving object, built once, in one place, from the settings and the engine.

Two stages, because the edge is assembled before the engine starts: ``EdgeParts`` (the
per-key limits and the one ``CacheSalter``, which the middleware and the sessions share)
comes from the settings alone, in ``create_app``; ``build_serving`` adds what needs the
engine (its tokenizer with the served chat template, the reply parsers, the scheduler
observer, the provenance recorder, the store), in the lifespan. Routers reach what is
built here through ``app.api.deps``; nothing else builds a service.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from app.api.conversations.serving import ConversationsService
from app.api.realtime.serving import RealtimeService
from app.api.responses.serving import ResponsesService
from app.cache_salt import CacheSalter, cache_salter
from app.engine import scheduler_observer
from app.limits import KeyLimits
from app.metrics import session_metrics
from app.provenance import ProvenanceRecorder
from app.sessions.service import SessionService
from app.settings import Settings
from app.store import SessionStore, open_store
from app.tools.parsing import ReplyParsers


@dataclass(frozen=True)
class EdgeParts:
    """What the edge's middleware and the services share, known before the engine is."""

    limits: KeyLimits
    salter: CacheSalter | None  # None where keys share one cache namespace

    @classmethod
    def from_settings(cls, settings: Settings) -> EdgeParts:
        return cls(KeyLimits(settings), cache_salter(settings))


@dataclass(frozen=True)
class Serving:
    """The server's serving objects, one of each."""

    settings: Settings
    limits: KeyLimits
    recorder: ProvenanceRecorder
    sessions: SessionService
    responses: ResponsesService
    conversations: ConversationsService
    realtime: RealtimeService

    def install(self, state: Any) -> None:
        """Onto the app's state, where ``app.api.deps`` and the middleware read them."""
        state.settings = self.settings
        state.limits = self.limits
        state.provenance = self.recorder
        state.session_service = self.sessions
        state.responses_service = self.responses
        state.conversations_service = self.conversations
        state.realtime_service = self.realtime


def chat_tokenizer(engine: Any, settings: Settings) -> Any:
    """The engine's tokenizer with the chat template vLLM's routes render with
    (``--chat-template``); on a copy where one is set, the engine's being shared."""
    tokenizer = engine.get_tokenizer()
    if (chat_template := settings.resolved_chat_template()) is not None:
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = chat_template
    return tokenizer


def attached_recorder(engine: Any, settings: Settings) -> ProvenanceRecorder:
    """A provenance recorder attached to the engine: where each prompt's tokens came from."""
    recorder = ProvenanceRecorder(disk_tier=settings.disk_tier_gib > 0)
    recorder.attach(engine)
    return recorder


def session_service(
    engine: Any,
    settings: Settings,
    *,
    recorder: ProvenanceRecorder | None = None,
    store: SessionStore | None = None,
    edge: EdgeParts | None = None,
    tokenizer: Any | None = None,
) -> SessionService:
    """The session service as the server builds it: the served model's name, the chat
    tokenizer, the process-wide metrics, the store of the settings (or ``store``), a
    recorder attached to the engine (or ``recorder``, attached already), the edge's
    limits and salter (or the settings'), and the engine's scheduler observer."""
    edge = edge if edge is not None else EdgeParts.from_settings(settings)
    return SessionService(
        engine=engine,
        settings=settings,
        model_name=settings.resolved_served_model_name(),
        tokenizer=tokenizer if tokenizer is not None else chat_tokenizer(engine, settings),
        metrics=session_metrics(),
        recorder=recorder if recorder is not None else attached_recorder(engine, settings),
        store=store if store is not None else open_store(settings),
        salter=edge.salter,
        limits=edge.limits,
        observer=scheduler_observer(engine),
    )


def build_serving(engine: Any, settings: Settings, edge: EdgeParts) -> Serving:
    tokenizer = chat_tokenizer(engine, settings)
    parsers = ReplyParsers(
        tokenizer, settings.resolved_tool_call_parser(), settings.reasoning_parser, settings.tool_strict_level
    )
    recorder = attached_recorder(engine, settings)
    store = open_store(settings)
    sessions = session_service(engine, settings, recorder=recorder, store=store, edge=edge, tokenizer=tokenizer)
    responses = ResponsesService(sessions, store, tokenizer, parsers)
    return Serving(
        settings=settings,
        limits=edge.limits,
        recorder=recorder,
        sessions=sessions,
        responses=responses,
        conversations=ConversationsService(responses),
        realtime=RealtimeService(sessions, tokenizer, parsers),
    )
