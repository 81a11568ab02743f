"""A vLLM general plugin: each chunk of a streaming-input request is counted and traced as
vLLM counts and traces a request.

vLLM 0.32 records a request's statistics once: its prompt tokens when its first output
arrives (the scheduler's ``PrefillStats``, taken then and never made again) and the rest
when it finishes. A streaming-input request's chunk ends without finishing the request
(``OutputProcessor.process_outputs`` takes its ``streaming_input`` branch, which neither
records nor traces). So after the first chunk of a session, ``vllm:prompt_tokens_total``
counts none of the prompt tokens its chunks compute, no chunk reaches the request
histograms (e2e, queue, prefill, decode, prompt and generation lengths, successes), and
no chunk gets an ``llm_request`` span.

The plugin mends both halves, in the process each runs in:
- the engine core's scheduler: a chunk resumed on a live request gets a ``PrefillStats``
  of its own, its new tokens all computed (the context before it is the request's own,
  counted by the chunks that computed it);
- the front end's output processor: the end of a chunk is recorded as a finished request
  (one request per chunk in vLLM's request metrics), traced as one when tracing is on,
  under the trace context its sender registered (``register_chunk_trace``; vLLM carries
  one context per request, the first chunk's), and the request's timing starts afresh
  for the next chunk.

Guarded: where vLLM's code differs, or already makes a chunk's statistics, it does
nothing and says so.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)
PLUGIN_NAME = "streamsess_streaming_stats"

# Request id -> the trace context of its current chunk (W3C headers), set by the chunk's
# sender in the front end's process; read when the chunk's span is made.
_chunk_trace_headers: dict[str, Mapping[str, str]] = {}


def register_chunk_trace(request_id: str, headers: Mapping[str, str] | None) -> None:
    """The trace context of the chunk the request computes next (none: forget it)."""
    if headers:
        _chunk_trace_headers[request_id] = dict(headers)
    else:
        _chunk_trace_headers.pop(request_id, None)


@cache
def register() -> str:
    """The plugin entry point: runs once per process, returns what it did."""
    done = [_count_resumed_chunks(), _record_chunk_ends()]
    logger.debug("%s: %s (pid %d)", PLUGIN_NAME, "; ".join(done), os.getpid())
    return "; ".join(done)


def _count_resumed_chunks() -> str:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.stats import PrefillStats

    update_session = getattr(Scheduler, "_update_request_as_session", None)
    if update_session is None or not callable(getattr(PrefillStats, "set", None)):
        return _nothing_done("the scheduler's streaming-input update is not the one this plugin mends")

    def update_request_as_session(self: Any, session: Any, update: Any) -> None:
        update_session(self, session, update)
        if getattr(session, "prefill_stats", ()) is None:  # taken by the chunk before; vLLM makes none
            stats = PrefillStats()
            # The chunk computes what follows the request's computed context.
            stats.set(
                num_prompt_tokens=session.num_tokens - session.num_computed_tokens,
                num_local_cached_tokens=0,
                num_external_cached_tokens=0,
            )
            session.prefill_stats = stats

    Scheduler._update_request_as_session = update_request_as_session  # type: ignore[method-assign]
    return "a resumed chunk's prompt tokens are counted"


def _record_chunk_ends() -> str:
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import RequestStateStats

    update_stats = getattr(OutputProcessor, "_update_stats_from_output", None)
    needed = ("_update_stats_from_finished", "do_tracing")
    if update_stats is None or not all(callable(getattr(OutputProcessor, name, None)) for name in needed):
        return _nothing_done("the output processor is not the one this plugin mends")
    if list(inspect.signature(update_stats).parameters) != [
        "self",
        "req_state",
        "engine_core_output",
        "engine_core_timestamp",
        "iteration_stats",
    ]:
        return _nothing_done("the output processor's statistics take other arguments")

    def update_stats_from_output(
        self: Any, req_state: Any, engine_core_output: Any, engine_core_timestamp: float | None, iteration_stats: Any
    ) -> None:
        update_stats(self, req_state, engine_core_output, engine_core_timestamp, iteration_stats)
        finish_reason = engine_core_output.finish_reason
        if iteration_stats is None or finish_reason is None or not req_state.streaming_input:
            return  # not a chunk's end (a request's own end is recorded by vLLM)
        if not req_state.stats.arrival_time:
            return  # no chunk under way: an idle request ended by the engine (an abort at shutdown)
        prefill = engine_core_output.prefill_stats
        if req_state.is_prefilling and prefill is not None:  # what vLLM sets just after this call
            req_state.num_cached_tokens = prefill.num_cached_tokens
        self._update_stats_from_finished(req_state, finish_reason, iteration_stats)
        if self.tracing_enabled:
            headers = _chunk_trace_headers.get(req_state.external_req_id)
            if headers is not None:
                engine_core_output.trace_headers = headers
            self.do_tracing(engine_core_output, req_state, iteration_stats)
        # The next chunk is timed from its own arrival (set when it is applied).
        req_state.stats = RequestStateStats()

    OutputProcessor._update_stats_from_output = update_stats_from_output  # type: ignore[method-assign]
    return "a chunk's end is recorded (and traced) as a finished request"


def _nothing_done(why: str) -> str:
    done = f"{why}: nothing done"
    logger.warning("%s: %s", PLUGIN_NAME, done)
    return done
