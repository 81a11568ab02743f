"""Wire models of the Responses and Conversations APIs.

The create body is vLLM's ``ResponsesRequest`` (its validators and sampling fields),
plus what vLLM drops: ``conversation``. Output objects are vLLM's ``ResponsesResponse``
(the openai SDK's shape) and the SDK's own conversation types.
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    field_validator,
    model_validator,
)
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

from app.errors import APIError
from app.protocol import (
    SAFE_INTEGER_MAX,
    Integer,
    Metadata,
    MinP,
    RepetitionPenalty,
    StopTokenIds,
    Temperature,
    TopK,
    TopP,
)
from app.vllm_routes.schema_rules import property_variants

# OpenAI's limit on the items one request may add to a conversation.
MAX_ITEMS_PER_REQUEST = 20


def _refs(*names: str) -> list[dict[str, str]]:
    return [{"$ref": f"#/components/schemas/{name}"} for name in names]


_NOTHING = {"anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}]}
# A stored response's input items: vLLM's own input item types (what its request model
# takes, the openai SDK's) that app/api/responses/items.py converts, narrowed to what it
# takes: text parts, a tool output's call_id, and a string id (vLLM's model keeps any id
# on a message). A conversation's items (below) take more: they skip vLLM's model.
# (Fresh-seed fuzzing found a "text" part in a tool output valid by the schema, refused.)
STORED_ITEM_COPIES = {
    "EasyInputMessageParam": "StoredInputMessage",
    "openai__types__responses__response_input_item_param__Message": "StoredMessage",
    "FunctionCallOutput": "StoredFunctionCallOutput",
    "ResponseFunctionToolCallOutputItem": "StoredFunctionCallOutputItem",
}
# Items as a response returned them (the SDK's output models: a null status is one).
STORED_ITEM_TYPES = (
    "ResponseOutputMessageParam",
    "ResponseOutputMessage",
    "ResponseFunctionToolCallParam",
    "ResponseFunctionToolCall",
)
_TEXT_PARTS = tuple(
    f"#/components/schemas/{name}"
    for name in ("ResponseInputTextParam", "ResponseInputTextContentParam", "ResponseInputText")
)


def _declare_stored_items(components: dict[str, Any]) -> dict[str, Any]:
    """The stored input's item list, its narrowed copies added to ``components``."""
    present = [name for name in (*STORED_ITEM_COPIES, *STORED_ITEM_TYPES) if name in components]
    for name, copy_name in STORED_ITEM_COPIES.items():
        if name not in present:
            continue
        item = copy.deepcopy(components[name])
        properties = item["properties"]
        properties.setdefault("id", {"anyOf": [{"type": "string"}, {"type": "null"}]})
        if "call_id" in properties:
            properties["call_id"] = {"type": "string"}
            item["required"] = [*item.get("required", []), "call_id"]
        for field in ("content", "output"):
            for variant in property_variants(properties, field):
                if variant.get("type") == "array":
                    variant["items"] = {
                        "anyOf": [ref for ref in variant["items"].get("anyOf", []) if ref.get("$ref") in _TEXT_PARTS]
                    }
        components[copy_name] = {**item, "title": copy_name}
    return {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"anyOf": _refs(*(STORED_ITEM_COPIES.get(name, name) for name in present))}},
        ]
    }


# What a stored response takes where it differs from vLLM's handler (check_supported,
# app/api/responses/items.py, app/tools/parsing): falsy values of what it refuses, its input
# items, function tools, and a tool_choice of a mode or a function.
STORED_PROPERTIES: dict[str, Any] = {
    "background": {"anyOf": [{"type": "null"}, {"const": False}]},
    "structured_outputs": {"type": "null"},
    "logit_bias": _NOTHING,
    "stop": {"anyOf": [{"type": "null"}, {"const": ""}, {"type": "array", "maxItems": 0}]},
    "chat_template_kwargs": _NOTHING,
    "top_logprobs": {"anyOf": [{"type": "null"}, {"const": 0}]},
    "tool_choice": {
        "anyOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "properties": {"type": {"const": "function"}, "name": {"type": "string", "minLength": 1}},
                "required": ["type", "name"],
            },
        ]
    },
    "text": {
        "anyOf": [
            {"type": "null"},
            {
                "type": "object",
                "properties": {
                    "format": {
                        "anyOf": [
                            {"type": "null"},
                            {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]},
                        ]
                    }
                },
            },
        ]
    },
}
# Who answers: vLLM's handler a request with store false, no previous response or
# conversation and generate left on (app/api/responses/api_router.py); a session any other.
STATELESS = {
    "required": ["store"],
    "properties": {
        "store": {"const": False},
        "previous_response_id": {"type": "null"},
        "conversation": {"type": "null"},
        "generate": {"const": True},
    },
}
STORED = {
    "anyOf": [
        {"properties": {"store": {"not": {"const": False}}}},
        {"properties": {"previous_response_id": {"type": "string"}}, "required": ["previous_response_id"]},
        {"properties": {"conversation": {"not": {"type": "null"}}}, "required": ["conversation"]},
        {"properties": {"generate": {"const": False}}, "required": ["generate"]},
    ]
}
# A chain or a conversation, never both ("Mutually exclusive parameters", as OpenAI's).
ONE_THREAD = {
    "not": {
        "properties": {"previous_response_id": {"type": "string"}, "conversation": {"not": {"type": "null"}}},
        "required": ["previous_response_id", "conversation"],
    }
}
STATELESS_BODY = "StatelessResponsesCreateRequest"
# Either handler renders a conversation: the input, an earlier one's, or instructions
# ("Cannot apply chat template to an empty conversation" for none of them).
SOMETHING_TO_RENDER = {
    "anyOf": [
        {"properties": {"input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}}},
        {"properties": {"previous_response_id": {"type": "string"}}, "required": ["previous_response_id"]},
        {"properties": {"conversation": {"not": {"type": "null"}}}, "required": ["conversation"]},
        {"properties": {"instructions": {"type": "string", "minLength": 1}}, "required": ["instructions"]},
    ]
}


def declare_stored_response_rules(schema: dict[str, Any], tool_parsing: bool = True, harmony: bool = False) -> None:
    """The create body as two: a stored response (the default; or one that continues a
    chain or a conversation, or a warm-up), answered on a session, and a stateless one,
    answered by vLLM's own handler, each with what its handler takes (a stored response
    refuses stop strings, which a streaming session cannot honour, chat template kwargs,
    input items but text messages, function calls and their outputs, tools but function
    tools, and those without a tool parser). One component with if/else on ``store``
    was too complex for schemathesis to generate from; a body that is one of two is not.
    Off a harmony model, vLLM's handler takes only the input items it converts to chat
    messages. (Fresh-seed schemathesis runs over every route found each of these refused.)"""
    components = schema.get("components", {}).get("schemas", {})
    body = components.get("ResponsesCreateRequest")
    operation = schema.get("paths", {}).get("/v1/responses", {}).get("post")
    if body is None or operation is None or "stop" not in body.get("properties", {}):
        return
    body["properties"]["prompt"] = {"type": "null"}  # prompt templates: neither handler takes them
    components[STATELESS_BODY] = {
        **copy.deepcopy(body),
        "title": STATELESS_BODY,
        "allOf": [STATELESS, SOMETHING_TO_RENDER],
    }
    if "background" in body["properties"]:
        # vLLM's handler: "background can only be used when `store` is true"; and it builds
        # its response with the value, a bool (null failed its response model's validation).
        components[STATELESS_BODY]["properties"]["background"] = {"type": "boolean", "const": False}
    tools = {"type": "array", "items": _refs("FunctionTool")[0]} if tool_parsing else {"type": "array", "maxItems": 0}
    body["properties"].update(
        copy.deepcopy({**STORED_PROPERTIES, "tools": tools})
    )  # a list: vLLM's model takes no null
    body["properties"]["input"] = _declare_stored_items(components)
    body["allOf"] = [STORED, SOMETHING_TO_RENDER, ONE_THREAD]
    # vLLM's handler refuses an empty string in a stop list (found by the same fuzzing).
    for variant in components[STATELESS_BODY]["properties"]["stop"].get("anyOf", []):
        if variant.get("type") == "array":
            variant.setdefault("items", {})["minLength"] = 1
    if not harmony:
        _converted_items_only(components, components[STATELESS_BODY]["properties"].get("input", {}))
    operation["requestBody"]["content"]["application/json"]["schema"] = {
        "anyOf": _refs("ResponsesCreateRequest", STATELESS_BODY)
    }


# The input items vLLM's handler turns into chat messages on a model that is not
# harmony's (its responses/utils.py): any other is "Unsupported input item type" (an
# item that carries a role passes as a message only where pydantic left it a dict:
# additional_tools was refused in round 25).
CONVERTED_ITEM_TYPES = frozenset(
    {"message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output", "reasoning"}
)


# Reasoning items it converts only without encrypted content ("Encrypted content is not
# supported": a fresh seed found a non-empty one refused, either item model).
REASONING_ITEMS = ("ResponseReasoningItem", "ResponseReasoningItemParam")


def _converted_items_only(components: dict[str, Any], input_schema: dict[str, Any]) -> None:
    for variant in input_schema.get("anyOf", []):
        items = variant.get("items", {}) if variant.get("type") == "array" else {}
        if "anyOf" in items:
            items["anyOf"] = [
                ref for ref in items["anyOf"] if _converted(components.get(ref.get("$ref", "").split("/")[-1]))
            ]
    for name in REASONING_ITEMS:
        for variant in property_variants(components.get(name, {}).get("properties", {}), "encrypted_content"):
            if variant.get("type") == "string":
                variant["maxLength"] = 0


def _converted(item: dict[str, Any] | None) -> bool:
    if item is None:
        return False
    kind = item.get("properties", {}).get("type", {})
    return bool(CONVERTED_ITEM_TYPES & {kind.get("const"), *kind.get("enum", [])})


class ConversationRef(BaseModel):
    id: str


class ResponsesCreateRequest(ResponsesRequest):
    # JSON-safe, as the session API's seeds: vLLM's 64-bit bound cannot be held by a client
    # or schema validator comparing in doubles (fresh-seed fuzzing found 2**63 valid by the
    # schema and refused by the server).
    seed: Integer | None = None
    # The session API's sampling bounds: a stored response samples on a session, and an
    # out-of-range value is refused naming its parameter (on vLLM's handler too).
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=SAFE_INTEGER_MAX)] | None = None
    stop_token_ids: StopTokenIds | None = Field(default_factory=list)
    conversation: str | ConversationRef | None = Field(
        default=None, description="The conversation this response continues and is added to."
    )
    # Strict: vLLM's model, which the request middleware validates strictly, has no such
    # field, and this one's lax mode took 0 for false (fresh-seed fuzzing).
    generate: StrictBool = Field(
        default=True,
        description="False: a warm-up, as over OpenAI's Responses websocket (accepted over HTTP "
        "too): the input is added to the response's session and computed, and nothing is generated. The "
        "response (no output) is continued with previous_response_id, whose turn then computes only its own "
        "new input.",
    )
    prompt_cache_options: dict[str, Any] | None = Field(
        default=None,
        description="OpenAI's prompt cache options. prewarm true is generate false (a warm-up); the "
        "others do not apply here (a session keeps its own KV: no breakpoints, no expiry but its own).",
    )

    @field_validator("truncation", mode="after")
    @classmethod
    def _null_is_the_default(cls, value: str | None) -> str:
        # OpenAI's default; vLLM's handler answered a null with a 400 from its own
        # response model (fresh-seed fuzzing).
        return "disabled" if value is None else value

    @model_validator(mode="after")
    def _prewarm_is_a_warm_up(self) -> ResponsesCreateRequest:
        if (self.prompt_cache_options or {}).get("prewarm") is True:
            self.generate = False  # as at OpenAI: prewarm overrides generate
        return self

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation


# The items a conversation takes (app/api/responses/items.py converts them): messages with
# text, function calls and their outputs. Declared, so the published schema says what
# is accepted (a fresh-seed schemathesis run found `{}` items valid by the schema and
# refused). Fields beyond these are allowed: an item as the API returned it (with its
# status, a text part's annotations) may be sent back.
MessageRole = Literal["user", "system", "developer", "assistant"]
TextPartType = Literal["input_text", "output_text", "text"]


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: TextPartType
    text: str


class _RefusalPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["refusal"]
    refusal: str


TextContent = str | list[Annotated[_TextPart | _RefusalPart, Field(discriminator="type")]]


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: MessageRole
    content: TextContent


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: TextContent


def _item_type(value: Any) -> Any:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


ConversationItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class ConversationCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[ConversationItem] | None = Field(default=None, max_length=MAX_ITEMS_PER_REQUEST)
    metadata: Metadata | None = None


class ConversationUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: Metadata


class ConversationItemsCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[ConversationItem] = Field(min_length=1, max_length=MAX_ITEMS_PER_REQUEST)


class ListOrder(BaseModel):
    after: str | None = None
    limit: int = Field(default=20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"


# Fields of the create body that this server does not honour yet: refused by name,
# never dropped (vLLM's own route drops what it does not know).
_UNSUPPORTED: dict[str, str] = {
    "background": "Background responses are not supported.",
    "prompt": "Prompt templates are not supported.",
    "structured_outputs": "Structured outputs are not supported on stored responses.",
    "logit_bias": "logit_bias is not supported on stored responses.",
    "stop": "Stop strings are not supported on stored responses (stop_token_ids are).",
    # vLLM refuses them unless the server trusts per-request multimodal kwargs; it does not.
    "mm_processor_kwargs": "Per-request mm_processor_kwargs are not accepted by this server.",
    "media_io_kwargs": "Per-request media_io_kwargs are not accepted by this server.",
    "chat_template_kwargs": "chat_template_kwargs are not supported on stored responses (a session renders its "
    "conversation with the server's chat template).",
}


def check_supported(request: ResponsesCreateRequest) -> None:
    if request.previous_response_id is not None and request.conversation is not None:
        raise APIError(
            400,
            "Mutually exclusive parameters: provide only one of 'previous_response_id' or 'conversation'.",
            code="mutually_exclusive_parameters",
            param="conversation",
        )
    for name, message in _UNSUPPORTED.items():
        if getattr(request, name, None):
            raise APIError(400, message, code="unsupported_parameter", param=name)
    text_format = getattr(getattr(request.text, "format", None), "type", "text")
    if text_format not in (None, "text"):
        raise APIError(
            400, "Only text output is supported on stored responses.", code="unsupported_parameter", param="text.format"
        )
    if request.top_logprobs:
        raise APIError(
            400,
            "top_logprobs is not supported on stored responses.",
            code="unsupported_parameter",
            param="top_logprobs",
        )
