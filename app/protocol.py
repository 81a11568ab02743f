"""The wire types every API of ours shares: sampling options and their bounds, chat
messages, a chunk's input and usage, a session as the APIs describe it.

A leaf (pydantic only, no other app module): the session domain, every API, vLLM's
hosted routes and the clients (``clients/``) import it.
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
    Field(
        description="The chunk: text, token ids (each below the model's vocabulary size), or chat messages "
        "(rendered with the model's chat template as the next turn of the session's conversation, "
        "after the close of its previous reply, with the assistant prefix)."
    ),
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
