"""A schemathesis extension (loaded by SCHEMATHESIS_HOOKS in test_schema_fuzz and
scripts/fuzz-schema): its ``positive_data_acceptance``, but for refusals of valid data
that no JSON Schema can prevent, each named here. Every other refusal still fails it.

- **Token limits.** A chunk's chat messages are bounded in number (``maxItems``), but
  each message's text may cost any number of tokens, so a schema-valid chunk can exceed
  ``max_chunk_tokens`` (a fresh seed found 17 messages of multi-byte text: 359 tokens
  against 256): 400 ``chunk_too_large``; and a chunk the session has no room left for
  (400 ``context_length_exceeded``: the run's own chunks filled it); on vLLM's routes, a
  prompt longer than the model's context.
- **Bounds set by the prompt.** vLLM's ``routed_experts_prompt_start`` must lie within
  the prompt's length, which the schema cannot know.
- **A name of an object that does not exist.** schemathesis accepts a 404 for a missing
  resource in the path; an id in the body or the query that names nothing is OpenAI's
  400 (``previous_response_not_found``; a tool output whose ``call_id`` no call in the
  conversation holds, ``tool_call_not_found``; a list's ``after`` cursor; a ``tool_choice``
  naming a function the request's ``tools`` do not hold; an Anthropic ``tool_removal``
  naming a tool the request does not declare).
- **Rules inside a string, or between fields.** A bad word must tokenize to a token
  (the tokenizer decides, not the text's length); a structured output's regex, grammar
  or structural tag must parse; Anthropic's ``thinking.budget_tokens`` must be below
  ``max_tokens``; exactly one structured-output constraint is set; ``allowed_token_ids``
  without a grammar; ``logprobs`` equal to the length of ``logprob_token_ids``, ``min_tokens``
  at most ``max_tokens``, a repetition pattern's least size at most its largest: JSON
  Schema states none of them (a chat request's
  continuing its last message without a generation prompt, once listed here, it does:
  the schema now requires ``add_generation_prompt: false`` with it).
- **Integers beyond a stated bound.** The schema states vLLM's 64-bit bounds exactly
  (``maximum: 9223372036854775807``); schemathesis's validator compares in doubles, where
  ``9223372036854775999`` equals that bound, and so takes as valid what the schema, read
  as JSON Schema specifies (numbers compared as numbers), forbids. A refusal naming the
  bound is accepted when the value is beyond it exactly.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import schemathesis
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

TOKEN_LIMIT_CODES = {"chunk_too_large", "context_length_exceeded"}
# The same, in an error shape without a code (vLLM's Anthropic routes).
TOKEN_LIMIT_MESSAGES = ("This model's maximum context length is",)
PROMPT_BOUND_PARAMS = {"routed_experts_prompt_start"}
MISSING_OBJECT_CODES = {"previous_response_not_found", "tool_call_not_found"}
# A tool_choice naming a function the request's tools do not hold (OpenAI's 400 too).
MISSING_TOOL = ("tool_choice", "not found")
MISSING_TOOL_MESSAGES = (
    "which is not declared in tools",
    "does not match any of the specified `tools`",
    "is not found in the tools list",
)
# A rule inside a string (a grammar that is not one: "Invalid JSON grammar specification"
# for a structured output's json given as a string), or between fields the schema cannot
# compare.
UNSTATABLE_MESSAGES = (
    "Invalid structured_outputs",
    "Invalid response_format",
    "must be less than max_tokens",
    "Invalid JSON grammar specification",
    "kind of structured outputs constraint",
    "one kind of constraints for structured outputs",
    "allowed_token_ids cannot be combined",
    "logprobs must equal len(logprob_token_ids)",
    "min_tokens must be less than or equal to max_tokens",
    "with min_pattern_size <= max_pattern_size",
    "must tokenize to at least one token",
)
MISSING_CURSOR_PARAMS = {"after"}
BOUND = re.compile(r"Input should be (less|greater) than or equal to (-?\d+)")


def beyond_stated_bound(message: str, param: str | None, body: Any) -> bool:
    """Whether the refusal names a bound that the value at ``param`` exceeds exactly."""
    bound = BOUND.search(message)
    if bound is None or param is None:
        return False
    value = body
    for key in param.split("."):
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            return False
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    limit = int(bound.group(2))
    return value > limit if bound.group(1) == "less" else value < limit


def refusal_no_schema_can_prevent(error: dict[str, Any], body: Any) -> bool:
    code, param = error.get("code"), error.get("param")
    return (
        code in TOKEN_LIMIT_CODES
        or code in MISSING_OBJECT_CODES
        or param in PROMPT_BOUND_PARAMS
        or (param in MISSING_CURSOR_PARAMS and code == "invalid_value")
        or (param == MISSING_TOOL[0] and MISSING_TOOL[1] in str(error.get("message", "")))
        or any(
            text in str(error.get("message", ""))
            for text in (*UNSTATABLE_MESSAGES, *MISSING_TOOL_MESSAGES, *TOKEN_LIMIT_MESSAGES)
        )
        or beyond_stated_bound(str(error.get("message", "")), param, body)
    )


@schemathesis.check
def positive_data_acceptance_but_unstatable(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code == 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            error = None
        if isinstance(error, dict) and refusal_no_schema_can_prevent(error, case.body):
            return None
    return positive_data_acceptance(ctx, response, case)


def body_fits_schema(case: Any) -> bool:
    """Whether the JSON body sent fits the operation's published body schema."""
    content = case.operation.definition.raw.get("requestBody", {}).get("content", {})
    body_schema = content.get("application/json", {}).get("schema")
    if body_schema is None or not isinstance(case.body, (dict, list, str, int, float, bool)):
        return False
    components = case.operation.schema.raw_schema.get("components", {})
    return jsonschema.Draft202012Validator({**body_schema, "components": components}).is_valid(case.body)


@schemathesis.check
def negative_data_rejection_of_what_was_sent(ctx: Any, response: Any, case: Any) -> bool | None:
    """schemathesis's negative_data_rejection, on the body as sent: it judges by how the
    case was generated, and its shrinker can leave a body the schema takes (schemathesis
    issue #4332). A fresh seed reported a conversation whose every item a JSON Schema
    validator takes, accepted with 200, as "schema-violating"."""
    meta = case.meta
    negative = (
        []
        if meta is None
        else [str(location.value) for location, component in meta.components.items() if component.mode.is_negative]
    )
    if negative == ["body"] and body_fits_schema(case):  # only the body was to be invalid, and is not
        return None
    return negative_data_rejection(ctx, response, case)
