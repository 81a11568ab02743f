"""Sampling values of vLLM's routes checked before vLLM reads them (by
app.http.middleware.OpenAIRequestMiddleware, beside the strict validation): values vLLM takes
and then fails on (a 500) or refuses later in words the schema cannot state; the
published schema states the same bounds (app.vllm_routes.schema)."""

from __future__ import annotations

from typing import Any

from vllm.exceptions import VLLMValidationError

from app.protocol import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, MIN_TOP_P, SAFE_INTEGER_MAX

# Sampling values vLLM takes but its float32 sampler holds as 0 or inf (a repetition_penalty
# of 5e-324 divided the logits by zero and killed a constrained reply in the grammar check:
# a 500 on /v1/completions and /v1/responses; 1.4e308, inf, the same on a batch; a top_p as
# small filters out every token), and integers it takes unbounded and then cannot send to
# its engine core beyond 64 bits (top_k, stream_interval: a 500 on chat, batch, completion
# and Anthropic); a beam search's length_penalty, its score's exponent over the length
# (beyond ±10 the power under- or overflows a double: a division by zero, a 500): (floor,
# ceiling or None) per field. Refused on every route, and stated in the schema (the
# integers' ceiling as our own routes bound theirs, JSON-safe).
SAMPLING_RANGES: dict[str, tuple[float, float | None]] = {
    "repetition_penalty": (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    "top_p": (MIN_TOP_P, None),
    "top_k": (-1, SAFE_INTEGER_MAX),
    "stream_interval": (1, SAFE_INTEGER_MAX),
    "length_penalty": (-10, 10),
}


GRAMMAR_FORMATS = {"json_object", "json_schema", "structural_tag"}
# Free-form fields vLLM passes to its engine core in a request's extra_args, over
# MessagePack, which holds integers in [-2**63, 2**64): vLLM refuses others ("extra_args
# integers must be between..."), and so do we, for any number, so that the schema's bound
# on them (a number's, as JSON Schema has no integer apart from an integral float) is the
# server's (app.vllm_routes.schema_rules.MESSAGEPACK_VALUE).
MESSAGEPACK_FIELDS = ("vllm_xargs", "kv_transfer_params", "ec_transfer_params")
MESSAGEPACK_RANGE = (-(2**63), 2**64 - 1)
# The free-form ones (vllm_xargs has vLLM's own typed model): their values nest at most
# this many arrays or objects deep (a connector's block ids, a list of lists, take two),
# so that the schema can state them without recursion (app.vllm_routes.schema_rules).
FREE_FORM_FIELDS = ("kv_transfer_params", "ec_transfer_params")
FREE_FORM_DEPTH = 2


def check_sampling(payload: dict[str, Any], max_model_len: int | None = None) -> None:
    """Sampling values refused before vLLM reads them: outside ``SAMPLING_RANGES`` (vLLM
    takes them and then fails, a 500); a chat request's max_tokens below 1 or beyond
    ``max_model_len`` (vLLM refuses it but beside max_completion_tokens, which the schema
    cannot state); and ``allowed_token_ids`` with a grammar (a structured output, a JSON
    response format, a required or named tool call), where the grammar may allow none of
    the ids and the engine samples a token it rejects (fresh-seed fuzzing found each)."""
    for field, (floor, ceiling) in SAMPLING_RANGES.items():
        value = payload.get(field)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if value < floor:
            raise VLLMValidationError(f"{field} must be at least {floor}, got {value}.", parameter=field, value=value)
        if ceiling is not None and value > ceiling:
            raise VLLMValidationError(f"{field} must be at most {ceiling}, got {value}.", parameter=field, value=value)
    for field in MESSAGEPACK_FIELDS:
        value = payload.get(field)
        if _outside_messagepack(value):
            raise VLLMValidationError(f"Numbers in {field} must be between -2**63 and 2**64 - 1.", parameter=field)
        if field in FREE_FORM_FIELDS and isinstance(value, dict) and _nesting(value) > FREE_FORM_DEPTH + 1:
            raise VLLMValidationError(
                f"The values of {field} may nest at most {FREE_FORM_DEPTH} arrays or objects deep.", parameter=field
            )
    # A chat request's deprecated max_tokens: vLLM refuses it below 1 or beyond the
    # model's length unless max_completion_tokens is set, a rule the chat schema has no
    # room left to state.
    max_tokens = payload.get("max_tokens")
    if "messages" in payload and isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        if max_tokens < 1:
            raise VLLMValidationError(
                f"max_tokens must be at least 1, got {max_tokens}.", parameter="max_tokens", value=max_tokens
            )
        if max_model_len is not None and max_tokens > max_model_len:
            raise VLLMValidationError(
                f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}.",
                parameter="max_tokens",
                value=max_tokens,
            )
    if payload.get("allowed_token_ids") == []:
        # vLLM refuses it too, but inside a streamed completion's 200 (an error event).
        raise VLLMValidationError("allowed_token_ids must not be empty.", parameter="allowed_token_ids")
    response_format = payload.get("response_format")
    grammar = (
        payload.get("structured_outputs") is not None
        or (isinstance(response_format, dict) and response_format.get("type") in GRAMMAR_FORMATS)
        or (
            bool(payload.get("tools"))
            and (payload.get("tool_choice") == "required" or isinstance(payload.get("tool_choice"), dict))
        )
    )
    if payload.get("allowed_token_ids") and grammar:
        raise VLLMValidationError(
            "allowed_token_ids cannot be combined with a structured output, a JSON response "
            "format or a forced tool call: the grammar may allow none of them.",
            parameter="allowed_token_ids",
        )


def _nesting(value: Any) -> int:
    """How many arrays and objects deep ``value`` nests (itself counted; a scalar: 0),
    walked without recursion."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in children)
    return deepest


def _outside_messagepack(value: Any) -> bool:
    """Whether a number anywhere in ``value`` is outside ``MESSAGEPACK_RANGE`` (a walk
    without recursion, as vLLM's: a body nests as deep as the JSON parser took it)."""
    low, high = MESSAGEPACK_RANGE
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, (int, float)) and not isinstance(item, bool) and not low <= item <= high:
            return True
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False
