"""What the published schema says of vLLM's routes beyond their body models: what vLLM
fills in, and the rules its handlers enforce, so that the schema states what the
server accepts, no more, no less (fresh-seed schemathesis runs found each rule below
as a schema-valid body refused, or a schema-invalid one accepted)."""

from __future__ import annotations

import copy
import typing
from typing import Any

from fastapi import FastAPI
from vllm.sampling_params import MAX_LOGPROB_TOKEN_IDS

from app.openai_routes import SAMPLING_FLOORS

# Fields the openai SDK's types (and so the schema) require, which vLLM's validators
# fill in when a Responses request's input item leaves them out: a reasoning item's
# id; an assistant message's id and status, and its output texts' annotations; a chat
# thinking part's text (read as empty).
FILLED_IN_BY_VLLM = {"ResponseReasoningItemParam": ("id",), "ResponseReasoningItem": ("id",),
                     "ResponseOutputMessageParam": ("id", "status"), "ResponseOutputTextParam": ("annotations",),
                     "CustomThinkCompletionContentParam": ("thinking",)}


def declare_filled_in_fields(schema: dict[str, Any]) -> None:
    """The published schema does not require what vLLM fills in."""
    components = schema.get("components", {}).get("schemas", {})
    for name, fields in FILLED_IN_BY_VLLM.items():
        required = components.get(name, {}).get("required", [])
        required[:] = [field for field in required if field not in fields]


# Arrays vLLM refuses empty (no template renders an empty conversation).
NON_EMPTY_ARRAYS = [
    ("ChatCompletionRequest", "messages"), ("ChatCompletionRequest", "tools"),
    ("ChatCompletionRequest", "allowed_token_ids"), ("CompletionRequest", "allowed_token_ids"),
    ("TokenizeChatRequest", "messages"), ("GenerativeScoringRequest", "label_token_ids"),
    ("StructuredOutputsParams", "choice"), ("GenerativeScoringRequest", "items"),
    ("AnthropicMessagesRequest", "messages"), ("AnthropicCountTokensRequest", "messages"),
    ("GenerativeScoringRequest", "query"),
]
# Internal fields of vLLM's structured-output parameters (init=False): the schema listed
# them, validation ignores them.
INTERNAL_FIELDS = [("StructuredOutputsParams", "_backend"), ("StructuredOutputsParams", "_backend_was_auto")]
# Strings vLLM refuses empty: the Anthropic API's model ("Model is required").
NON_EMPTY_STRINGS = [("AnthropicMessagesRequest", "model"), ("AnthropicCountTokensRequest", "model"),
                     ("GenerativeScoringRequest", "query")]
# Integers vLLM refuses below 1 ("max_tokens must be at least 1"; a completion may ask
# for 0 with echo: CROSS_FIELD_RULES).
POSITIVE_INTEGERS = [("AnthropicMessagesRequest", "max_tokens"), *(
    (name, field) for name in ("ChatCompletionRequest", "BatchChatCompletionRequest")
    for field in ("max_tokens", "max_completion_tokens", "n")), ("CompletionRequest", "n")]
# Output token counts vLLM bounds by the model's length ("max_completion_tokens=... cannot
# be greater than max_model_len"; a chat's deprecated max_tokens it clamps instead).
OUTPUT_TOKEN_FIELDS = [("ChatCompletionRequest", "max_completion_tokens"),
                       ("BatchChatCompletionRequest", "max_completion_tokens"), ("AnthropicMessagesRequest", "max_tokens")]
# A thinking budget: -1 (unlimited) or a count, the count only with a reasoning parser
# (vLLM's engine refuses it otherwise).
THINKING_BUDGETS = [("ChatCompletionRequest", "thinking_token_budget"), ("CompletionRequest", "thinking_token_budget")]
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
RESPONSE_FORMAT_RULE = {"if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
                        "then": {"properties": {"json_schema": {"type": "object"}}, "required": ["json_schema"]}}
# Anthropic's tool_choice names its tool when its type is "tool"; a content block that
# adds or removes a tool carries it (a removal, by reference).
ANTHROPIC_RULES = {
    "AnthropicToolChoice": {"if": {"properties": {"type": {"const": "tool"}}, "required": ["type"]},
                            "then": {"properties": {"name": {"type": "string", "minLength": 1}}, "required": ["name"]}},
    "AnthropicContentBlock": {"allOf": [
        {"if": {"properties": {"type": {"enum": ["tool_addition", "tool_removal"]}}, "required": ["type"]},
         "then": {"properties": {"tool": {"type": "object"}}, "required": ["tool"]}},
        {"if": {"properties": {"type": {"const": "tool_removal"}}, "required": ["type"]},
         "then": {"properties": {"tool": {"properties": {"type": {"const": "tool_reference"}},
                                          "required": ["type"]}}}},
    ]},
}
# Tool changes only in system messages (AnthropicMessage's validator).
ANTHROPIC_RULES["AnthropicMessage"] = {
    "if": {"properties": {"role": {"enum": ["user", "assistant"]}}, "required": ["role"]},
    "then": {"properties": {"content": {"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"properties": {"type": {"not": {"enum": ["tool_addition", "tool_removal"]}}}}},
    ]}}},
}  # the top-level system blocks too (NO_TOOL_CHANGE)
ANTHROPIC_REQUESTS = ("AnthropicMessagesRequest", "AnthropicCountTokensRequest")
NO_TOOL_CHANGE = {"properties": {"type": {"not": {"enum": ["tool_addition", "tool_removal"]}}}}
# vLLM converts an Anthropic request to chat messages and drops what carries nothing
# (a system message or block without text, a user message without content); a request
# left with no message is refused ("Cannot apply chat template to an empty
# conversation"). One of these keeps a message.
_TEXT_BLOCK = {"properties": {"type": {"const": "text"}, "text": {"type": "string", "minLength": 1}},
               "required": ["type", "text"]}
_USER_CONTENT = {"anyOf": [
    {"type": "string"},
    {"type": "array", "contains": {"anyOf": [
        _TEXT_BLOCK,
        {"properties": {"type": {"enum": ["tool_use", "tool_result"]}}, "required": ["type"]},
        {"properties": {"type": {"const": "thinking"}, "thinking": {"type": "string"}}, "required": ["type", "thinking"]},
    ]}},
]}
_SYSTEM_TEXT = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "contains": _TEXT_BLOCK}]}
ANTHROPIC_CONVERSATION = {"anyOf": [
    {"properties": {"system": _SYSTEM_TEXT}, "required": ["system"]},
    {"properties": {"messages": {"contains": {"anyOf": [
        {"properties": {"role": {"const": "assistant"}}, "required": ["role"]},
        {"properties": {"role": {"const": "user"}, "content": _USER_CONTENT}, "required": ["role", "content"]},
        {"properties": {"role": {"const": "system"}, "content": _SYSTEM_TEXT}, "required": ["role", "content"]},
    ]}}}, "required": ["messages"]},
]}
# vLLM's Responses request takes a stop of "" as none (chat and completions refuse it).
EMPTY_STOP_IS_NONE = {"ResponsesCreateRequest", "StatelessResponsesCreateRequest"}


def _when(condition: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    field = next(iter(condition))
    return {"if": {"properties": condition, "required": [field]}, "then": then}


_LOGPROB_IDS = {"logprob_token_ids": {"type": "array", "minItems": 1}}
_STREAM_OPTIONS = _when({"stream_options": {"type": "object", "minProperties": 1}},
                        {"properties": {"stream": {"const": True}}, "required": ["stream"]})
# Rules between fields, from vLLM's request validators and renderer: stream options only
# on a streamed request, and no prompt logprobs on it; logprob_token_ids (and a chat's
# top_logprobs) with logprobs (chat: true; completions: a count); a required tool with
# tools (Responses); a completion's suffix without echo or prompt truncation, and no
# output (max_tokens 0) only with echo; continuing the final message without a
# generation prompt.
_CHAT_LOGPROBS = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}
_CHAT_LOGPROB_RULES = [_when(_LOGPROB_IDS, _CHAT_LOGPROBS),
                       _when({"top_logprobs": {"type": "integer", "not": {"const": 0}}}, _CHAT_LOGPROBS)]
_NO_STREAMED_PROMPT_LOGPROBS = _when({"stream": {"const": True}}, {"properties": {
    "prompt_logprobs": {"anyOf": [{"type": "null"}, {"const": 0}]}}})
# add_generation_prompt defaults to true, so continuing the final message asks for false.
_CONTINUE = _when({"continue_final_message": {"const": True}}, {
    "properties": {"add_generation_prompt": {"const": False}}, "required": ["add_generation_prompt"]})
_REQUIRED_TOOL = _when({"tool_choice": {"const": "required"}},
                       {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]})
CROSS_FIELD_RULES = {
    "ChatCompletionRequest": [_STREAM_OPTIONS, _NO_STREAMED_PROMPT_LOGPROBS, _CONTINUE, *_CHAT_LOGPROB_RULES],
    "BatchChatCompletionRequest": [_CONTINUE, *_CHAT_LOGPROB_RULES],
    "TokenizeChatRequest": [_CONTINUE],
    **{name: [_REQUIRED_TOOL] for name in ("ResponsesCreateRequest", "StatelessResponsesCreateRequest")},
    "CompletionRequest": [_STREAM_OPTIONS, _NO_STREAMED_PROMPT_LOGPROBS, _when(_LOGPROB_IDS, {
        "properties": {"logprobs": {"type": "integer"}}, "required": ["logprobs"]}),
        _when({"suffix": {"type": "string"}}, {"properties": {
            "echo": {"not": {"const": True}}, "truncate_prompt_tokens": {"type": "null"}}}),
        _when({"max_tokens": {"const": 0}}, {"properties": {"echo": {"const": True}}, "required": ["echo"]})],
}
# Counts of logprobs: -1 (all) or at least 0.
LOGPROB_COUNTS = [("CompletionRequest", "logprobs"), ("CompletionRequest", "prompt_logprobs"),
                  ("ChatCompletionRequest", "prompt_logprobs"), ("ChatCompletionRequest", "top_logprobs"),
                  ("BatchChatCompletionRequest", "top_logprobs")]
# Parts and tool calls vLLM's chat parser does not take: a file part, an assistant's
# custom tool call.
UNPARSED = ("#/components/schemas/File", "#/components/schemas/ChatCompletionMessageCustomToolCallParam")
# Content parts without a type, told apart by their one key (vLLM's parser looks for it).
SIMPLE_PARTS = {"CustomChatCompletionContentSimpleImageParam": "image_url",
                "CustomChatCompletionContentSimpleAudioParam": "audio_url",
                "CustomChatCompletionContentSimpleVideoParam": "video_url",
                "CustomChatCompletionContentToolReferenceParam": "type"}
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
    lists = [(name, field) for name, component in components.items()
             for field in component.get("properties", {}) if field in TOKEN_ID_LISTS]
    lists += [("CompletionRequest", "prompt"), ("GenerativeScoringRequest", "query"),
              ("GenerativeScoringRequest", "items"), ("GenerativeScoringRequest", "label_token_ids")]
    for name, field, largest in [*((name, field, vocab_size - 1) for name, field in lists), DETOKENIZED]:
        for variant in _variants(components, name, field):
            items = variant.get("items", {}) if variant.get("type") == "array" else {}
            for ids in (items, items.get("items", {}) if items.get("type") == "array" else {}):
                if ids.get("type") == "integer":
                    ids.update(minimum=0, maximum=largest)
    for variant in _truncation_variants(components):
        variant["maximum"] = max_model_len
    for name, field in OUTPUT_TOKEN_FIELDS:
        for variant in _variants(components, name, field):
            if variant.get("type") == "integer":
                variant["maximum"] = max_model_len
    most_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
    for name, field in LOGPROB_COUNTS:
        for variant in _variants(components, name, field):
            if variant.get("type") == "integer":
                variant.update(maximum=most_logprobs, minimum=-1 if vocab_size <= most_logprobs else 0)


def _truncation_variants(components: dict[str, Any]) -> list[dict[str, Any]]:
    """The integer forms of ``truncate_prompt_tokens``, on the routes that take it."""
    return [variant for name in ("ChatCompletionRequest", "CompletionRequest")
            for variant in _variants(components, name, "truncate_prompt_tokens")[1:]
            if variant.get("type") == "integer"]


def _variants(components: dict[str, Any], name: str, field: str) -> list[dict[str, Any]]:
    return _property_variants(components.get(name, {}).get("properties", {}), field)


def _property_variants(properties: dict[str, Any], field: str) -> list[dict[str, Any]]:
    prop = properties.get(field)
    return [] if prop is None else [prop, *prop.get("anyOf", [])]


def declare_vllm_input_rules(schema: dict[str, Any], reasoning: bool = False) -> None:
    """Rules vLLM's handlers enforce beyond their body models, in the published schema
    (``reasoning``: the server sets a reasoning parser):
    the arrays of ``NON_EMPTY_ARRAYS`` and strings of ``NON_EMPTY_STRINGS`` are absent or
    non-empty, ``POSITIVE_INTEGERS`` at least 1, a thinking budget as ``THINKING_BUDGETS``
    says, ``truncate_prompt_tokens`` is not 0; a completion needs a non-empty ``prompt``
    (``prompt_embeds`` is off unless the server enables it, and a null prompt is
    refused either way); ``/invocations`` takes a chat or a completion request."""
    components = schema.get("components", {}).get("schemas", {})
    for rules, kind, bound in ((NON_EMPTY_ARRAYS, "array", "minItems"), (NON_EMPTY_STRINGS, "string", "minLength"),
                               (POSITIVE_INTEGERS, "integer", "minimum")):
        for name, field in rules:
            for variant in _variants(components, name, field):
                if variant.get("type") == kind:
                    variant[bound] = 1
    for name, field in THINKING_BUDGETS:
        for variant in _variants(components, name, field):
            if variant.get("type") == "integer":
                variant.update({"minimum": -1} if reasoning else {"const": -1})
    for variant in _truncation_variants(components):
        variant["not"] = {"const": 0}  # -1 keeps the model's length; 0 would truncate the prompt to nothing
    for name, component in components.items():
        properties = component.get("properties", {})
        for variant in _property_variants(properties, "cache_salt"):
            if variant.get("type") == "string":
                variant.update(CACHE_SALT)
        for field in UNTRUSTED_OBJECTS:
            for variant in _property_variants(properties, field):
                if variant.get("type") == "object":
                    variant["maxProperties"] = 0
        if (template := properties.get(UNTRUSTED_TEMPLATE)) is not None:
            properties[UNTRUSTED_TEMPLATE] = {"type": "null", **{k: v for k, v in template.items()
                                                                  if k in ("title", "description")}}
        for variant in _property_variants(properties, "chat_template_kwargs"):
            if variant.get("type") == "object":
                variant.setdefault("properties", {})[UNTRUSTED_TEMPLATE] = {"type": "null"}
        # vLLM's SamplingParams: no empty bad word and no empty stop string (a lone
        # string is a list of one).
        for field in ("bad_words", "stop"):
            for variant in _property_variants(properties, field):
                if variant.get("type") == "array" and variant.get("items", {}).get("type") == "string":
                    variant["items"]["minLength"] = 1
                elif variant.get("type") == "string" and field == "stop" and name not in EMPTY_STOP_IS_NONE:
                    variant["minLength"] = 1
        for variant in _property_variants(properties, "logprob_token_ids"):
            if variant.get("type") == "array":
                variant["maxItems"] = MAX_LOGPROB_TOKEN_IDS
        # Floors every route applies (app.openai_routes.SAMPLING_FLOORS); top_p up to 1.
        for field, floor in SAMPLING_FLOORS.items():
            for variant in _property_variants(properties, field):
                if variant.get("type") == "number" and "minimum" not in variant:
                    variant.pop("exclusiveMinimum", None)
                    variant["minimum"] = floor
        for variant in _property_variants(properties, "top_p"):
            if variant.get("type") == "number" and "maximum" not in variant:
                variant["maximum"] = 1
    for name, field in INTERNAL_FIELDS:
        components.get(name, {}).get("properties", {}).pop(field, None)
    # Batch chat completions refuse beam search and more than one choice.
    for variant in _variants(components, "BatchChatCompletionRequest", "use_beam_search"):
        if variant.get("type") == "boolean":
            variant["const"] = False
    for variant in _variants(components, "BatchChatCompletionRequest", "n"):
        if variant.get("type") == "integer":
            variant["maximum"] = 1
    for variant in _variants(components, "CompletionRequest", "max_tokens"):
        if variant.get("type") == "integer":
            variant["minimum"] = 0
    for name, rule in {**ANTHROPIC_RULES, "ResponseFormat": RESPONSE_FORMAT_RULE}.items():
        if name in components:
            components[name].update(rule)
    _declare_rules_of_handlers(components)
    _declare_invocation_body(schema, components)
    completion = components.get("CompletionRequest")
    if completion is None or "prompt" not in completion.get("properties", {}):
        return
    prompt = completion["properties"]["prompt"]
    prompt["anyOf"] = [variant for variant in prompt.get("anyOf", []) if variant.get("type") != "null"]
    for variant in prompt["anyOf"]:
        variant["minLength" if variant.get("type") == "string" else "minItems"] = 1
        if variant.get("items", {}).get("type") == "array":
            variant["items"]["minItems"] = 1
    prompt.pop("default", None)
    if "prompt" not in (required := completion.setdefault("required", [])):
        required.append("prompt")


def _declare_rules_of_handlers(components: dict[str, Any]) -> None:
    """Rules of vLLM's validators and handlers over more than one field, or over a
    part: ``CROSS_FIELD_RULES``, Anthropic's conversation and system blocks, parts told
    apart by their key, a batch's response format, custom and namespace tools."""
    for name, extra in {**CROSS_FIELD_RULES, **{name: [ANTHROPIC_CONVERSATION] for name in ANTHROPIC_REQUESTS}}.items():
        if name in components:
            components[name].setdefault("allOf", []).extend(extra)
    for name in ANTHROPIC_REQUESTS:
        for variant in _variants(components, name, "system"):
            if variant.get("type") == "array":
                variant["items"] = {"allOf": [variant.get("items", {}), NO_TOOL_CHANGE]}
    # vLLM's Responses request takes free-form custom tools only.
    for name in ("CustomTool", "CustomToolParam"):
        _drop_refs(components.get(name, {}), "#/components/schemas/Grammar")
    for name, key in SIMPLE_PARTS.items():
        if name in components:
            components[name]["required"] = [key]
    for ref in UNPARSED:
        _drop_refs(components, ref)
    for name, field in LOGPROB_COUNTS:
        for variant in _variants(components, name, field):
            if variant.get("type") == "integer":
                variant["minimum"] = -1
    # A batch's response format becomes a chat request's, per conversation.
    chat_format = components.get("ChatCompletionRequest", {}).get("properties", {}).get("response_format")
    batch = components.get("BatchChatCompletionRequest", {}).get("properties", {})
    if chat_format is not None and "response_format" in batch:
        batch["response_format"] = copy.deepcopy(chat_format)
    # A namespace's function tool is converted to vLLM's FunctionTool, whose parameters
    # are a JSON Schema object (the openai SDK's type takes any value).
    for name, component in components.items():
        if name.endswith("__ToolFunction") and "parameters" in component.get("properties", {}):
            component["properties"]["parameters"] = {"anyOf": [{"type": "object"}, {"type": "null"}]}


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
MULTIMODAL_PARTS = [f"ChatCompletionContentPart{kind}Param" for kind in (
    "Image", "InputAudio", "Audio", "Video", "ImageEmbeds", "AudioEmbeds", "VideoEmbeds")] + [
    f"CustomChatCompletionContentSimple{kind}Param" for kind in ("Image", "Audio", "Video")]


def declare_server_features(schema: dict[str, Any], *, tool_parsing: bool, harmony: bool,
                            prompt_embeds: bool, multimodal: bool) -> None:
    """What vLLM's routes take depends on how the server was started (vLLM's online
    renderer): without a tool parser a chat request's ``tool_choice`` is ``none`` or
    null, and given tools it must be set (its default is then ``auto``), as an
    Anthropic request's is ``none``; harmony messages only on a harmony (gpt-oss)
    model (another model's template fails on them); ``prompt_embeds`` (and prompt
    embedding parts) only where the server enables them; images, audio and video only
    on a multimodal model."""
    components = schema.get("components", {}).get("schemas", {})
    if not harmony:
        _drop_refs(components, HARMONY_MESSAGE)
    if not multimodal:
        for part in MULTIMODAL_PARTS:
            _drop_refs(components, f"#/components/schemas/{part}")
        block_type = components.get("AnthropicContentBlock", {}).get("properties", {}).get("type", {})
        if "image" in block_type.get("enum", []):
            block_type["enum"] = [kind for kind in block_type["enum"] if kind != "image"]
    if not prompt_embeds:
        _drop_refs(components, "#/components/schemas/ChatCompletionContentPartPromptEmbedsParam")
        for component in components.values():
            if (embeds := component.get("properties", {}).get("prompt_embeds")) is not None:
                component["properties"]["prompt_embeds"] = {"type": "null", "title": embeds.get("title", "")}
    if tool_parsing:
        return
    chat = components.get("ChatCompletionRequest", {}).get("properties", {})
    if (choice := chat.get("tool_choice")) is not None:
        choice["anyOf"] = [v for v in choice.get("anyOf", []) if v.get("type") == "null" or v.get("const") == "none"]
        components["ChatCompletionRequest"].setdefault("allOf", []).append(
            {"if": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
             "then": {"required": ["tool_choice"]}})
    if "AnthropicToolChoice" in components:
        components["AnthropicToolChoice"]["properties"]["type"] = {"const": "none"}
        # Tools given, or added by a system message's block: the default choice is auto.
        addition = {"properties": {"role": {"const": "system"}, "content": {
            "type": "array", "contains": {"properties": {"type": {"const": "tool_addition"}}, "required": ["type"]}}},
            "required": ["role", "content"]}
        for name in ANTHROPIC_REQUESTS:
            if name in components:
                components[name].setdefault("allOf", []).append({"anyOf": [
                    {"properties": {"tool_choice": {"type": "object"}}, "required": ["tool_choice"]},
                    {"properties": {"tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
                                    "messages": {"not": {"contains": addition}}}},
                ]})


def _drop_refs(node: Any, ref: str) -> None:
    """Take ``ref`` out of every union in ``node``."""
    if isinstance(node, dict):
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                node[key] = [v for v in node[key] if not (isinstance(v, dict) and v.get("$ref") == ref)]
        for value in node.values():
            _drop_refs(value, ref)
    elif isinstance(node, list):
        for value in node:
            _drop_refs(value, ref)
