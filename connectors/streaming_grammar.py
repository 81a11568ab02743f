"""A vLLM general plugin: each chunk of a streaming-input request gets its own structured
output grammar (or none).

vLLM 0.32 builds a request's grammar once, from its first chunk. A later chunk's
sampling parameters replace the earlier ones (``Scheduler._update_request_as_session``)
but its grammar is dropped: the update's ``Request`` is built, and its grammar compiled,
by ``EngineCore.preprocess_add_request``, and then only its ids and sampling parameters
reach the session (``StreamingUpdate``). So a grammar set for a later chunk never
applies, and one set for the first chunk would apply to every chunk after it. A session
turn with ``tool_choice`` required (or a named function) needs its grammar for that
chunk only.

The plugin carries the update's grammar to the session with the update, and makes the
session wait for its compilation as a new request would
(``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``). It runs in every vLLM process (entry point
``vllm.general_plugins``); only the engine core's scheduler uses what it patches.
Guarded: where vLLM's code differs, it does nothing and says so. vLLM PR #57685 (open)
makes the same change upstream; once a release has it, this plugin goes.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)
PLUGIN_NAME = "streamsess_streaming_grammar"


@cache
def register() -> str:
    """The plugin entry point: runs once per process, returns what it did."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus, StreamingUpdate

    update_session = getattr(Scheduler, "_update_request_as_session", None)
    from_request = StreamingUpdate.__dict__.get("from_request")
    waiting_for_grammar = getattr(RequestStatus, "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", None)
    if update_session is None or not isinstance(from_request, classmethod) or waiting_for_grammar is None:
        done = "vLLM's streaming-input scheduler is not the one this plugin mends: nothing done"
        logger.warning("%s: %s", PLUGIN_NAME, done)
        return done
    original_from_request = from_request.__func__

    def update_from_request(cls: Any, request: Any) -> Any:
        update = original_from_request(cls, request)
        if update is not None:  # the chunk's own grammar, compiling since it arrived
            update.structured_output_request = request.structured_output_request
        return update

    def update_request_as_session(self: Any, session: Any, update: Any) -> None:
        update_session(self, session, update)
        grammar = getattr(update, "structured_output_request", None)
        session.structured_output_request = grammar
        if grammar is not None:
            session.status = waiting_for_grammar  # scheduled once compiled, as a new request is

    StreamingUpdate.from_request = classmethod(update_from_request)  # type: ignore[method-assign,assignment]
    Scheduler._update_request_as_session = update_request_as_session  # type: ignore[method-assign]
    done = "each streaming-input chunk gets its own structured output grammar"
    logger.debug("%s: %s (pid %d)", PLUGIN_NAME, done, os.getpid())
    return done
