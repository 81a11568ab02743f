"""Our Prometheus metrics, registered beside vLLM's in the default registry, and the
engine scheduler's own counts as its stat loggers report them."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram


class SessionMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.sessions_open = Gauge("streamsess_sessions_open", "Streaming sessions open now.", registry=registry)
        self.sessions_parked = Gauge(
            "streamsess_sessions_parked",
            "Open sessions parked: no engine request, KV in the CPU tier.",
            registry=registry,
        )
        self.sessions_with_engine_request = Gauge(
            "streamsess_sessions_active",
            "Open sessions with a live engine request (KV on the device).",
            registry=registry,
        )
        self.session_parks = Counter(
            "streamsess_session_parks",
            "Sessions parked, by reason: idle, admission (a chunk needed room), capacity (another "
            "request needed room), stalled (vLLM had requests waiting and none running), requested.",
            ["reason"],
            registry=registry,
        )
        self.session_resumes = Counter(
            "streamsess_session_resumes",
            "Parked sessions resumed, by where most of their prefix came from: disk_tier, cpu_tier, device, recompute.",
            ["source"],
            registry=registry,
        )
        self.resume_ttft = Histogram(
            "streamsess_resume_time_to_first_token_seconds",
            "Time to first token of a parked session's next chunk, by the source of its prefix.",
            ["source"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.sessions_total = Counter("streamsess_sessions_created", "Streaming sessions created.", registry=registry)
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
        self.store_seconds = Histogram(
            "streamsess_store_transaction_seconds",
            "Session-store transactions, from the wait for a connection (and SQLite's one writer) to "
            "the commit, by kind: write (synced), lease (a lease write, not synced), read.",
            ["kind"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=registry,
        )
        # Bound once: a chunk counts into all four, and labels() is a lookup under a lock.
        self._prompt_tokens_from = {
            source: self.prompt_tokens.labels(source) for source in ("device", "cpu_tier", "disk_tier", "computed")
        }

    def observe_chunk(self, result: Any, transport: str) -> None:
        """A committed chunk (a ``ChunkResult``): its count, first-token time, resume source
        and where its prompt came from."""
        self.chunks_total.labels(transport).inc()
        if result.time_to_first_token is not None:
            self.chunk_ttft.observe(result.time_to_first_token)
        details = result.usage.prompt_tokens_details
        if result.resumed_from is not None:
            self.session_resumes.labels(result.resumed_from).inc()
            if result.time_to_first_token is not None:
                self.resume_ttft.labels(result.resumed_from).observe(result.time_to_first_token)
        for source, counter in self._prompt_tokens_from.items():
            counter.inc(getattr(details, f"{source}_tokens"))


_metrics: SessionMetrics | None = None


def session_metrics() -> SessionMetrics:
    """Process-wide metrics: prometheus_client refuses to register a name twice."""
    global _metrics
    if _metrics is None:
        _metrics = SessionMetrics()
    return _metrics


class SchedulerObserver:
    """The engine scheduler's own view, as its stat loggers see it each step.

    The admission estimate (``app.sessions.admission``) can be wrong (a request may hold
    more than it counts); this is the ground truth the service checks as a backstop: requests waiting to be
    scheduled while none runs means the device is held by requests that are not
    running, idle sessions among them, and nothing will free it by itself.
    """

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.updates = 0

    def logger_factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        """A vLLM ``StatLoggerFactory`` (pass it in ``AsyncLLM``'s ``stat_loggers``)."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        observer = self

        class _SchedulerStatsLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                if scheduler_stats is not None:
                    observer.num_running = int(scheduler_stats.num_running_reqs)
                    observer.num_waiting = int(scheduler_stats.num_waiting_reqs)
                    observer.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
                    observer.updates += 1

            def log_engine_initialized(self) -> None:
                pass

        return _SchedulerStatsLogger(vllm_config, engine_index)

    @property
    def stalled(self) -> bool:
        """Requests wait to be scheduled and none runs."""
        return self.num_waiting > 0 and self.num_running == 0
