"""The rules of vLLM's handlers that the published schema states beyond single fields:
between fields (CROSS_FIELD_RULES), over content parts, Anthropic's conversion, custom
and namespace tools, the numbers of free-form fields sent on over MessagePack. Each was
found by fresh-seed schemathesis runs as a schema-valid body refused
(docs/reliability.md); app.vllm_routes.schema applies them."""

from __future__ import annotations

import copy
from typing import Any

from app.vllm_routes.sampling import FREE_FORM_DEPTH, MESSAGEPACK_FIELDS, MESSAGEPACK_RANGE

# Anthropic's tool_choice names its tool when its type is "tool"; a content block that
# adds or removes a tool carries it (a removal, by reference).
ANTHROPIC_RULES = {
    "AnthropicToolChoice": {
        "if": {"properties": {"type": {"const": "tool"}}, "required": ["type"]},
        "then": {"properties": {"name": {"type": "string", "minLength": 1}}, "required": ["name"]},
    },
    "AnthropicContentBlock": {
        "allOf": [
            {
                "if": {"properties": {"type": {"enum": ["tool_addition", "tool_removal"]}}, "required": ["type"]},
                "then": {"properties": {"tool": {"type": "object"}}, "required": ["tool"]},
            },
            {
                "if": {"properties": {"type": {"const": "tool_removal"}}, "required": ["type"]},
                "then": {
                    "properties": {"tool": {"properties": {"type": {"const": "tool_reference"}}, "required": ["type"]}}
                },
            },
        ]
    },
}
# Tool changes only in system messages (AnthropicMessage's validator).
ANTHROPIC_RULES["AnthropicMessage"] = {
    "if": {"properties": {"role": {"enum": ["user", "assistant"]}}, "required": ["role"]},
    "then": {
        "properties": {
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {"properties": {"type": {"not": {"enum": ["tool_addition", "tool_removal"]}}}},
                    },
                ]
            }
        }
    },
}  # the top-level system blocks too (NO_TOOL_CHANGE)
ANTHROPIC_REQUESTS = ("AnthropicMessagesRequest", "AnthropicCountTokensRequest")
NO_TOOL_CHANGE = {"properties": {"type": {"not": {"enum": ["tool_addition", "tool_removal"]}}}}
# vLLM converts an Anthropic request to chat messages and drops what carries nothing
# (a system message or block without text, a user message without content); a request
# left with no message is refused ("Cannot apply chat template to an empty
# conversation"). One of these keeps a message.
_TEXT_BLOCK = {
    "properties": {"type": {"const": "text"}, "text": {"type": "string", "minLength": 1}},
    "required": ["type", "text"],
}
_USER_CONTENT = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "contains": {
                "anyOf": [
                    _TEXT_BLOCK,
                    {"properties": {"type": {"enum": ["tool_use", "tool_result"]}}, "required": ["type"]},
                    {
                        "properties": {"type": {"const": "thinking"}, "thinking": {"type": "string"}},
                        "required": ["type", "thinking"],
                    },
                ]
            },
        },
    ]
}
_SYSTEM_TEXT = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "contains": _TEXT_BLOCK}]}
ANTHROPIC_CONVERSATION = {
    "anyOf": [
        {"properties": {"system": _SYSTEM_TEXT}, "required": ["system"]},
        {
            "properties": {
                "messages": {
                    "contains": {
                        "anyOf": [
                            {"properties": {"role": {"const": "assistant"}}, "required": ["role"]},
                            {
                                "properties": {"role": {"const": "user"}, "content": _USER_CONTENT},
                                "required": ["role", "content"],
                            },
                            {
                                "properties": {"role": {"const": "system"}, "content": _SYSTEM_TEXT},
                                "required": ["role", "content"],
                            },
                        ]
                    }
                }
            },
            "required": ["messages"],
        },
    ]
}


def when(condition: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    field = next(iter(condition))
    return {"if": {"properties": condition, "required": [field]}, "then": then}


_LOGPROB_IDS = {"logprob_token_ids": {"type": "array", "minItems": 1}}
# Streamed, no prompt logprobs; not streamed, no stream options: one anyOf, since each
# if/then doubles what schemathesis's generator expands (six on a chat request were too
# many for it to generate from at all).
_STREAMING: dict[str, Any] = {
    "anyOf": [
        {
            "properties": {"stream": {"const": True}, "prompt_logprobs": {"anyOf": [{"type": "null"}, {"const": 0}]}},
            "required": ["stream"],
        },
        {
            "properties": {
                "stream": {"not": {"const": True}},
                "stream_options": {"anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}]},
            }
        },
    ]
}
# A completion streams without beam search ("not currently supported").
_COMPLETION_STREAMING = copy.deepcopy(_STREAMING)
_COMPLETION_STREAMING["anyOf"][0]["properties"]["use_beam_search"] = {"not": {"const": True}}
# A completion's beam search takes no logprob_token_ids, nor logprobs with echo (it
# computes no prompt logprobs); no output (max_tokens 0) takes no logprob_token_ids, and
# is asked for with echo (the prompt back) or with beam search (vLLM's beams take it).
# (A chat request has no room for its beam search rule: app.vllm_routes.schema.)
_NO_IDS = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
_COMPLETION_BEAM_SEARCH = when(
    {"use_beam_search": {"const": True}},
    {
        "properties": {"logprob_token_ids": _NO_IDS},
        "anyOf": [{"properties": {"echo": {"not": {"const": True}}}}, {"properties": {"logprobs": {"type": "null"}}}],
    },
)
# Rules between fields, from vLLM's request validators and renderer: stream options only
# on a streamed request, and no prompt logprobs on it; logprob_token_ids (and a chat's
# top_logprobs) with logprobs (chat: true; completions: a count); a required tool with
# tools (Responses); a completion's suffix without echo or prompt truncation; continuing
# the final message without a generation prompt.
_CHAT_LOGPROBS = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}
_CHAT_LOGPROB_RULES = [
    when(_LOGPROB_IDS, _CHAT_LOGPROBS),
    when({"top_logprobs": {"type": "integer", "not": {"const": 0}}}, _CHAT_LOGPROBS),
]
# add_generation_prompt defaults to true, so continuing the final message asks for false.
_CONTINUE = when(
    {"continue_final_message": {"const": True}},
    {"properties": {"add_generation_prompt": {"const": False}}, "required": ["add_generation_prompt"]},
)
_REQUIRED_TOOL = when(
    {"tool_choice": {"const": "required"}},
    {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
)
CROSS_FIELD_RULES = {
    "ChatCompletionRequest": [_STREAMING, _CONTINUE, *_CHAT_LOGPROB_RULES],
    "BatchChatCompletionRequest": [_CONTINUE, *_CHAT_LOGPROB_RULES],
    "TokenizeChatRequest": [_CONTINUE],
    **{name: [_REQUIRED_TOOL] for name in ("ResponsesCreateRequest", "StatelessResponsesCreateRequest")},
    "CompletionRequest": [
        _COMPLETION_STREAMING,
        when(_LOGPROB_IDS, {"properties": {"logprobs": {"type": "integer"}}, "required": ["logprobs"]}),
        when(
            {"suffix": {"type": "string"}},
            {"properties": {"echo": {"not": {"const": True}}, "truncate_prompt_tokens": {"type": "null"}}},
        ),
        when(
            {"max_tokens": {"const": 0}},
            {
                "properties": {"logprob_token_ids": _NO_IDS},
                "anyOf": [
                    {"properties": {"echo": {"const": True}}, "required": ["echo"]},
                    {"properties": {"use_beam_search": {"const": True}}, "required": ["use_beam_search"]},
                ],
            },
        ),
        _COMPLETION_BEAM_SEARCH,
    ],
}
# A chat request's tools and tool_choice as vLLM's check_tool_usage reads them: without a
# tool parser, tools need a tool_choice (the default is then auto, refused); with one, a
# tool_choice but none needs tools.
NO_PARSER_TOOLS = when({"tools": {"type": "array", "minItems": 1}}, {"required": ["tool_choice"]})
PARSER_TOOLS = {
    "anyOf": [
        {"properties": {"tool_choice": {"anyOf": [{"type": "null"}, {"const": "none"}]}}},
        {"properties": {"tools": {"type": "array"}}, "required": ["tools"]},
    ]
}


# Counts of logprobs: -1 (all) or at least 0.
LOGPROB_COUNTS = [
    ("CompletionRequest", "logprobs"),
    ("CompletionRequest", "prompt_logprobs"),
    ("ChatCompletionRequest", "prompt_logprobs"),
    ("ChatCompletionRequest", "top_logprobs"),
    ("BatchChatCompletionRequest", "top_logprobs"),
]
# Parts and tool calls vLLM's chat parser does not take: a file part (a chat's, a
# Responses message's or tool output's), an assistant's custom tool call.
UNPARSED = (
    "#/components/schemas/File",
    "#/components/schemas/ChatCompletionMessageCustomToolCallParam",
    "#/components/schemas/ResponseInputFileParam",
    "#/components/schemas/ResponseInputFileContentParam",
    "#/components/schemas/ResponseInputFile",
)
REQUEST_NAMESPACE_FUNCTIONS = ("openai__types__responses__namespace_tool__ToolFunction",)
# Content parts without a type, told apart by their one key (vLLM's parser looks for it).
SIMPLE_PARTS = {
    "CustomChatCompletionContentSimpleImageParam": "image_url",
    "CustomChatCompletionContentSimpleAudioParam": "audio_url",
    "CustomChatCompletionContentSimpleVideoParam": "video_url",
    "CustomChatCompletionContentToolReferenceParam": "type",
}


def variants(components: dict[str, Any], name: str, field: str) -> list[dict[str, Any]]:
    return property_variants(components.get(name, {}).get("properties", {}), field)


def property_variants(properties: dict[str, Any], field: str) -> list[dict[str, Any]]:
    prop = properties.get(field)
    return [] if prop is None else [prop, *prop.get("anyOf", [])]


def declare_rules_of_handlers(components: dict[str, Any]) -> None:
    """Rules of vLLM's validators and handlers over more than one field, or over a
    part: ``CROSS_FIELD_RULES``, Anthropic's conversation and system blocks, parts told
    apart by their key, a batch's response format, custom and namespace tools, and the numbers of free-form fields sent on over MessagePack."""
    for name, extra in {**CROSS_FIELD_RULES, **{name: [ANTHROPIC_CONVERSATION] for name in ANTHROPIC_REQUESTS}}.items():
        if name in components:
            components[name].setdefault("allOf", []).extend(extra)
    for name in ANTHROPIC_REQUESTS:
        for variant in variants(components, name, "system"):
            if variant.get("type") == "array":
                variant["items"] = {"allOf": [variant.get("items", {}), NO_TOOL_CHANGE]}
    # vLLM's Responses request takes free-form custom tools only.
    for name in ("CustomTool", "CustomToolParam"):
        drop_refs(components.get(name, {}), "#/components/schemas/Grammar")
    for name, key in SIMPLE_PARTS.items():
        if name in components:
            components[name]["required"] = [key]
    # Repetition detection: sizes from 0, and a pattern (a size above 0) counted at least twice.
    detection = components.get("RepetitionDetectionParams", {})
    for field in ("max_pattern_size", "min_pattern_size"):
        if detection.get("properties", {}).get(field, {}).get("type") == "integer":
            detection["properties"][field]["minimum"] = 0
    if "max_pattern_size" in detection.get("properties", {}):
        detection["if"] = {"properties": {"max_pattern_size": {"minimum": 1}}, "required": ["max_pattern_size"]}
        detection["then"] = {"properties": {"min_count": {"minimum": 2}}, "required": ["min_count"]}
    drop_refs(components, *UNPARSED)
    for name, field in LOGPROB_COUNTS:
        for variant in variants(components, name, field):
            if variant.get("type") == "integer":
                variant["minimum"] = -1
    # A batch's response format becomes a chat request's, per conversation.
    chat_format = components.get("ChatCompletionRequest", {}).get("properties", {}).get("response_format")
    batch = components.get("BatchChatCompletionRequest", {}).get("properties", {})
    if chat_format is not None and "response_format" in batch:
        batch["response_format"] = copy.deepcopy(chat_format)
    # A request's namespace tool's function tools are converted to vLLM's FunctionTool,
    # whose parameters are a JSON Schema object (the openai SDK's type takes any value).
    # The same tools inside an input item (additional_tools) are not converted: any value.
    for name in REQUEST_NAMESPACE_FUNCTIONS:
        if "parameters" in components.get(name, {}).get("properties", {}):
            components[name]["properties"]["parameters"] = {"anyOf": [{"type": "object"}, {"type": "null"}]}


def drop_refs(node: Any, *refs: str) -> None:
    """Take each of ``refs`` out of every union in ``node``, in one walk."""
    if isinstance(node, dict):
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                node[key] = [v for v in node[key] if not (isinstance(v, dict) and v.get("$ref") in refs)]
        for value in node.values():
            drop_refs(value, *refs)
    elif isinstance(node, list):
        for value in node:
            drop_refs(value, *refs)


def _free_form_value(depth: int) -> dict[str, Any]:
    """A value of a free-form transfer field (app.vllm_routes.sampling.FREE_FORM_FIELDS): a
    number within MessagePack's range, any other scalar, or, ``depth`` more times, an
    array or object of such values. Written out, not recursive: schemathesis cannot
    generate bodies that break a recursive (or $ref-chained) one ("Cannot generate an
    array with 1 demanded elements", every fresh seed over /v1/messages)."""
    variants: list[dict[str, Any]] = [
        {"type": ["string", "boolean", "null"]},
        {"type": "number", "minimum": MESSAGEPACK_RANGE[0], "maximum": MESSAGEPACK_RANGE[1]},
    ]
    if depth > 0:
        inner = _free_form_value(depth - 1)
        variants += [
            {"type": "array", "items": inner},
            {"type": "object", "additionalProperties": copy.deepcopy(inner)},
        ]
    return {"anyOf": variants}


def declare_messagepack_values(components: dict[str, Any]) -> None:
    """Numbers in ``MESSAGEPACK_FIELDS`` within MessagePack's range: a free-form object's
    values are ``_free_form_value`` (nested as deep as the server takes them);
    vllm_xargs' own numbers (and its lists') bounded."""
    for component in list(components.values()):
        for field in MESSAGEPACK_FIELDS:
            for variant in property_variants(component.get("properties", {}), field):
                if variant.get("type") != "object":
                    continue
                values = variant.get("additionalProperties", True)
                if values is True or values == {}:
                    variant["additionalProperties"] = _free_form_value(FREE_FORM_DEPTH)
                else:
                    _bound_numbers(values)


def _bound_numbers(node: dict[str, Any]) -> None:
    """Every number in ``node`` (its union's members and its items, at any depth) within
    MessagePack's range."""
    if node.get("type") in ("integer", "number"):
        node.update(minimum=MESSAGEPACK_RANGE[0], maximum=MESSAGEPACK_RANGE[1])
    for child in [*node.get("anyOf", []), *([node["items"]] if "items" in node else [])]:
        _bound_numbers(child)
