"""The Python clients' retry policy: a chunk append (POST) is retried only when the
server says it did nothing (a draining replica's refusal), never after a failure that
may have applied it; the HTTP answers are real httpx responses."""

from __future__ import annotations

import httpx

from clients._common import error_code, should_retry


def answer(status: int, code: str | None) -> httpx.Response:
    body = {"error": {"message": "m", "type": "server_error", "param": None, "code": code}}
    return httpx.Response(status, json=body)


def test_a_post_refused_by_a_draining_replica_is_sent_again() -> None:
    for code in ("server_draining", "chunk_undone", "replica_unavailable", "store_unavailable"):
        assert should_retry("POST", None, 503, error_code(answer(503, code)))


def test_a_post_whose_fate_is_unknown_is_not() -> None:
    for status, code in (
        (503, "engine_dead"),
        (503, None),
        (502, None),
        (500, "internal_error"),
        (409, "chunk_in_flight"),
    ):
        assert not should_retry("POST", None, status, error_code(answer(status, code)))
    assert not should_retry("POST", httpx.ReadError("cut mid-answer"), None)
    # Reads are retried on any 503; a connection that never opened, for any method.
    assert should_retry("GET", None, 503, None)
    assert should_retry("POST", httpx.ConnectError("refused"), None)


def test_error_code_reads_only_the_openai_shape() -> None:
    assert error_code(httpx.Response(503, text="<html>busy</html>")) is None
    assert error_code(httpx.Response(200, json={"id": "x"})) is None
