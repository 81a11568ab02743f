"""Wire models of the session API: REST bodies, SSE events and websocket events.

Clients import this module too (``clients/``), so it depends on pydantic only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# -- sampling ----------------------------------------------------------------------


# Client input is taken as the schema states it: no unknown fields, and no
# coercion ("1" is not an integer, 0 is not a boolean), so the published OpenAPI
# schema is exactly what the server accepts.
STRICT = ConfigDict(extra="forbid", strict=True)
# A JSON-safe integer (JavaScript's Number.MAX_SAFE_INTEGER): every one is exact in
# double precision, so a client or a schema validator comparing in doubles (as
# schemathesis's does) agrees with the server at the bounds. vLLM takes 64 bits.
SAFE_INTEGER_MAX = 2**53 - 1
Integer = Annotated[int, Field(ge=-SAFE_INTEGER_MAX, le=SAFE_INTEGER_MAX)]
# vLLM holds token ids as 32-bit integers; a chunk's are bounded by the vocabulary.
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
# Sampling bounds (OpenAI's where it states them), shared by every API that samples on a
# session, so each refuses out-of-range values alike and its schema says so.
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
MIN_TOP_P = 1e-6  # as MIN_REPETITION_PENALTY, far above what float32 holds as 0
TopP = Annotated[float, Field(ge=MIN_TOP_P, le=1.0)]
TopK = Annotated[int, Field(ge=-1, le=SAFE_INTEGER_MAX)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# Above 0 as vLLM asks, and far from its float32 underflow: 5e-324 became 0, the logits
# were divided by it, and a constrained reply died in vLLM's grammar check (a 500).
MIN_REPETITION_PENALTY = 1e-6  # every route's (app.vllm_routes.sampling.check_sampling)
# ... and below float32's overflow, for the same reason: 1.4e308 became inf (a 500).
MAX_REPETITION_PENALTY = 1e6
RepetitionPenalty = Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=2.0)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=64)]


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [_integral(item) for item in value] if isinstance(value, list) else value


class SamplingOptions(BaseModel):
    """Sampling settings for one chunk; unset fields fall back to the session defaults.

    vLLM's streaming input allows one sequence per chunk and no stop strings, so
    ``n`` and ``stop`` are absent on purpose.
    """

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        """JSON Schema's integers include 35148.0, which strict mode refuses: take it as
        35148 (a float field takes an integer as it is)."""
        return {key: _integral(value) for key, value in data.items()} if isinstance(data, dict) else data

    max_tokens: Integer | None = Field(default=None, ge=1, description="Tokens to generate after this chunk.")
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Integer | None = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds | None = None


SAMPLING_FIELDS = tuple(SamplingOptions.model_fields)


class SessionDefaults(SamplingOptions):
    """Per-session defaults, applied to every chunk that leaves a field unset."""


Metadata = Annotated[dict[str, str], Field(max_length=16)]
class ChatMessage(BaseModel):
    """One chat message of a chunk; the session renders it with the model's chat template."""

    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: str


ChunkInput = Annotated[
    Annotated[str, Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[ChatMessage], Field(min_length=1)],
    Field(description="The chunk: text, token ids (each below the model's vocabulary size), or chat messages "
                      "(rendered with the model's chat template as the next turn of the session's conversation, "
                      "after the close of its previous reply, with the assistant prefix)."),
]
# A client-chosen session id (the X-Session-ID header).
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"

# -- usage ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """Where the prompt tokens' KV came from. ``cached_tokens`` is what the OpenAI
    API calls it; the other four split the prompt exactly."""

    cached_tokens: int = Field(description="device_tokens + cpu_tier_tokens + disk_tier_tokens")
    device_tokens: int = Field(description="Already on the device: the session's own context, or prefix-cache hits.")
    cpu_tier_tokens: int = Field(description="Loaded from the CPU tier (host memory).")
    disk_tier_tokens: int = Field(default=0, description="Loaded from the disk tier (files that outlive a restart).")
    computed_tokens: int = Field(description="Computed for this request.")


class ChunkUsage(BaseModel):
    prompt_tokens: int = Field(description="Context before the chunk plus the chunk itself.")
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# -- REST --------------------------------------------------------------------------------

# active: open, its KV on the device (or no chunk yet); generating: answering a chunk;
# parked: no engine request, its KV in the CPU tier (resumed by its next chunk).
SessionStatus = Literal["active", "generating", "parked", "closed"]


class SessionCreateRequest(BaseModel):
    model_config = STRICT

    model: str | None = Field(default=None, description="Must name the served model when given.")
    defaults: SessionDefaults = Field(default_factory=SessionDefaults)
    metadata: Metadata = Field(default_factory=dict)


class SessionObject(BaseModel):
    id: str
    object: Literal["session"] = "session"
    model: str
    created: int
    status: SessionStatus
    close_reason: str | None = None
    defaults: SessionDefaults
    metadata: dict[str, str]
    num_chunks: int
    num_tokens: int = Field(description="Tokens in the context the engine holds.")
    max_tokens: int = Field(description="Longest context this session may reach.")
    last_activity_at: float
    expires_at: float | None = Field(description="When an idle session is closed; None once closed.")


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionObject]


class SessionDeleted(BaseModel):
    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool = True


GENERATE = Field(default=True, description="False: append the chunk without an answer (it is computed now, "
                 "and the next chunk's answer reads it); the answer has no output. Chat messages are then rendered "
                 "without the assistant prefix, which the next chunk of messages adds.")


class ChunkRequest(SamplingOptions):
    input: ChunkInput
    stream: bool = False
    generate: bool = GENERATE


class ChunkOutput(BaseModel):
    text: str
    token_ids: list[int]


class ChunkResponse(BaseModel):
    id: str
    object: Literal["session.chunk"] = "session.chunk"
    session_id: str
    index: int
    output: ChunkOutput
    finish_reason: str | None
    usage: ChunkUsage


class ChunkDeltaEvent(BaseModel):
    """One SSE ``data:`` event of a streamed chunk."""

    id: str
    object: Literal["session.chunk.delta"] = "session.chunk.delta"
    session_id: str
    index: int
    delta: ChunkOutput


class ChunkDoneEvent(BaseModel):
    """The last SSE event of a streamed chunk, before ``[DONE]``."""

    id: str
    object: Literal["session.chunk.done"] = "session.chunk.done"
    session_id: str
    index: int
    finish_reason: str | None
    usage: ChunkUsage


class TranscriptResponse(BaseModel):
    object: Literal["session.transcript"] = "session.transcript"
    session_id: str
    token_ids: list[int]
    text: str
    num_tokens: int


class ResetCacheResponse(BaseModel):
    object: Literal["cache.reset"] = "cache.reset"
    device_cache_reset: bool
    cpu_tier_kept: bool = True


# -- websocket: client events ---------------------------------------------------------------


class _ClientEvent(BaseModel):
    model_config = STRICT

    event_id: str | None = Field(default=None, description="Echoed in errors about this event.")


class SessionUpdateEvent(_ClientEvent):
    type: Literal["session.update"]
    session: SessionDefaults


class InputAppendEvent(_ClientEvent, SamplingOptions):
    type: Literal["input.append"]
    input: ChunkInput
    generate: bool = GENERATE


class SessionCloseEvent(_ClientEvent):
    type: Literal["session.close"]


ClientEvent = Annotated[
    SessionUpdateEvent | InputAppendEvent | SessionCloseEvent, Field(discriminator="type")
]

# -- websocket: server events ---------------------------------------------------------------


class _ServerEvent(BaseModel):
    event_id: str


class SessionCreatedEvent(_ServerEvent):
    type: Literal["session.created"] = "session.created"
    session: SessionObject


class SessionUpdatedEvent(_ServerEvent):
    type: Literal["session.updated"] = "session.updated"
    session: SessionObject


class ResponseOutputDeltaEvent(_ServerEvent):
    type: Literal["response.output.delta"] = "response.output.delta"
    chunk_index: int
    delta: ChunkOutput


class ResponseDoneEvent(_ServerEvent):
    type: Literal["response.done"] = "response.done"
    chunk_index: int
    finish_reason: str | None
    output: ChunkOutput
    usage: ChunkUsage


class SessionClosedEvent(_ServerEvent):
    type: Literal["session.closed"] = "session.closed"
    reason: str


class ErrorDetail(BaseModel):
    type: str
    code: str | None
    message: str
    param: str | None = None
    event_id: str | None = Field(default=None, description="The client event this error is about.")


class ErrorEvent(_ServerEvent):
    type: Literal["error"] = "error"
    error: ErrorDetail


ServerEvent = (
    SessionCreatedEvent
    | SessionUpdatedEvent
    | ResponseOutputDeltaEvent
    | ResponseDoneEvent
    | SessionClosedEvent
    | ErrorEvent
)


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
