"""Every error a session operation answers, one constructor each, in the OpenAI shape;
and the two a session raises to the service."""

from __future__ import annotations

from vllm.exceptions import VLLMClientError, VLLMServerError

from app.errors import APIError

# The close reason of a session its client deleted: it is then "not found", as
# OpenAI's deleted objects are.
DELETED = "deleted"
# The close reason of a session idle for longer than session_idle_timeout_s.
EXPIRED = "expired"


def session_closed(session_id: str, reason: str | None) -> APIError:
    return APIError(
        409,
        f"Session {session_id} is closed ({reason}); open a new session.",
        code="session_closed",
        param="session_id",
    )


def closed_while_answering(reason: str | None) -> APIError:
    return APIError(409, f"The session was closed ({reason}) while answering this chunk.", code="session_closed")


def chunk_in_flight() -> APIError:
    return APIError(
        409,
        "This session is already answering a chunk; send the next one when it is done.",
        code="chunk_in_flight",
    )


def chunk_undone() -> APIError:
    return APIError(
        503,
        "This chunk was undone before it completed (the server is stopping); the session is as it "
        "was before it: send the chunk again.",
        code="chunk_undone",
        headers={"Retry-After": "1"},
    )


def server_draining() -> APIError:
    """New work on a server that is stopping: nothing was done, so a proxy (or the
    client) sends it again at once, and another replica takes the session up."""
    return APIError(
        503,
        "This server is draining for a restart and takes no new work; retry: another replica goes on with the session.",
        code="server_draining",
        headers={"Retry-After": "1"},
    )


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist.", code="model_not_found", param="model")


def session_exists(session_id: str) -> APIError:
    return APIError(
        409, f"A session with id {session_id!r} exists already.", code="session_exists", param="X-Session-ID"
    )


def chunk_refused(detail: object) -> APIError:
    return APIError(
        400,
        f"The engine refused this chunk: {detail}. The chunk was undone; the session is as it was before it.",
        code="invalid_request",
    )


def session_failed(detail: object) -> APIError:
    return APIError(500, f"The session failed and was closed: {detail}", code="session_failed")


def store_unavailable() -> APIError:
    return APIError(
        503,
        "The session store is unavailable; nothing was changed. Retry later.",
        code="store_unavailable",
        headers={"Retry-After": "1"},
    )


def chunk_not_kept() -> APIError:
    return APIError(
        503,
        "The session store is unavailable: this chunk was not kept, and the session is as "
        "it was before it. Retry later.",
        code="store_unavailable",
        headers={"Retry-After": "1"},
    )


def server_busy(retry_after_s: float) -> APIError:
    return APIError(
        503,
        "The engine has no room for this chunk now: every slot or KV block is held by "
        "requests in flight. The session is unchanged; retry later.",
        code="server_busy",
        headers={"Retry-After": str(max(1, round(retry_after_s)))},
    )


class SessionFailedError(RuntimeError):
    """The engine request behind a session ended or failed mid-chunk."""


class ChunkRefusedError(ValueError):
    """The engine refused the chunk's input or parameters before its first token. The
    chunk is undone and the session goes on; the engine itself is fine."""


def is_input_error(error: BaseException) -> bool:
    """What vLLM raises for a request it refuses: its client errors (a stop token out of
    the vocabulary), and the ValueError, TypeError or OverflowError of input processing
    (a seed beyond 64 bits). EngineDeadError and EngineGenerateError are the engine's."""
    return isinstance(error, (VLLMClientError, ValueError, TypeError, OverflowError)) and not isinstance(
        error, VLLMServerError
    )
