"""Traces (``otlp_traces_endpoint``), from one real server process to an OTLP/HTTP receiver
in this test. A session chunk sent with a ``traceparent`` is one trace: the route's server
span, the chunk's admission and run (with what the engine did: prompt tokens by source),
and its commit. A chat completion on vLLM's route is one trace with vLLM's own engine span
(``llm_request``), and so is each chunk, the first on a new engine request and the next
on the live one: vLLM 0.32 makes no engine span for a streaming-input request's chunk,
connectors/streaming_stats.py makes it, under the chunk's own context (vLLM keeps the
first chunk's for the whole request).
Oracle: the spans the server exported, decoded with OpenTelemetry's own protobuf types."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.harness.servers import app_server, free_port

pytestmark = pytest.mark.server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
NEXT_TRACE_ID = "6bf92f3577b34da6a3ce929d0e0e4738"  # the session's second chunk


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """An OTLP/HTTP (protobuf) trace receiver on loopback: its URL and the spans received."""
    spans: list[dict[str, Any]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            request = ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        spans.append(
                            {
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(),
                                "scope": scope.scope.name,
                                "attributes": {a.key: a.value for a in span.attributes},
                            }
                        )
            body = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", spans
    finally:
        server.shutdown()


def test_chunks_and_engine_requests_are_traced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export within a fraction of a second
    chat_trace = "5bf92f3577b34da6a3ce929d0e0e4737"
    with otlp_receiver() as (endpoint, spans):
        with app_server("traces", tmp_path / "server.log", {"otlp_traces_endpoint": endpoint}) as server:
            with httpx.Client(base_url=server.base_url, timeout=120) as http:
                session = http.post("/v1/sessions", json={"defaults": {"max_tokens": 2}}).json()["id"]
                answer = http.post(
                    f"/v1/sessions/{session}/chunks",
                    json={"input": "hello there"},
                    headers={"traceparent": TRACEPARENT},
                )
                assert answer.status_code == 200, answer.text
                following = http.post(
                    f"/v1/sessions/{session}/chunks",
                    json={"input": " and more"},
                    headers={"traceparent": f"00-{NEXT_TRACE_ID}-00f067aa0ba902b9-01"},
                )
                assert following.status_code == 200, following.text
                model = http.get("/v1/models").json()["data"][0]["id"]
                chat = http.post(
                    "/v1/chat/completions",
                    headers={"traceparent": f"00-{chat_trace}-00f067aa0ba902b8-01"},
                    json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                )
                assert chat.status_code == 200, chat.text
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(
                any(s["name"] == "llm_request" and s["trace_id"] == trace for s in spans)
                for trace in (chat_trace, TRACE_ID, NEXT_TRACE_ID)
            ):
                time.sleep(0.2)
        ours = {span["span_id"]: span for span in spans if span["trace_id"] == TRACE_ID}
        by_name = {span["name"]: span for span in ours.values()}
        assert {"streamsess.chunk.admission", "streamsess.chunk", "streamsess.chunk.commit"} <= set(by_name), sorted(
            (s["name"], s["trace_id"]) for s in spans
        )
        route = by_name["streamsess.chunk"]["parent"]
        assert ours[route]["scope"].startswith("opentelemetry.instrumentation")  # the route's server span
        assert ours[route]["parent"] == TRACEPARENT.split("-")[2]  # the client's span
        assert by_name["streamsess.chunk.admission"]["parent"] == route
        assert by_name["streamsess.chunk.commit"]["parent"] == by_name["streamsess.chunk"]["span_id"]
        chunk = by_name["streamsess.chunk"]["attributes"]
        assert chunk["streamsess.session_id"].string_value == session
        assert (
            chunk["streamsess.prompt_tokens.computed"].int_value
            == answer.json()["usage"]["prompt_tokens_details"]["computed_tokens"]
        )
        chat_spans = {span["name"] for span in spans if span["trace_id"] == chat_trace}
        assert "llm_request" in chat_spans and "POST /v1/chat/completions" in chat_spans, chat_spans
        for trace, usage in ((TRACE_ID, answer.json()["usage"]), (NEXT_TRACE_ID, following.json()["usage"])):
            spans_of_chunk = {span["name"]: span for span in spans if span["trace_id"] == trace}
            assert "llm_request" in spans_of_chunk, (trace, sorted(spans_of_chunk))
            (engine,) = [span for span in spans if span["trace_id"] == trace and span["name"] == "llm_request"]
            assert engine["parent"] == spans_of_chunk["streamsess.chunk"]["span_id"]  # vLLM's span in the chunk's
            assert engine["attributes"]["gen_ai.usage.completion_tokens"].int_value == usage["completion_tokens"]
