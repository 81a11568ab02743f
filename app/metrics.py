"""Our Prometheus metrics, registered beside vLLM's in the default registry."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram


class SessionMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.sessions_open = Gauge(
            "streamsess_sessions_open", "Streaming sessions open now.", registry=registry
        )
        self.sessions_total = Counter(
            "streamsess_sessions_created", "Streaming sessions created.", registry=registry
        )
        self.sessions_closed = Counter(
            "streamsess_sessions_closed",
            "Streaming sessions closed, by reason.",
            ["reason"],
            registry=registry,
        )
        self.chunks_total = Counter(
            "streamsess_chunks", "Input chunks answered, by transport.", ["transport"], registry=registry
        )
        self.chunk_errors = Counter(
            "streamsess_chunk_errors", "Input chunks rejected or failed, by code.", ["code"], registry=registry
        )
        self.chunk_ttft = Histogram(
            "streamsess_chunk_time_to_first_token_seconds",
            "Time from a chunk's arrival to its first output token.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "streamsess_chunk_prompt_tokens",
            "Prompt tokens of session chunks, by where their KV came from.",
            ["source"],
            registry=registry,
        )


_metrics: SessionMetrics | None = None


def session_metrics() -> SessionMetrics:
    """Process-wide metrics: prometheus_client refuses to register a name twice."""
    global _metrics
    if _metrics is None:
        _metrics = SessionMetrics()
    return _metrics
