"""What the published schema says of vLLM's routes beyond their body models: what vLLM
fills in, and the rules its handlers enforce, so that the schema states what the
server accepts, no more, no less (fresh-seed schemathesis runs found each rule below
as a schema-valid body refused, or a schema-invalid one accepted). Rules between fields
and over parts are in app.vllm_routes.schema_rules; what depends on this server (its model's
limits, what it was started with) is declared here too, once the engine is up."""

from __future__ import annotations

import copy
import typing
from typing import Any

import vllm.envs as vllm_envs
from fastapi import FastAPI
from vllm.sampling_params import MAX_LOGPROB_TOKEN_IDS

from app.vllm_routes.sampling import SAMPLING_RANGES
from app.vllm_routes.schema_rules import (
    ANTHROPIC_REQUESTS,
    ANTHROPIC_RULES,
    LOGPROB_COUNTS,
    NO_PARSER_TOOLS,
    PARSER_TOOLS,
    declare_messagepack_values,
    declare_rules_of_handlers,
    drop_refs,
    property_variants,
    variants,
)

# Fields the openai SDK's types (and so the schema) require, which vLLM's validators
# fill in when a Responses request's input item leaves them out: a reasoning item's
# id; an assistant message's id and status, and its output texts' annotations.
FILLED_IN_BY_VLLM = {
    "ResponseReasoningItemParam": ("id",),
    "ResponseReasoningItem": ("id",),
    "ResponseOutputMessageParam": ("id", "status"),
    "ResponseOutputTextParam": ("annotations",),
}


def declare_filled_in_fields(schema: dict[str, Any]) -> None:
    """The published schema does not require what vLLM fills in."""
    components = schema.get("components", {}).get("schemas", {})
    for name, fields in FILLED_IN_BY_VLLM.items():
        required = components.get(name, {}).get("required", [])
        required[:] = [field for field in required if field not in fields]


# Arrays vLLM refuses empty (no template renders an empty conversation).
NON_EMPTY_ARRAYS = [
    ("ChatCompletionRequest", "messages"),
    ("ChatCompletionRequest", "tools"),
    ("ChatCompletionRequest", "allowed_token_ids"),
    ("CompletionRequest", "allowed_token_ids"),
    ("TokenizeChatRequest", "messages"),
    ("GenerativeScoringRequest", "label_token_ids"),
    ("StructuredOutputsParams", "choice"),
    ("GenerativeScoringRequest", "items"),
    ("AnthropicMessagesRequest", "messages"),
    ("AnthropicCountTokensRequest", "messages"),
    ("GenerativeScoringRequest", "query"),
]
# Internal fields of vLLM's structured-output parameters (init=False): the schema listed
# them, validation ignores them.
INTERNAL_FIELDS = [("StructuredOutputsParams", "_backend"), ("StructuredOutputsParams", "_backend_was_auto")]
# Strings vLLM refuses empty: the Anthropic API's model ("Model is required").
NON_EMPTY_STRINGS = [
    ("AnthropicMessagesRequest", "model"),
    ("AnthropicCountTokensRequest", "model"),
    ("GenerativeScoringRequest", "query"),
    ("ChatCompletionNamedFunction", "name"),
]
# Booleans vLLM takes only as true ("structured_outputs.json_object must be True if set").
TRUE_ONLY = [("StructuredOutputsParams", "json_object")]
# Integers vLLM refuses below 1 ("max_tokens must be at least 1"; a completion may ask
# for 0 with echo: CROSS_FIELD_RULES). A chat request's deprecated max_tokens too, which
# vLLM takes below 1 only beside max_completion_tokens: refused there as well
# (app.vllm_routes.sampling.check_sampling, as OpenAI's API refuses it).
POSITIVE_INTEGERS = [
    ("AnthropicMessagesRequest", "max_tokens"),
    *(
        (name, field)
        for name in ("ChatCompletionRequest", "BatchChatCompletionRequest")
        for field in ("max_completion_tokens", "max_tokens", "n")
    ),
    ("CompletionRequest", "n"),
]
# Integers vLLM refuses below 0 (Anthropic's top_k: "0 (disable), or at least 1";
# SamplingParams' min_tokens; a completion's max_tokens, 0 only with echo).
NON_NEGATIVE_INTEGERS = [
    ("AnthropicMessagesRequest", "top_k"),
    ("CompletionRequest", "max_tokens"),
    *((name, "min_tokens") for name in ("ChatCompletionRequest", "CompletionRequest", "BatchChatCompletionRequest")),
]
# Output token counts vLLM bounds by the model's length ("max_completion_tokens=... cannot
# be greater than max_model_len"; a chat's deprecated max_tokens too, where it is read:
# beside max_completion_tokens it is not, and more is taken there).
OUTPUT_TOKEN_FIELDS = [
    ("ChatCompletionRequest", "max_completion_tokens"),
    ("ChatCompletionRequest", "max_tokens"),
    ("CompletionRequest", "max_tokens"),
    ("BatchChatCompletionRequest", "max_tokens"),
    ("BatchChatCompletionRequest", "max_completion_tokens"),
    ("AnthropicMessagesRequest", "max_tokens"),
    ("StatelessResponsesCreateRequest", "max_output_tokens"),
]
# vLLM's SamplingParams: penalties in [-2, 2].
PENALTIES = ("frequency_penalty", "presence_penalty")
# A thinking budget: -1 (unlimited) or a count, the count only with a reasoning parser
# (vLLM's engine refuses it otherwise).
THINKING_BUDGETS = [("ChatCompletionRequest", "thinking_token_budget"), ("CompletionRequest", "thinking_token_budget")]
ANTHROPIC_THINKING_WITH_BUDGET = "#/components/schemas/AnthropicThinkingConfigEnabled"
# SageMaker's route reads its body itself and hands it to the first of these that
# validates it (vLLM's get_generate_invocation_types, in its order).
INVOCATION_BODIES = ("ChatCompletionRequest", "CompletionRequest")


# vLLM's validate_cache_salt: non-empty, at most 128 characters, none of '@', '/', '\\', NUL.
CACHE_SALT = {"minLength": 1, "maxLength": 128, "pattern": "^[^@/\\\\\x00]*$"}
# Per-request multimodal kwargs and chat templates: refused unless the server trusts
# them (--trust-request-mm-kwargs, --trust-request-chat-template: this server sets
# neither): empty or absent.
UNTRUSTED_OBJECTS = ("mm_processor_kwargs", "media_io_kwargs")
UNTRUSTED_TEMPLATE = "chat_template"  # any string, "" too; also as a chat_template_kwargs key
# A JSON-schema response format carries its schema.
RESPONSE_FORMAT_RULE = {
    "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
    "then": {"properties": {"json_schema": {"type": "object"}}, "required": ["json_schema"]},
}
# vLLM's Responses request takes a stop of "" as none (chat and completions refuse it).
EMPTY_STOP_IS_NONE = {"ResponsesCreateRequest", "StatelessResponsesCreateRequest"}


# /detokenize decodes any id its tokenizer's 32-bit ids can hold (not only the model's).
DETOKENIZED = ("DetokenizeRequest", "tokens", 2**32 - 1)

# Token-id lists vLLM's SamplingParams checks against the vocabulary, in any request model.
TOKEN_ID_LISTS = {"stop_token_ids", "allowed_token_ids", "logprob_token_ids", "trace_decode_token_ids"}


def declare_model_limits(schema: dict[str, Any], vocab_size: int, max_model_len: int, max_logprobs: int = -1) -> None:
    """The model's limits, as vLLM checks them: token ids below the vocabulary (in the
    lists above and a completion's prompt), a prompt truncated to at most the model's
    length, output counts up to it, logprob counts up to the engine's ``max_logprobs``
    (-1: the vocabulary; -1 asked for is the vocabulary, refused where that is more)."""
    components = schema.get("components", {}).get("schemas", {})
    lists = [
        (name, field)
        for name, component in components.items()
        for field in component.get("properties", {})
        if field in TOKEN_ID_LISTS
    ]
    lists += [
        ("CompletionRequest", "prompt"),
        ("GenerativeScoringRequest", "query"),
        ("GenerativeScoringRequest", "items"),
        ("GenerativeScoringRequest", "label_token_ids"),
    ]
    for name, field, largest in [*((name, field, vocab_size - 1) for name, field in lists), DETOKENIZED]:
        for variant in variants(components, name, field):
            items = variant.get("items", {}) if variant.get("type") == "array" else {}
            for ids in (items, items.get("items", {}) if items.get("type") == "array" else {}):
                if ids.get("type") == "integer":
                    ids.update(minimum=0, maximum=largest)
    for variant in _truncation_variants(components):
        variant["maximum"] = max_model_len
    for name, field in OUTPUT_TOKEN_FIELDS:
        for variant in variants(components, name, field):
            if variant.get("type") == "integer":
                variant["maximum"] = max_model_len
    # logit_bias: keys are token ids (vLLM's int() of each), below the vocabulary.
    for component in components.values():
        for variant in property_variants(component.get("properties", {}), "logit_bias"):
            if variant.get("type") == "object":
                variant["propertyNames"] = {"pattern": decimal_below(vocab_size)}
    most_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
    for name, field in LOGPROB_COUNTS:
        for variant in variants(components, name, field):
            if variant.get("type") == "integer":
                variant.update(maximum=most_logprobs, minimum=-1 if vocab_size <= most_logprobs else 0)
    # A beam search asks the engine for 2 * n logprobs a step (vLLM's beam_search/online.py):
    # a completion's n is bounded by half the engine's limit, in the beam search rule it
    # has already (a chat request has no room for one: docs/reliability.md).
    rules = components.get("CompletionRequest", {}).get("allOf", [])
    for index, rule in enumerate(rules):
        if rule.get("if", {}).get("properties") == {"use_beam_search": {"const": True}}:
            rules[index] = rule = copy.deepcopy(rule)  # CROSS_FIELD_RULES' own is shared
            rule["then"].setdefault("properties", {})["n"] = {"maximum": most_logprobs // 2}


def decimal_below(limit: int) -> str:
    """A pattern for the decimal integers 0 to ``limit - 1``, without leading zeros (a
    JSON object's keys are strings, so a bound on the ids they name is a pattern)."""
    top = str(limit - 1)
    shorter = ["[0-9]"] + [f"[1-9][0-9]{{{length - 1}}}" for length in range(2, len(top))] if len(top) > 1 else []
    same = [top]
    for index, digit in enumerate(top):
        low = 1 if index == 0 and len(top) > 1 else 0
        if int(digit) > low:
            rest = len(top) - index - 1
            same.append(f"{top[:index]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    return "^(" + "|".join(shorter + same) + ")$"


def _truncation_variants(components: dict[str, Any]) -> list[dict[str, Any]]:
    """The integer forms of ``truncate_prompt_tokens``, on the routes that take it."""
    return [
        variant
        for name in ("ChatCompletionRequest", "CompletionRequest")
        for variant in variants(components, name, "truncate_prompt_tokens")[1:]
        if variant.get("type") == "integer"
    ]


def declare_vllm_input_rules(schema: dict[str, Any], reasoning: bool = False) -> None:
    """Rules vLLM's handlers enforce beyond their body models, in the published schema
    (``reasoning``: the server sets a reasoning parser):
    the arrays of ``NON_EMPTY_ARRAYS`` and strings of ``NON_EMPTY_STRINGS`` are absent or
    non-empty, ``POSITIVE_INTEGERS`` at least 1, ``TRUE_ONLY`` true or absent, a thinking
    budget as ``THINKING_BUDGETS`` says, ``truncate_prompt_tokens`` is not 0; a completion needs a non-empty ``prompt``
    (``prompt_embeds`` is off unless the server enables it, and a null prompt is
    refused either way); ``/invocations`` takes a chat or a completion request."""
    components = schema.get("components", {}).get("schemas", {})
    for rules, kind, bound, value in (
        (NON_EMPTY_ARRAYS, "array", "minItems", 1),
        (NON_EMPTY_STRINGS, "string", "minLength", 1),
        (POSITIVE_INTEGERS, "integer", "minimum", 1),
        (NON_NEGATIVE_INTEGERS, "integer", "minimum", 0),
        (TRUE_ONLY, "boolean", "const", True),
    ):
        for name, field in rules:
            for variant in variants(components, name, field):
                if variant.get("type") == kind:
                    variant[bound] = value
    # SamplingParams: n up to vLLM's VLLM_MAX_N_SEQUENCES (an environment setting).
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        for variant in variants(components, name, "n"):
            if variant.get("type") == "integer" and "maximum" not in variant:
                variant["maximum"] = vllm_envs.VLLM_MAX_N_SEQUENCES
    for name, field in THINKING_BUDGETS:
        for variant in variants(components, name, field):
            if variant.get("type") == "integer":
                variant.update({"minimum": -1} if reasoning else {"const": -1})
    if not reasoning:  # Anthropic's thinking with a budget is one too
        for variant in variants(components, "AnthropicMessagesRequest", "thinking"):
            drop_refs(variant, ANTHROPIC_THINKING_WITH_BUDGET)
            variant.get("discriminator", {}).get("mapping", {}).pop("enabled", None)
    for variant in _truncation_variants(components):
        variant["not"] = {"const": 0}  # -1 keeps the model's length; 0 would truncate the prompt to nothing
    declare_messagepack_values(components)
    for name, component in components.items():
        properties = component.get("properties", {})
        for variant in property_variants(properties, "cache_salt"):
            if variant.get("type") == "string":
                variant.update(CACHE_SALT)
        for field in UNTRUSTED_OBJECTS:
            for variant in property_variants(properties, field):
                if variant.get("type") == "object":
                    variant["maxProperties"] = 0
        if (template := properties.get(UNTRUSTED_TEMPLATE)) is not None:
            properties[UNTRUSTED_TEMPLATE] = {
                "type": "null",
                **{k: v for k, v in template.items() if k in ("title", "description")},
            }
        for variant in property_variants(properties, "chat_template_kwargs"):
            if variant.get("type") == "object":
                variant.setdefault("properties", {})[UNTRUSTED_TEMPLATE] = {"type": "null"}
        # vLLM's SamplingParams: no empty bad word and no empty stop string (a lone
        # string is a list of one; Anthropic's stop sequences too).
        for field in ("bad_words", "stop", "stop_sequences"):
            for variant in property_variants(properties, field):
                if variant.get("type") == "array" and variant.get("items", {}).get("type") == "string":
                    variant["items"]["minLength"] = 1
                elif variant.get("type") == "string" and field == "stop" and name not in EMPTY_STOP_IS_NONE:
                    variant["minLength"] = 1
        for variant in property_variants(properties, "logprob_token_ids"):
            if variant.get("type") == "array":
                variant["maxItems"] = MAX_LOGPROB_TOKEN_IDS
        # The ranges every route applies (app.vllm_routes.sampling.SAMPLING_RANGES; top_k's floor:
        # SamplingParams takes -1 and 0 for all); top_p up to 1.
        for field, (floor, ceiling) in SAMPLING_RANGES.items():
            for variant in property_variants(properties, field):
                if variant.get("type") not in ("number", "integer"):
                    continue
                if "minimum" not in variant:
                    variant.pop("exclusiveMinimum", None)
                    variant["minimum"] = floor
                if ceiling is not None and "maximum" not in variant:
                    variant["maximum"] = ceiling
        for variant in property_variants(properties, "top_p"):
            if variant.get("type") == "number" and "maximum" not in variant:
                variant["maximum"] = 1
        # vLLM's SamplingParams: min_p in [0, 1], penalties in [-2, 2], temperature in [0, 2].
        for field, low, high in (("min_p", 0, 1), ("temperature", 0, 2), *((penalty, -2, 2) for penalty in PENALTIES)):
            for variant in property_variants(properties, field):
                if variant.get("type") == "number" and "maximum" not in variant:
                    variant.update(minimum=low, maximum=high)
    for name, field in INTERNAL_FIELDS:
        components.get(name, {}).get("properties", {}).pop(field, None)
    # Batch chat completions refuse beam search and more than one choice.
    for variant in variants(components, "BatchChatCompletionRequest", "use_beam_search"):
        if variant.get("type") == "boolean":
            variant["const"] = False
    for variant in variants(components, "BatchChatCompletionRequest", "n"):
        if variant.get("type") == "integer":
            variant["maximum"] = 1
    for name, rule in {**ANTHROPIC_RULES, "ResponseFormat": RESPONSE_FORMAT_RULE}.items():
        if name in components:
            components[name].update(rule)
    declare_rules_of_handlers(components)
    _declare_invocation_body(schema, components)
    completion = components.get("CompletionRequest")
    if completion is None or "prompt" not in completion.get("properties", {}):
        return
    prompt = completion["properties"]["prompt"]
    prompt["anyOf"] = [variant for variant in prompt.get("anyOf", []) if variant.get("type") != "null"]
    for variant in prompt["anyOf"]:
        variant["minLength" if variant.get("type") == "string" else "minItems"] = 1
        items = variant.get("items", {})
        if items.get("type") in ("array", "string"):  # a prompt of no tokens: "cannot be empty"
            items["minItems" if items["type"] == "array" else "minLength"] = 1
    prompt.pop("default", None)
    if "prompt" not in (required := completion.setdefault("required", [])):
        required.append("prompt")


def _declare_invocation_body(schema: dict[str, Any], components: dict[str, Any]) -> None:
    operation = schema.get("paths", {}).get("/invocations", {}).get("post")
    bodies = [{"$ref": f"#/components/schemas/{name}"} for name in INVOCATION_BODIES if name in components]
    if operation is not None and bodies:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"anyOf": bodies}}}}
        # A streamed request is answered as the chat and completion routes answer it.
        ok = operation.setdefault("responses", {}).setdefault("200", {"description": "Successful Response"})
        for media in ("application/json", "text/event-stream"):
            ok.setdefault("content", {}).setdefault(media, {})


def patch_openapi(app: FastAPI, *patches: typing.Callable[[dict[str, Any]], None]) -> None:
    """Apply ``patches`` to the OpenAPI schema once, as FastAPI first builds it."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()  # FastAPI's own, which keeps it in app.openapi_schema
        for patch in patches:
            patch(schema)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


HARMONY_MESSAGE = "#/components/schemas/openai_harmony__Message"


# Content parts only a multimodal model takes ("... is not a multimodal model").
MULTIMODAL_PARTS = (
    [
        f"ChatCompletionContentPart{kind}Param"
        for kind in ("Image", "InputAudio", "Audio", "Video", "ImageEmbeds", "AudioEmbeds", "VideoEmbeds")
    ]
    + [f"CustomChatCompletionContentSimple{kind}Param" for kind in ("Image", "Audio", "Video")]
    + ["ResponseInputImageParam", "ResponseInputImageContentParam", "ResponseInputImage"]
)


def declare_server_features(
    schema: dict[str, Any],
    *,
    tool_parsing: bool,
    harmony: bool,
    prompt_embeds: bool,
    multimodal: bool,
    fim: bool = False,
) -> None:
    """What vLLM's routes take depends on how the server was started (vLLM's online
    renderer): without a tool parser a chat request's ``tool_choice`` is ``none`` or
    null, and given tools it must be set (its default is then ``auto``), as an
    Anthropic request's is ``none``; harmony messages only on a harmony (gpt-oss)
    model (another model's template fails on them); ``prompt_embeds`` (and prompt
    embedding parts) only where the server enables them; images, audio and video only
    on a multimodal model; a completion's ``suffix`` only where the model renders
    fill-in-the-middle."""
    components = schema.get("components", {}).get("schemas", {})
    # A chat request takes five rules between fields before schemathesis's generator
    # (jsonschema_rs's canonical form: "outgrew intersections") gives up on it; a sixth
    # left /v1/chat/completions unfuzzed (docs/reliability.md). The fifth is the tool
    # rule, so beam search's (it takes no logprob_token_ids) is left unstated.
    if "ChatCompletionRequest" in components:
        components["ChatCompletionRequest"].setdefault("allOf", []).append(
            PARSER_TOOLS if tool_parsing else NO_PARSER_TOOLS
        )
    unoffered = [
        *([] if harmony else [HARMONY_MESSAGE]),
        *([] if multimodal else [f"#/components/schemas/{part}" for part in MULTIMODAL_PARTS]),
        *([] if prompt_embeds else ["#/components/schemas/ChatCompletionContentPartPromptEmbedsParam"]),
    ]
    drop_refs(components, *unoffered)
    if not multimodal:
        block_type = components.get("AnthropicContentBlock", {}).get("properties", {}).get("type", {})
        if "image" in block_type.get("enum", []):
            block_type["enum"] = [kind for kind in block_type["enum"] if kind != "image"]
    if not fim and "suffix" in components.get("CompletionRequest", {}).get("properties", {}):
        components["CompletionRequest"]["properties"]["suffix"] = {"type": "null"}
    if not prompt_embeds:
        for component in components.values():
            if (embeds := component.get("properties", {}).get("prompt_embeds")) is not None:
                component["properties"]["prompt_embeds"] = {"type": "null", "title": embeds.get("title", "")}
    if tool_parsing:
        return
    chat = components.get("ChatCompletionRequest", {}).get("properties", {})
    if (choice := chat.get("tool_choice")) is not None:
        choice["anyOf"] = [v for v in choice.get("anyOf", []) if v.get("type") == "null" or v.get("const") == "none"]
    if "AnthropicToolChoice" in components:
        components["AnthropicToolChoice"]["properties"]["type"] = {"const": "none"}
        # A tool list (given, even empty, or made by a system message's tool change): the
        # default choice is auto.
        change = {
            "properties": {
                "role": {"const": "system"},
                "content": {
                    "type": "array",
                    "contains": {
                        "properties": {"type": {"enum": ["tool_addition", "tool_removal"]}},
                        "required": ["type"],
                    },
                },
            },
            "required": ["role", "content"],
        }
        for name in ANTHROPIC_REQUESTS:
            if name in components:
                components[name].setdefault("allOf", []).append(
                    {
                        "anyOf": [
                            {"properties": {"tool_choice": {"type": "object"}}, "required": ["tool_choice"]},
                            {"properties": {"tools": {"type": "null"}, "messages": {"not": {"contains": change}}}},
                        ]
                    }
                )
