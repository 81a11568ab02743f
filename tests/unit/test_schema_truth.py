"""The published schema says what validation accepts: each case here is a finding of
schemathesis run with fresh seeds (docs/reliability.md), pinned. Oracle: the request
models and the schema patches themselves; the server-wide check is
tests/http/test_schema_fuzz.py (positive_data_acceptance, negative_data_rejection).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
from pydantic import ValidationError

from app.api.sessions.protocol import ChunkRequest, InputAppendEvent
from app.protocol import SAFE_INTEGER_MAX, SessionCreateRequest
from app.sessions.inputs import declare_bounds
from app.vllm_routes.schema import declare_vllm_input_rules


def test_integral_floats_are_integers_as_json_schema_has_them() -> None:
    chunk = ChunkRequest.model_validate({"input": [35148.0, 2], "seed": 5.0, "max_tokens": 3.0, "temperature": 0})
    assert (chunk.input, chunk.seed, chunk.max_tokens) == ([35148, 2], 5, 3)
    assert type(chunk.input[0]) is int and chunk.temperature == 0.0
    assert SessionCreateRequest.model_validate({"defaults": {"top_k": 7.0}}).defaults.top_k == 7
    assert InputAppendEvent.model_validate({"type": "input.append", "input": [3.0]}).input == [3]


@pytest.mark.parametrize(
    "body",
    [
        {"input": [1.5]},  # not integral
        {"input": [True]},  # strict: a boolean is no token id
        {"input": [1], "max_tokens": "3"},  # strict: no coercion from strings
        {"input": [1], "seed": SAFE_INTEGER_MAX + 1},
        {"input": [1], "seed": -781048977054667242471424},  # closed a session with a 500 before
        {"input": [1], "stop_token_ids": [2**70]},
        {"input": [2**31]},
    ],
)
def test_out_of_range_and_coerced_values_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ChunkRequest.model_validate(body)


def test_the_schema_states_the_servers_bounds() -> None:
    schema = {
        "components": {
            "schemas": {
                "ChunkRequest": copy.deepcopy(ChunkRequest.model_json_schema()),
                "SessionDefaults": copy.deepcopy(SessionCreateRequest.model_json_schema()["$defs"]["SessionDefaults"]),
            }
        }
    }
    declare_bounds(schema, vocab_size=1024, max_output_tokens=16, max_chunk_tokens=256, max_messages=35)
    chunk = schema["components"]["schemas"]["ChunkRequest"]["properties"]
    ids, messages = [v for v in chunk["input"]["anyOf"] if v.get("type") == "array"]
    assert (ids["maxItems"], ids["items"]["maximum"]) == (256, 1023)
    assert messages["maxItems"] == 35 and "maximum" not in messages["items"]  # a fresh seed found 60 refused
    for name in ("ChunkRequest", "SessionDefaults"):
        properties = schema["components"]["schemas"][name]["properties"]
        assert {"type": "integer", "maximum": 16, "minimum": 1} in [
            {k: v for k, v in variant.items() if k in ("type", "maximum", "minimum")}
            for variant in properties["max_tokens"]["anyOf"]
        ]
        stops = next(v for v in properties["stop_token_ids"]["anyOf"] if v.get("type") == "array")
        assert stops["items"]["maximum"] == 1023
    seed = next(v for v in chunk["seed"]["anyOf"] if v.get("type") == "integer")
    assert seed["maximum"] == SAFE_INTEGER_MAX == 2**53 - 1


def test_a_responses_seed_is_bounded_where_doubles_are_exact() -> None:
    from app.api.responses.protocol import ResponsesCreateRequest

    seed = next(
        v
        for v in ResponsesCreateRequest.model_json_schema()["properties"]["seed"]["anyOf"]
        if v.get("type") == "integer"
    )
    assert (seed["minimum"], seed["maximum"]) == (-SAFE_INTEGER_MAX, SAFE_INTEGER_MAX)
    assert ResponsesCreateRequest.model_validate({"input": "hi", "seed": SAFE_INTEGER_MAX}).seed == SAFE_INTEGER_MAX
    with pytest.raises(ValidationError):
        ResponsesCreateRequest.model_validate({"input": "hi", "seed": 2**63})


def test_vllm_rules_beyond_its_models_are_in_the_schema() -> None:
    nullable_array = {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]}
    schema = {
        "components": {
            "schemas": {
                "ChatCompletionRequest": {
                    "properties": {
                        "messages": {"type": "array", "items": {}},
                        "tools": copy.deepcopy(nullable_array),
                        "allowed_token_ids": copy.deepcopy(nullable_array),
                        "truncate_prompt_tokens": {"anyOf": [{"type": "integer", "minimum": -1}, {"type": "null"}]},
                    }
                },
                "CompletionRequest": {
                    "properties": {
                        "prompt": {
                            "anyOf": [
                                {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                                {"type": "string"},
                                {"type": "null"},
                            ],
                            "default": None,
                        },
                    }
                },
            }
        }
    }
    declare_vllm_input_rules(schema)
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1
    assert chat["tools"]["anyOf"][0]["minItems"] == 1 and chat["allowed_token_ids"]["anyOf"][0]["minItems"] == 1
    assert chat["truncate_prompt_tokens"]["anyOf"][0]["not"] == {"const": 0}
    completion = schema["components"]["schemas"]["CompletionRequest"]
    assert completion["required"] == ["prompt"]
    assert {"type": "null"} not in completion["properties"]["prompt"]["anyOf"]
    nested, text = completion["properties"]["prompt"]["anyOf"]
    assert (nested["minItems"], nested["items"]["minItems"], text["minLength"]) == (1, 1, 1)


def test_vllm_rules_found_by_fresh_seeds_are_in_the_schema() -> None:
    """Each rule was a schema-valid body refused (or, for /invocations, a body its schema
    did not describe) in ten fresh-seed runs over every route (docs/reliability.md)."""

    def schema() -> dict[str, Any]:
        integer_or_null = {"anyOf": [{"type": "integer"}, {"type": "null"}]}
        return {
            "paths": {"/invocations": {"post": {"responses": {}}}},
            "components": {
                "schemas": {
                    "ChatCompletionRequest": {"properties": {"thinking_token_budget": copy.deepcopy(integer_or_null)}},
                    "CompletionRequest": {"properties": {"thinking_token_budget": copy.deepcopy(integer_or_null)}},
                    "TokenizeChatRequest": {"properties": {"messages": {"type": "array", "items": {}}}},
                    "AnthropicMessagesRequest": {
                        "properties": {"model": {"type": "string"}, "max_tokens": {"type": "integer"}}
                    },
                    "AnthropicCountTokensRequest": {"properties": {"model": {"type": "string"}}},
                }
            },
        }

    plain, reasoning = schema(), schema()
    declare_vllm_input_rules(plain)
    declare_vllm_input_rules(reasoning, reasoning=True)
    components = plain["components"]["schemas"]
    assert components["TokenizeChatRequest"]["properties"]["messages"]["minItems"] == 1
    assert components["AnthropicMessagesRequest"]["properties"]["model"]["minLength"] == 1
    assert components["AnthropicCountTokensRequest"]["properties"]["model"]["minLength"] == 1
    assert components["AnthropicMessagesRequest"]["properties"]["max_tokens"]["minimum"] == 1
    # Without a reasoning parser vLLM's engine refuses any budget but -1 (unlimited: unset).
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        assert components[name]["properties"]["thinking_token_budget"]["anyOf"][0]["const"] == -1
        budget = reasoning["components"]["schemas"][name]["properties"]["thinking_token_budget"]["anyOf"][0]
        assert budget == {"type": "integer", "minimum": -1}
    body = plain["paths"]["/invocations"]["post"]["requestBody"]
    assert set(plain["paths"]["/invocations"]["post"]["responses"]["200"]["content"]) == {
        "application/json",
        "text/event-stream",
    }
    assert body["required"] and body["content"]["application/json"]["schema"]["anyOf"] == [
        {"$ref": "#/components/schemas/ChatCompletionRequest"},
        {"$ref": "#/components/schemas/CompletionRequest"},
    ]


def test_salts_untrusted_kwargs_tool_choice_and_token_ids_are_bounded_as_vllm_checks_them() -> None:
    from app.vllm_routes.schema import declare_model_limits

    string_or_null = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    ids = {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]}
    schema: dict[str, Any] = {
        "components": {
            "schemas": {
                "CompletionRequest": {
                    "properties": {
                        "prompt": {
                            "anyOf": [
                                {"type": "array", "items": {"type": "integer"}},
                                {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                            ]
                        },
                        "truncate_prompt_tokens": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                        "cache_salt": copy.deepcopy(string_or_null),
                        "stop_token_ids": copy.deepcopy(ids),
                        "repetition_penalty": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                        "bad_words": {"type": "array", "items": {"type": "string"}},
                        "stop": {
                            "anyOf": [
                                {"type": "string"},
                                {"type": "array", "items": {"type": "string"}},
                                {"type": "null"},
                            ]
                        },
                        "allowed_token_ids": copy.deepcopy(ids),
                        "media_io_kwargs": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                    }
                },
                "TokenizeChatRequest": {
                    "properties": {
                        "mm_processor_kwargs": {"type": "object"},
                        "chat_template": copy.deepcopy(string_or_null),
                    }
                },
                "StructuredOutputsParams": {
                    "properties": {
                        "choice": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
                    }
                },
                "AnthropicContentBlock": {"properties": {"type": {"type": "string"}}},
                "BatchChatCompletionRequest": {"properties": {"use_beam_search": {"type": "boolean"}}},
                "DetokenizeRequest": {"properties": {"tokens": {"type": "array", "items": {"type": "integer"}}}},
                "AnthropicToolChoice": {"properties": {"type": {"enum": ["auto", "any", "tool", "none"]}}},
                "openai__types__responses__namespace_tool__ToolFunction": {
                    "properties": {"parameters": {"anyOf": [{}, {"type": "null"}]}}
                },
                "openai__types__responses__namespace_tool_param__ToolFunction": {
                    "properties": {"parameters": {"anyOf": [{}, {"type": "null"}]}}
                },
            }
        }
    }
    declare_vllm_input_rules(schema)
    declare_model_limits(schema, 732, 2048)
    components = schema["components"]["schemas"]
    completion = components["CompletionRequest"]["properties"]
    salt = completion["cache_salt"]["anyOf"][0]
    assert (salt["minLength"], salt["maxLength"]) == (1, 128)
    pattern = re.compile(salt["pattern"])
    assert pattern.match("key-1") and not any(pattern.match(f"a{c}b") for c in "@/\\\x00")
    assert completion["media_io_kwargs"]["anyOf"][0]["maxProperties"] == 0
    assert components["TokenizeChatRequest"]["properties"]["mm_processor_kwargs"]["maxProperties"] == 0
    for field in ("stop_token_ids", "allowed_token_ids"):
        assert completion[field]["anyOf"][0]["items"] == {"type": "integer", "minimum": 0, "maximum": 731}
    # /detokenize decodes any 32-bit id (the tokenizer's), not only the model's vocabulary.
    assert components["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 2**32 - 1
    flat, nested = completion["prompt"]["anyOf"]
    assert flat["items"]["maximum"] == 731 and nested["items"]["items"]["maximum"] == 731
    assert completion["truncate_prompt_tokens"]["anyOf"][0]["maximum"] == 2048
    assert completion["repetition_penalty"]["anyOf"][0] == {"type": "number", "minimum": 1e-6, "maximum": 1e6}
    assert completion["bad_words"]["items"]["minLength"] == 1
    # vLLM's SamplingParams refuses an empty stop string, alone or in a list.
    assert [v.get("minLength", v.get("items", {}).get("minLength")) for v in completion["stop"]["anyOf"]] == [
        1,
        1,
        None,
    ]
    # A namespace's function tool becomes vLLM's FunctionTool: its parameters are an object.
    tool = components["openai__types__responses__namespace_tool__ToolFunction"]["properties"]
    assert tool["parameters"]["anyOf"][0] == {"type": "object"}
    # In an input item (additional_tools) vLLM converts nothing: any value, as the SDK's type.
    item_tool = components["openai__types__responses__namespace_tool_param__ToolFunction"]["properties"]
    assert item_tool["parameters"]["anyOf"][0] == {}
    assert components["BatchChatCompletionRequest"]["properties"]["use_beam_search"]["const"] is False
    assert components["AnthropicToolChoice"]["then"]["required"] == ["name"]
    assert components["AnthropicContentBlock"]["allOf"][0]["then"]["required"] == ["tool"]
    assert components["TokenizeChatRequest"]["properties"]["chat_template"]["type"] == "null"
    assert components["StructuredOutputsParams"]["properties"]["choice"]["anyOf"][0]["minItems"] == 1


def test_rules_of_vllms_anthropic_conversion_are_in_the_schema() -> None:
    """Fresh seeds found both refused: a conversation with nothing left once vLLM drops
    what carries no text, and a tool change outside a system message. Oracle: the
    rules, read by a JSON Schema validator, against bodies vLLM answered by hand."""
    import jsonschema

    from app.vllm_routes.schema_rules import ANTHROPIC_CONVERSATION, ANTHROPIC_RULES

    def conversation(body: dict[str, Any]) -> bool:
        return jsonschema.Draft202012Validator(ANTHROPIC_CONVERSATION).is_valid(body)

    assert not conversation({"messages": [{"role": "system", "content": ""}]})  # vLLM: empty conversation
    assert not conversation({"messages": [{"role": "system", "content": [{"type": "text", "text": ""}]}]})
    assert not conversation({"messages": [{"role": "user", "content": []}]})
    assert conversation({"messages": [{"role": "system", "content": "x"}]})  # answered 200
    assert conversation({"messages": [{"role": "system", "content": ""}], "system": "y"})  # answered 200
    assert conversation({"messages": [{"role": "user", "content": ""}]})
    assert conversation({"messages": [{"role": "assistant", "content": []}]})
    message = jsonschema.Draft202012Validator(ANTHROPIC_RULES["AnthropicMessage"])
    addition = [{"type": "tool_addition", "tool": {"name": "f", "input_schema": {}}}]
    assert message.is_valid({"role": "system", "content": addition})
    assert not message.is_valid({"role": "user", "content": addition})


def _tool_schema() -> dict[str, Any]:
    harmony = {"$ref": "#/components/schemas/openai_harmony__Message"}
    image = {"$ref": "#/components/schemas/ChatCompletionContentPartImageParam"}
    embeds = {"$ref": "#/components/schemas/ChatCompletionContentPartPromptEmbedsParam"}
    return {
        "components": {
            "schemas": {
                "ChatCompletionRequest": {
                    "properties": {
                        "messages": {
                            "type": "array",
                            "items": {"anyOf": [{"$ref": "#/components/schemas/User"}, harmony]},
                        },
                        "content": {"items": {"anyOf": [{"$ref": "#/T"}, image, embeds]}},
                        "tool_choice": {
                            "anyOf": [
                                {"type": "string", "const": "none"},
                                {"type": "string", "const": "auto"},
                                {"type": "string", "const": "required"},
                                {"$ref": "#/x"},
                                {"type": "null"},
                            ]
                        },
                        "tools": {"anyOf": [{"type": "array", "minItems": 1}, {"type": "null"}]},
                    }
                },
                "CompletionRequest": {
                    "properties": {"prompt_embeds": {"anyOf": [{"type": "string"}, {"type": "null"}]}}
                },
                "AnthropicToolChoice": {"properties": {"type": {"enum": ["auto", "any", "tool", "none"]}}},
                "AnthropicMessagesRequest": {"properties": {}},
                "AnthropicContentBlock": {"properties": {"type": {"enum": ["text", "image"]}}},
            }
        }
    }


def test_what_the_server_was_started_with_is_in_the_schema() -> None:
    """Without a tool parser vLLM refuses any tool_choice but none (and tools without
    one default to auto); harmony messages fail another model's template; prompt
    embeddings are off unless enabled: fresh seeds found each refused."""
    import jsonschema

    from app.vllm_routes.schema import declare_server_features

    plain = _tool_schema()
    declare_server_features(plain, tool_parsing=False, harmony=False, prompt_embeds=False, multimodal=False)
    components = plain["components"]["schemas"]
    chat = components["ChatCompletionRequest"]
    assert chat["properties"]["tool_choice"]["anyOf"] == [{"type": "string", "const": "none"}, {"type": "null"}]
    assert chat["properties"]["messages"]["items"]["anyOf"] == [{"$ref": "#/components/schemas/User"}]
    assert components["CompletionRequest"]["properties"]["prompt_embeds"]["type"] == "null"
    assert components["AnthropicToolChoice"]["properties"]["type"] == {"const": "none"}
    # A text-only model: no image part, no image block; no embedding part unless enabled.
    assert chat["properties"]["content"]["items"]["anyOf"] == [{"$ref": "#/T"}]
    assert components["AnthropicContentBlock"]["properties"]["type"]["enum"] == ["text"]
    rules = jsonschema.Draft202012Validator({"allOf": chat["allOf"]})
    assert not rules.is_valid({"tools": [{}]}) and rules.is_valid({"tools": [{}], "tool_choice": None})
    assert rules.is_valid({}) and rules.is_valid({"tools": None})
    anthropic = jsonschema.Draft202012Validator({"allOf": components["AnthropicMessagesRequest"]["allOf"]})
    added = {"role": "system", "content": [{"type": "tool_addition"}]}
    assert not anthropic.is_valid({"tools": [{}]}) and not anthropic.is_valid({"messages": [added]})
    assert anthropic.is_valid({"tools": [{}], "tool_choice": {"type": "none"}}) and anthropic.is_valid({})
    assert not anthropic.is_valid({"tools": []})  # an empty list is a list: vLLM's default is then auto
    # A server with a parser, on a harmony model, with embeddings on: the schema as vLLM's.
    full = _tool_schema()
    declare_server_features(full, tool_parsing=True, harmony=True, prompt_embeds=True, multimodal=True)
    with_parser = jsonschema.Draft202012Validator(
        {"allOf": full["components"]["schemas"]["ChatCompletionRequest"].pop("allOf")}
    )
    assert full == _tool_schema()
    # With a parser the tool rule is the other way round: a tool_choice but none needs
    # tools (round 22, "When using `tool_choice`, `tools` must be set").
    assert not with_parser.is_valid({"tool_choice": "auto"}) and not with_parser.is_valid({"tool_choice": {"x": 1}})
    assert with_parser.is_valid({"tool_choice": "auto", "tools": [{}]}) and with_parser.is_valid(
        {"tool_choice": "none"}
    )
    assert with_parser.is_valid({"tools": [{}]}) and with_parser.is_valid({})


def test_rules_between_fields_found_by_the_eleventh_round_are_in_the_schema() -> None:
    """Each was a schema-valid body refused by vLLM in ten fresh seeds of ten. Oracle:
    the patched schema, read by a JSON Schema validator, against the refused bodies and
    their accepted neighbours (vLLM's validators, read in its source, say which)."""
    import jsonschema

    from app.vllm_routes.schema import declare_model_limits

    text_or_list = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
    schema: dict[str, Any] = {
        "components": {
            "schemas": {
                "ChatCompletionRequest": {
                    "properties": {"response_format": {"anyOf": [{"$ref": "#/R"}, {"type": "null"}]}}
                },
                "BatchChatCompletionRequest": {"properties": {"response_format": {"anyOf": [{}, {"type": "null"}]}}},
                "CompletionRequest": {"properties": {}},
                "ResponsesCreateRequest": {"properties": {"stop": copy.deepcopy(text_or_list)}},
                "CustomChatCompletionContentSimpleAudioParam": {"properties": {"audio_url": {"type": "string"}}},
                "CustomToolParam": {
                    "properties": {"format": {"anyOf": [{"$ref": "#/T"}, {"$ref": "#/components/schemas/Grammar"}]}}
                },
                "AnthropicMessagesRequest": {
                    "properties": {
                        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#/B"}}]}
                    }
                },
                "GenerativeScoringRequest": {
                    "properties": {"label_token_ids": {"type": "array", "items": {"type": "integer"}}}
                },
            }
        }
    }
    declare_vllm_input_rules(schema)
    declare_model_limits(schema, 732, 2048)
    components = schema["components"]["schemas"]

    def valid(name: str, body: dict[str, Any]) -> bool:
        return jsonschema.Draft202012Validator({"allOf": components[name]["allOf"]}).is_valid(body)

    assert not valid("ChatCompletionRequest", {"stream_options": {"include_usage": True}})
    assert valid("ChatCompletionRequest", {"stream_options": {"include_usage": True}, "stream": True})
    assert valid("ChatCompletionRequest", {"stream_options": {}})  # vLLM reads {} as unset
    assert not valid("ChatCompletionRequest", {"logprob_token_ids": [1]})
    assert not valid("ChatCompletionRequest", {"top_logprobs": 2, "logprobs": False})
    assert valid("ChatCompletionRequest", {"top_logprobs": 0}) and valid(
        "ChatCompletionRequest", {"logprob_token_ids": []}
    )
    assert not valid("BatchChatCompletionRequest", {"logprob_token_ids": [1], "logprobs": False})
    assert not valid("CompletionRequest", {"logprob_token_ids": [1]})
    assert valid("CompletionRequest", {"logprob_token_ids": [1], "logprobs": 0})
    assert not valid("CompletionRequest", {"suffix": "x", "truncate_prompt_tokens": 5})
    assert not valid("CompletionRequest", {"suffix": "x", "echo": True})
    assert valid("CompletionRequest", {"suffix": "x", "echo": False}) and valid(
        "CompletionRequest", {"suffix": None, "echo": True}
    )
    # A batch's response format is a chat request's; a part without a type carries its key.
    assert components["BatchChatCompletionRequest"]["properties"]["response_format"]["anyOf"][0] == {"$ref": "#/R"}
    assert components["CustomChatCompletionContentSimpleAudioParam"]["required"] == ["audio_url"]
    assert components["CustomToolParam"]["properties"]["format"]["anyOf"] == [{"$ref": "#/T"}]
    system_blocks = components["AnthropicMessagesRequest"]["properties"]["system"]["anyOf"][1]["items"]
    assert not jsonschema.Draft202012Validator(system_blocks["allOf"][1]).is_valid({"type": "tool_addition"})
    # Responses take a stop of "" as none; an empty string in a list is refused everywhere.
    stop = components["ResponsesCreateRequest"]["properties"]["stop"]["anyOf"]
    assert "minLength" not in stop[0] and stop[1]["items"]["minLength"] == 1
    assert components["GenerativeScoringRequest"]["properties"]["label_token_ids"]["items"]["maximum"] == 731


def test_logit_bias_names_token_ids_below_the_vocabulary() -> None:
    """vLLM takes int() of each key and refuses ids out of the vocabulary (a batch with
    a key that is no number was refused in a fresh seed). Oracle: every integer around
    the bound, against the pattern."""
    from app.vllm_routes.schema import decimal_below, declare_model_limits

    for vocab in (1, 10, 732, 49152):
        pattern = re.compile(decimal_below(vocab))
        assert [i for i in range(vocab * 2 + 20) if pattern.match(str(i))] == list(range(vocab))
        assert not pattern.match("x") and not pattern.match("-1") and not pattern.match("")
    schema: dict[str, Any] = {
        "components": {
            "schemas": {
                "BatchChatCompletionRequest": {
                    "properties": {
                        "logit_bias": {
                            "anyOf": [{"type": "object", "additionalProperties": {"type": "number"}}, {"type": "null"}]
                        }
                    }
                }
            }
        }
    }
    declare_model_limits(schema, 732, 2048)
    bias = schema["components"]["schemas"]["BatchChatCompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]
    assert bias["propertyNames"] == {"pattern": decimal_below(732)}


def test_the_twelfth_rounds_findings_are_in_the_schema() -> None:
    """Refused in seven fresh seeds of ten: negative logprob counts, prompt logprobs on a
    stream, a required Responses tool without tools, a file part and an assistant's
    custom tool call (vLLM's chat parser takes neither). Accepted while the schema
    refused it: a thinking part without its text, which the strict pass now refuses."""
    import jsonschema

    from app.vllm_routes.schema import declare_filled_in_fields

    file_part, custom_call = (
        {"$ref": "#/components/schemas/File"},
        {"$ref": "#/components/schemas/ChatCompletionMessageCustomToolCallParam"},
    )
    schema: dict[str, Any] = {
        "components": {
            "schemas": {
                "CompletionRequest": {"properties": {"logprobs": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
                "ChatCompletionRequest": {
                    "properties": {"top_logprobs": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}
                },
                "ChatCompletionUserMessageParam": {
                    "properties": {"content": {"items": {"anyOf": [{"$ref": "#/T"}, file_part]}}}
                },
                "ChatCompletionAssistantMessageParam": {
                    "properties": {"tool_calls": {"items": {"anyOf": [{"$ref": "#/F"}, custom_call]}}}
                },
                "ResponsesCreateRequest": {"properties": {}},
                "CustomThinkCompletionContentParam": {
                    "required": ["thinking", "type"],
                    "properties": {"closed": {"type": "boolean"}},
                },
            }
        }
    }
    declare_vllm_input_rules(schema)
    declare_filled_in_fields(schema)
    components = schema["components"]["schemas"]
    assert components["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0]["minimum"] == -1
    assert components["ChatCompletionRequest"]["properties"]["top_logprobs"]["anyOf"][0]["minimum"] == -1
    # Up to the engine's max_logprobs; -1 (the vocabulary) only where that is no more.
    from app.vllm_routes.schema import declare_model_limits

    declare_model_limits(schema, 732, 2048, max_logprobs=20)
    assert components["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 20,
    }
    assert components["ChatCompletionUserMessageParam"]["properties"]["content"]["items"]["anyOf"] == [{"$ref": "#/T"}]
    assert components["ChatCompletionAssistantMessageParam"]["properties"]["tool_calls"]["items"]["anyOf"] == [
        {"$ref": "#/F"}
    ]
    # A thinking part is as its model says: the strict pass now refuses one that is not
    # (app.vllm_routes.routes.typed_part_errors), where vLLM's union of parts took any object.
    assert components["CustomThinkCompletionContentParam"]["required"] == ["thinking", "type"]
    assert components["CustomThinkCompletionContentParam"]["properties"]["closed"] == {"type": "boolean"}
    chat = jsonschema.Draft202012Validator({"allOf": components["ChatCompletionRequest"]["allOf"]})
    assert not chat.is_valid({"stream": True, "prompt_logprobs": 2}) and chat.is_valid(
        {"stream": True, "prompt_logprobs": 0}
    )
    responses = jsonschema.Draft202012Validator({"allOf": components["ResponsesCreateRequest"]["allOf"]})
    assert not responses.is_valid({"tool_choice": "required", "tools": []})
    assert responses.is_valid({"tool_choice": "required", "tools": [{}]}) and responses.is_valid(
        {"tool_choice": "auto"}
    )


def test_the_thirteenth_rounds_findings_are_in_the_schema() -> None:
    """Refused in fresh seeds: output token counts below 1 or beyond the model's length
    (a completion may ask for 0 with echo), more than one choice in a batch, and a
    chat continuing its last message while add_generation_prompt kept its default."""
    import jsonschema

    from app.vllm_routes.schema import declare_model_limits

    integer = {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    schema: dict[str, Any] = {
        "components": {
            "schemas": {
                "ChatCompletionRequest": {
                    "properties": {
                        "max_completion_tokens": copy.deepcopy(integer),
                        "min_p": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                    }
                },
                "BatchChatCompletionRequest": {"properties": {"n": copy.deepcopy(integer)}},
                "CompletionRequest": {
                    "properties": {
                        "max_tokens": copy.deepcopy(integer),
                        "prompt": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}]},
                    }
                },
                "TokenizeChatRequest": {"properties": {}},
            }
        }
    }
    declare_vllm_input_rules(schema)
    declare_model_limits(schema, 732, 2048)
    components = schema["components"]["schemas"]
    assert components["ChatCompletionRequest"]["properties"]["max_completion_tokens"]["anyOf"][0] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 2048,
    }
    assert components["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 2048,
    }  # round 24: "cannot be greater than max_model_len"
    assert components["BatchChatCompletionRequest"]["properties"]["n"]["anyOf"][0] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 1,
    }
    # Round 16: min_p in [0, 1]; a prompt of strings holds no empty one (no tokens).
    assert components["ChatCompletionRequest"]["properties"]["min_p"]["anyOf"][0] == {
        "type": "number",
        "minimum": 0,
        "maximum": 1,
    }
    strings = components["CompletionRequest"]["properties"]["prompt"]["anyOf"][0]
    assert strings["items"] == {"type": "string", "minLength": 1}
    completion = jsonschema.Draft202012Validator({"allOf": components["CompletionRequest"]["allOf"]})
    assert not completion.is_valid({"max_tokens": 0}) and completion.is_valid({"max_tokens": 0, "echo": True})
    for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
        rules = jsonschema.Draft202012Validator({"allOf": components[name]["allOf"]})
        assert not rules.is_valid({"continue_final_message": True})  # the default generation prompt is true
        assert rules.is_valid({"continue_final_message": True, "add_generation_prompt": False})


def _responses_schema(tool_parsing: bool) -> dict[str, Any]:
    from app.api.responses.protocol import declare_stored_response_rules

    string_or_list = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
    anything = {"anyOf": [{"type": "string"}, {"type": "array"}, {"type": "null"}]}
    schema: dict[str, Any] = {
        "paths": {"/v1/responses": {"post": {"requestBody": {"content": {"application/json": {"schema": {}}}}}}},
        "components": {
            "schemas": {
                "ResponsesCreateRequest": {
                    "type": "object",
                    "properties": {
                        "stop": string_or_list,
                        "input": anything,
                        "tools": copy.deepcopy(anything),
                        "store": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
                        "background": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
                    },
                },
                # vLLM's input item types, as its schema has them (a multimodal model's parts).
                "EasyInputMessageParam": {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {
                        "role": {"type": "string"},
                        "content": {
                            "anyOf": [
                                {"type": "string"},
                                {
                                    "type": "array",
                                    "items": {
                                        "anyOf": [
                                            {"$ref": "#/components/schemas/ResponseInputTextParam"},
                                            {"$ref": "#/I"},
                                        ]
                                    },
                                },
                            ]
                        },
                    },
                },
                "ResponseInputTextParam": {
                    "type": "object",
                    "required": ["type", "text"],
                    "properties": {"type": {"const": "input_text"}, "text": {"type": "string"}},
                },
                "ResponseFunctionToolCallParam": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"const": "function_call"}, "status": {"enum": ["completed"]}},
                },
                # ... and the SDK's output model, as a response returned the call (status null).
                "ResponseFunctionToolCall": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"const": "function_call"},
                        "status": {"anyOf": [{"enum": ["completed"]}, {"type": "null"}]},
                    },
                },
                "FunctionCallOutput": {
                    "type": "object",
                    "required": ["type", "output"],
                    "properties": {
                        "type": {"const": "function_call_output"},
                        "call_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                        "output": {
                            "anyOf": [
                                {"type": "string"},
                                {
                                    "type": "array",
                                    "items": {
                                        "anyOf": [
                                            {"$ref": "#/components/schemas/ResponseInputTextParam"},
                                            {"$ref": "#/I"},
                                        ]
                                    },
                                },
                            ]
                        },
                    },
                },
                "I": {"type": "object", "properties": {"type": {"const": "input_image"}}, "required": ["type"]},
                "FunctionTool": {"type": "object", "properties": {"type": {"const": "function"}}, "required": ["type"]},
                **{
                    name: {
                        "type": "object",
                        "properties": {
                            "type": {"const": "reasoning"},
                            "encrypted_content": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                        },
                    }
                    for name in ("ResponseReasoningItemParam", "ResponseReasoningItem")
                },
            }
        },
    }
    declare_stored_response_rules(schema, tool_parsing=tool_parsing)
    return schema


def test_a_responses_body_is_stored_or_stateless_each_with_what_its_handler_takes() -> None:
    """A stored response (a session) refuses what vLLM's handler takes (stop strings,
    input items but text messages and function calls, tools but function tools): the
    body is one of two, told apart as app/api/responses/api_router.py tells them. Oracle:
    the published body, read by a JSON Schema validator, on each side of the split."""
    import jsonschema

    from app.api.responses.protocol import STATELESS_BODY

    def validator(schema: dict[str, Any]) -> Any:
        body = schema["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return jsonschema.Draft202012Validator({**body, "components": schema["components"]})

    schema = _responses_schema(tool_parsing=True)
    assert STATELESS_BODY in schema["components"]["schemas"]
    valid = validator(schema).is_valid
    web_search = [{"type": "web_search"}]
    assert not valid({"stop": ["x"]}) and valid({"stop": ["x"], "store": False})  # vLLM's handler takes stop strings
    assert not valid({"stop": ["x"], "store": False, "previous_response_id": "resp_1"})  # a chain is a session's
    assert not valid({"stop": ["x"], "store": False, "generate": False})  # so is a warm-up
    assert not valid({"tools": web_search}) and valid({"tools": web_search, "store": False})
    assert valid({"tools": [{"type": "function"}]}) and valid({"input": [{"role": "user", "content": "hi"}]})
    assert not valid({"input": [{"type": "reasoning"}]}) and valid({"input": [{"type": "reasoning"}], "store": False})
    # A chain or a conversation, not both (the route's own 400; a no-parser fuzzing seed).
    assert not valid({"previous_response_id": "resp_1", "conversation": "conv_1"})
    assert valid({"previous_response_id": "resp_1", "conversation": None}) and valid({"conversation": {"id": "c"}})
    # vLLM's handler answers background only when stored, and fails on a null one (found by fuzzing).
    assert valid({"background": None}) and valid({"background": False, "store": False})
    assert not valid({"background": None, "store": False}) and not valid({"background": True, "store": False})
    # vLLM's handler converts a reasoning item only without encrypted content (found by fuzzing),
    # either item model.
    for name in ("ResponseReasoningItemParam", "ResponseReasoningItem"):
        item = jsonschema.Draft202012Validator(schema["components"]["schemas"][name]).is_valid
        for content, taken in (("abc", False), ("", True), (None, True)):
            assert item({"type": "reasoning", "summary": [], "encrypted_content": content}) is taken, (name, content)
    # vLLM's item types, narrowed to what a session converts (a fresh seed found a tool
    # output's "text" part valid by the schema): text parts, a call id, a string id.
    text, image = {"type": "input_text", "text": "x"}, {"type": "input_image"}
    assert valid({"input": [{"role": "user", "content": [text], "id": "msg_1"}]})
    assert not valid({"input": [{"role": "user", "content": "hi", "id": {}}]})
    assert not valid({"input": [{"role": "user", "content": [image]}]})
    assert valid({"input": [{"role": "user", "content": [image]}], "store": False})
    output = {"type": "function_call_output", "call_id": "call_1", "output": [text]}
    assert valid({"input": [output]}) and not valid({"input": [{**output, "call_id": None}]})
    assert not valid({"input": [{**output, "output": [{"type": "text", "text": "x"}]}]})
    assert not valid({"input": [{**output, "output": [image]}]})
    assert valid({"input": [{"type": "function_call", "status": None}]})  # vLLM takes the output model's form
    assert not valid({"text": {"format": {}}}) and valid({"text": {"format": {"type": "text"}}})  # round 28
    # Something to render (round 26: an empty input, "Cannot apply chat template to an empty conversation").
    assert not valid({"input": []}) and not valid({"input": [], "store": False})
    assert valid({"input": [], "instructions": "Be brief."}) and valid({"input": [], "previous_response_id": "resp_1"})
    assert valid({"input": ""}) and valid({"input": [], "instructions": "x", "store": False})
    # A session's reply honours a mode or a function (round 21 sent it another kind).
    assert valid({"tool_choice": "required", "tools": [{"type": "function"}]})
    assert valid({"tool_choice": {"type": "function", "name": "f"}})
    assert not valid({"tool_choice": {"type": "function", "name": ""}})
    assert not valid({"tool_choice": {"type": "programmatic_tool_calling"}})
    assert valid({"tool_choice": {"type": "programmatic_tool_calling"}, "store": False})
    assert not valid({"prompt": {"id": "pmpt_1"}, "store": False})  # neither handler takes prompt templates
    # Without a tool-call parser a session takes no tools at all.
    without_parser = validator(_responses_schema(tool_parsing=False)).is_valid
    assert not without_parser({"tools": [{"type": "function"}]}) and without_parser({"tools": []})
    assert not valid({"tools": None}) and not without_parser({"tools": None})  # a list: vLLM's model (round 23)


def test_the_seventeenth_rounds_findings_are_in_the_schema() -> None:
    """Refused in fresh seeds: penalties beyond [-2, 2], repetition detection with a
    negative size or a pattern counted fewer than twice, a stateless response asking for
    more than the model's length, a stored one more than a chunk's cap."""
    import jsonschema

    from app.sessions.inputs import declare_bounds
    from app.vllm_routes.schema import declare_model_limits

    number = {"anyOf": [{"type": "number"}, {"type": "null"}]}
    output = {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}
    schema: dict[str, Any] = {
        "components": {
            "schemas": {
                "ChatCompletionRequest": {"properties": {"frequency_penalty": copy.deepcopy(number)}},
                "RepetitionDetectionParams": {
                    "properties": {
                        "max_pattern_size": {"type": "integer"},
                        "min_pattern_size": {"type": "integer"},
                        "min_count": {"type": "integer"},
                    }
                },
                "ResponsesCreateRequest": {"properties": {"max_output_tokens": copy.deepcopy(output)}},
                "StatelessResponsesCreateRequest": {"properties": {"max_output_tokens": copy.deepcopy(output)}},
            }
        }
    }
    declare_vllm_input_rules(schema)
    declare_model_limits(schema, 732, 2048)
    declare_bounds(schema, vocab_size=732, max_output_tokens=16, max_chunk_tokens=256)
    components = schema["components"]["schemas"]
    assert components["ChatCompletionRequest"]["properties"]["frequency_penalty"]["anyOf"][0] == {
        "type": "number",
        "minimum": -2,
        "maximum": 2,
    }
    detection = jsonschema.Draft202012Validator(components["RepetitionDetectionParams"])
    assert not detection.is_valid({"max_pattern_size": -1}) and not detection.is_valid({"max_pattern_size": 3})
    assert detection.is_valid({"max_pattern_size": 3, "min_count": 2}) and detection.is_valid({})
    assert components["ResponsesCreateRequest"]["properties"]["max_output_tokens"]["anyOf"][0]["maximum"] == 16
    assert (
        components["StatelessResponsesCreateRequest"]["properties"]["max_output_tokens"]["anyOf"][0]["maximum"] == 2048
    )


def test_the_eighteenth_rounds_findings_are_in_the_schema() -> None:
    """Refused in fresh seeds: a Responses message's file part (vLLM's chat parser takes
    none); a batch's deprecated max_tokens below 1 where max_completion_tokens is unset
    (SamplingParams takes at least 1; a chat request's too, round 23)."""
    import jsonschema
    from vllm.exceptions import VLLMValidationError

    from app.vllm_routes.sampling import check_sampling
    from app.vllm_routes.schema import declare_model_limits

    file_part = {"$ref": "#/components/schemas/ResponseInputFileParam"}
    output_file = {"$ref": "#/components/schemas/ResponseInputFileContentParam"}
    schema: dict[str, Any] = {
        "components": {
            "schemas": {
                "ChatCompletionRequest": {
                    "properties": {"min_tokens": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}
                },
                "BatchChatCompletionRequest": {
                    "properties": {"max_tokens": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}
                },
                "EasyInputMessageParam": {
                    "properties": {"content": {"items": {"anyOf": [{"$ref": "#/T"}, file_part]}}}
                },
                "ResponseCustomToolCallOutputParam": {
                    "properties": {
                        "output": {
                            "anyOf": [
                                {"type": "string"},
                                {"type": "array", "items": {"anyOf": [{"$ref": "#/T"}, output_file]}},
                            ]
                        }
                    }
                },
            }
        }
    }
    declare_vllm_input_rules(schema)
    declare_model_limits(schema, 732, 2048)
    components = schema["components"]["schemas"]
    chat = jsonschema.Draft202012Validator({"allOf": components["ChatCompletionRequest"]["allOf"]})
    assert chat.is_valid({"logprob_token_ids": [1], "logprobs": True})
    # A chat request's deprecated max_tokens from 1; vLLM takes less beside
    # max_completion_tokens, which the strict pass refuses too (round 23).
    batch = jsonschema.Draft202012Validator(components["BatchChatCompletionRequest"]["properties"]["max_tokens"])
    assert not batch.is_valid(0) and batch.is_valid(1) and batch.is_valid(None)
    for body in ({"messages": [], "max_tokens": 0}, {"messages": [[]], "max_tokens": -3, "max_completion_tokens": 5}):
        with pytest.raises(VLLMValidationError, match="max_tokens must be at least 1"):
            check_sampling(body)
    check_sampling({"messages": [], "max_tokens": 1})
    with pytest.raises(VLLMValidationError, match="cannot be greater than max_model_len=2048"):
        check_sampling({"messages": [], "max_tokens": 2049, "max_completion_tokens": 2}, 2048)
    check_sampling({"messages": [], "max_tokens": 2048, "max_completion_tokens": 2}, 2048)
    check_sampling({"prompt": "x", "max_tokens": 0, "echo": True})  # a completion's: 0 with echo
    assert components["EasyInputMessageParam"]["properties"]["content"]["items"]["anyOf"] == [{"$ref": "#/T"}]
    # Round 19: a tool output's file part, and min_tokens below 0.
    output = components["ResponseCustomToolCallOutputParam"]["properties"]["output"]["anyOf"][1]
    assert output["items"]["anyOf"] == [{"$ref": "#/T"}]
    assert components["ChatCompletionRequest"]["properties"]["min_tokens"]["anyOf"][0]["minimum"] == 0


def test_the_twentieth_rounds_findings_are_in_the_schema() -> None:
    """The first rounds with a tool parser (more bodies reach the engine's checks) found
    refused: a temperature beyond SamplingParams' [0, 2] (Anthropic, /invocations), a
    streamed completion with beam search, n beyond vLLM's limit, a returned tool output's
    file part. Oracle: the patched schema, read by a JSON
    Schema validator, against the refused bodies and their accepted neighbours."""
    import jsonschema
    import vllm.envs

    from app.vllm_routes.schema import declare_server_features

    number = {"anyOf": [{"type": "number"}, {"type": "null"}]}
    parts = {
        "anyOf": [
            {"$ref": "#/components/schemas/ResponseInputText"},
            {"$ref": "#/components/schemas/ResponseInputImage"},
            {"$ref": "#/components/schemas/ResponseInputFile"},
        ]
    }
    schema: dict[str, Any] = {
        "components": {
            "schemas": {
                **{
                    name: {
                        "properties": {
                            "temperature": copy.deepcopy(number),
                            "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                            "top_k": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                            "stop_sequences": {
                                "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]
                            },
                            "suffix": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                        }
                    }
                    for name in ("AnthropicMessagesRequest", "ChatCompletionRequest", "CompletionRequest")
                },
                "ResponseFunctionToolCallOutputItem": {"properties": {"output": {"type": "array", "items": parts}}},
                "ChatCompletionNamedFunction": {"properties": {"name": {"type": "string"}}},
            }
        }
    }
    declare_vllm_input_rules(schema)
    declare_server_features(schema, tool_parsing=True, harmony=False, prompt_embeds=False, multimodal=False)
    components = schema["components"]["schemas"]
    # Round 21: n up to vLLM's VLLM_MAX_N_SEQUENCES; a returned tool output's file part
    # (vLLM's chat parser takes none) and, on a text-only model, its image part.
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        assert components[name]["properties"]["n"]["anyOf"][0]["maximum"] == vllm.envs.VLLM_MAX_N_SEQUENCES
    assert components["ResponseFunctionToolCallOutputItem"]["properties"]["output"]["items"]["anyOf"] == [
        {"$ref": "#/components/schemas/ResponseInputText"}
    ]
    # Round 23: a named tool choice names a function ("Invalid `name`" for "").
    assert components["ChatCompletionNamedFunction"]["properties"]["name"]["minLength"] == 1
    # Round 28: no suffix where the model renders no fill-in-the-middle (the tiny model's).
    assert components["CompletionRequest"]["properties"]["suffix"] == {"type": "null"}
    # Round 24: top_k from -1 (all); Anthropic's stop sequences hold no empty string.
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        assert components[name]["properties"]["top_k"]["anyOf"][0]["minimum"] == -1
    assert components["AnthropicMessagesRequest"]["properties"]["top_k"]["anyOf"][0]["minimum"] == 0  # its own
    assert components["AnthropicMessagesRequest"]["properties"]["stop_sequences"]["anyOf"][0]["items"]["minLength"] == 1
    for name in ("AnthropicMessagesRequest", "ChatCompletionRequest", "CompletionRequest"):
        temperature = jsonschema.Draft202012Validator(components[name]["properties"]["temperature"])
        assert temperature.is_valid(0) and temperature.is_valid(2) and temperature.is_valid(None)
        assert not temperature.is_valid(-0.5) and not temperature.is_valid(2.5)
    completion = jsonschema.Draft202012Validator({"allOf": components["CompletionRequest"]["allOf"]})
    assert not completion.is_valid({"stream": True, "use_beam_search": True})
    assert completion.is_valid({"use_beam_search": True}) and completion.is_valid({"stream": True})
    chat = jsonschema.Draft202012Validator({"allOf": components["ChatCompletionRequest"]["allOf"]})
    assert chat.is_valid({"stream": True, "use_beam_search": True})  # only the completion route refuses it


def test_a_structured_outputs_json_object_is_true_or_absent() -> None:
    """A fresh fuzzing seed on an EPYC machine (2026-12-04): a batch chat with
    ``structured_outputs: {"json_object": false}``, schema-valid, refused by vLLM's
    SamplingParams ("must be True if set"), as on every route that takes structured
    outputs. Oracle: the patched schema, read by a JSON Schema validator; that vLLM
    refuses false is in its own source, read here, so a vLLM that takes it fails this."""
    import inspect

    import jsonschema
    from vllm.sampling_params import SamplingParams

    assert "json_object is False" in inspect.getsource(SamplingParams)
    flag = {"anyOf": [{"type": "boolean"}, {"type": "null"}]}
    schema: dict[str, Any] = {
        "components": {"schemas": {"StructuredOutputsParams": {"properties": {"json_object": copy.deepcopy(flag)}}}}
    }
    declare_vllm_input_rules(schema)
    json_object = jsonschema.Draft202012Validator(
        schema["components"]["schemas"]["StructuredOutputsParams"]["properties"]["json_object"]
    )
    assert json_object.is_valid(True) and json_object.is_valid(None)
    assert not json_object.is_valid(False)


def test_numbers_vllm_sends_its_engine_core_in_extra_args_fit_messagepack() -> None:
    """Fuzzing (2026-12-04), seven of seven fresh seeds with the hermes parser: a chat whose
    ``ec_transfer_params`` held an integer beyond 64 bits, schema-valid, refused by vLLM
    ("extra_args integers must be between -2**63 and 2**64 - 1"). Oracle: vLLM's own
    SamplingParams on each value's integers, against the published schema and the
    server's check (app.vllm_routes.sampling.check_sampling), which must agree on every body;
    a number that is not an integer, the schema bounds as JSON Schema must (an integral
    float is an integer to it), and the server's check refuses the same."""
    import jsonschema
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    from app.vllm_routes.sampling import check_sampling

    free = {"anyOf": [{"type": "object", "additionalProperties": True}, {"type": "null"}]}
    scalar = [{"type": "string"}, {"type": "integer"}, {"type": "number"}]
    xargs = {
        "anyOf": [
            {
                "type": "object",
                "additionalProperties": {
                    "anyOf": [*copy.deepcopy(scalar), {"type": "array", "items": {"anyOf": copy.deepcopy(scalar)}}]
                },
            },
            {"type": "null"},
        ]
    }
    schema: dict[str, Any] = {
        "components": {
            "schemas": {
                "ChatCompletionRequest": {
                    "properties": {
                        "kv_transfer_params": copy.deepcopy(free),
                        "ec_transfer_params": free,
                        "vllm_xargs": xargs,
                    }
                }
            }
        }
    }
    declare_vllm_input_rules(schema)
    valid = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/ChatCompletionRequest", **schema}).is_valid
    for value in (2**64 - 1, -(2**63), 2**64, -(2**63) - 1, 2**70, [1, {"a": 2**64}], {"b": "x", "c": [True, None]}):
        for field in ("kv_transfer_params", "ec_transfer_params", "vllm_xargs"):
            if field == "vllm_xargs" and isinstance(value, dict):
                continue  # vLLM's model takes no object inside vllm_xargs
            try:
                SamplingParams(extra_args={field: {"k": value}})
                vllm_takes = True
            except VLLMValidationError:
                vllm_takes = False
            try:
                check_sampling({field: {"k": value}})
                we_take = True
            except VLLMValidationError:
                we_take = False
            assert valid({field: {"k": value}}) is vllm_takes is we_take, (field, value)
    for number in (2e19, 1e30, -1e19):
        body = {"kv_transfer_params": {"k": number}}
        with pytest.raises(VLLMValidationError):
            check_sampling(body)
        assert not valid(body), number
    assert valid({"kv_transfer_params": {"k": 1.5}}) and valid({"vllm_xargs": {"k": [0.5, "x"]}})


def test_free_form_transfer_params_nest_as_deep_as_the_schema_says() -> None:
    """Fuzzing (2026-12-04): every fresh seed over /v1/messages ended in schemathesis's "Cannot
    generate an array with 1 demanded elements", from the recursive schema of the
    free-form transfer params' values; the schema now writes out two levels of arrays
    and objects, and the server refuses deeper ones (vLLM would take them; no connector
    here reads these fields). Oracle: the published rule and the server's check agree on
    every body, at and beyond the depth. (That schemathesis now generates /v1/messages'
    bodies is shown by the fuzz rounds in docs/reliability.md: a small schema with the
    recursive rule alone generated fine, so no unit test here can fail for it.)"""
    import jsonschema
    from vllm.exceptions import VLLMValidationError

    from app.vllm_routes.sampling import FREE_FORM_DEPTH, check_sampling

    schema: dict[str, Any] = {
        "components": {
            "schemas": {
                "TransferRequest": {
                    "properties": {
                        "kv_transfer_params": {
                            "anyOf": [{"type": "object", "additionalProperties": True}, {"type": "null"}]
                        }
                    }
                }
            }
        }
    }
    declare_vllm_input_rules(schema)
    assert "$ref" not in json.dumps(schema["components"]["schemas"]["TransferRequest"])
    valid = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/TransferRequest", **schema}).is_valid
    within = {"ids": [[1, 2], [3]], "o": {"p": [True]}, "q": [{"r": None}], "s": "x", "e": [[]]}
    beyond = [{"ids": [[[1]]]}, {"o": {"p": {"q": {}}}}, {"e": [[[]]]}, {"m": [{"n": [2]}]}]
    assert FREE_FORM_DEPTH == 2
    for value, takes in [(within, True), *((b, False) for b in beyond)]:
        body = {"kv_transfer_params": value}
        try:
            check_sampling(body)
            we_take = True
        except VLLMValidationError:
            we_take = False
        assert valid(body) is we_take is takes, value


def test_anthropics_thinking_budget_only_with_a_reasoning_parser() -> None:
    """Fuzzing (2026-12-04), six of nine no-parser seeds: Anthropic's ``thinking: {"type":
    "enabled", "budget_tokens": n}``, schema-valid, refused by vLLM's engine front end
    ("thinking_token_budget is set but reasoning_config is not configured"), as a chat's
    thinking_token_budget is. Oracle: that check in vLLM's own source, and the patched
    schema read by a JSON Schema validator, with and without a reasoning parser."""
    import inspect

    import jsonschema
    from vllm.v1.engine import input_processor

    assert "thinking_token_budget is set but reasoning_config is " in inspect.getsource(input_processor)
    kinds = {"enabled": "AnthropicThinkingConfigEnabled", "disabled": "AnthropicThinkingConfigDisabled"}
    for reasoning in (False, True):
        schema: dict[str, Any] = {
            "components": {
                "schemas": {
                    "AnthropicMessagesRequest": {
                        "properties": {
                            "thinking": {
                                "anyOf": [
                                    {
                                        "oneOf": [{"$ref": f"#/components/schemas/{name}"} for name in kinds.values()],
                                        "discriminator": {
                                            "propertyName": "type",
                                            "mapping": {
                                                kind: f"#/components/schemas/{name}" for kind, name in kinds.items()
                                            },
                                        },
                                    },
                                    {"type": "null"},
                                ]
                            }
                        }
                    },
                    **{
                        name: {"type": "object", "properties": {"type": {"const": kind}}, "required": ["type"]}
                        for kind, name in kinds.items()
                    },
                }
            }
        }
        declare_vllm_input_rules(schema, reasoning=reasoning)
        thinking = schema["components"]["schemas"]["AnthropicMessagesRequest"]["properties"]["thinking"]
        valid = jsonschema.Draft202012Validator({**thinking, **schema}).is_valid
        assert valid({"type": "enabled", "budget_tokens": 2048}) is reasoning
        assert valid({"type": "disabled"}) and valid(None)
        mapping = schema["components"]["schemas"]["AnthropicMessagesRequest"]["properties"]["thinking"]["anyOf"][0][
            "discriminator"
        ]["mapping"]
        assert ("enabled" in mapping) is reasoning  # no mapping to a variant the union lost


def test_the_stateless_body_offers_the_input_items_vllm_converts() -> None:
    """Round 22 (a fresh seed): vLLM's Responses handler refused an `mcp_approval_response`
    item ("Unsupported input item type"); off a harmony model it converts messages (any
    item with a role where pydantic leaves it a dict, which the schema cannot say), function
    and custom tool calls and their outputs, reasoning."""
    from app.api.responses.protocol import STATELESS_BODY, declare_stored_response_rules

    def schema() -> dict[str, Any]:
        kinds = {"Mcp": "mcp_approval_response", "Call": "function_call", "Reasoning": "reasoning"}
        return {
            "paths": {"/v1/responses": {"post": {"requestBody": {"content": {"application/json": {"schema": {}}}}}}},
            "components": {
                "schemas": {
                    "ResponsesCreateRequest": {
                        "type": "object",
                        "properties": {
                            "stop": {"type": "null"},
                            "input": {
                                "anyOf": [
                                    {"type": "string"},
                                    {
                                        "type": "array",
                                        "items": {
                                            "anyOf": [
                                                {"$ref": f"#/components/schemas/{name}"}
                                                for name in (*kinds, "Reference", "Tools")
                                            ]
                                        },
                                    },
                                ]
                            },
                        },
                    },
                    **{name: {"properties": {"type": {"const": kind}}} for name, kind in kinds.items()},
                    "Reference": {"properties": {"type": {"anyOf": [{"const": "item_reference"}, {"type": "null"}]}}},
                    "Tools": {"properties": {"type": {"const": "additional_tools"}}, "required": ["role"]},
                }
            },
        }

    def offered(harmony: bool) -> list[str]:
        raw = schema()
        declare_stored_response_rules(raw, harmony=harmony)
        items = raw["components"]["schemas"][STATELESS_BODY]["properties"]["input"]["anyOf"][1]["items"]["anyOf"]
        return [ref["$ref"].split("/")[-1] for ref in items]

    assert offered(harmony=False) == ["Call", "Reasoning"]  # additional_tools, role and all: round 25
    assert offered(harmony=True) == ["Mcp", "Call", "Reasoning", "Reference", "Tools"]


def rule_disagreements(request_model: Any, component: str, bodies: Any) -> list[tuple[dict[str, Any], bool]]:
    """The bodies on which ``component``'s published rules between fields
    (CROSS_FIELD_RULES, read by a JSON Schema validator) and what the server runs on a
    body disagree, with whether the server takes it: vLLM's request validation,
    app.vllm_routes.sampling.check_sampling, then the handler's sampling or beam search
    parameters."""
    import jsonschema
    from pydantic import ValidationError
    from vllm.exceptions import VLLMValidationError

    from app.errors import APIError
    from app.vllm_routes.sampling import check_sampling
    from app.vllm_routes.schema_rules import CROSS_FIELD_RULES

    rules = jsonschema.Draft202012Validator({"allOf": CROSS_FIELD_RULES[component]})
    disagreements = []
    for body in bodies:
        try:
            request = request_model.model_validate(body)
            check_sampling(dict(body), 4096)
            (request.to_beam_search_params if body["use_beam_search"] else request.to_sampling_params)(
                body["max_tokens"], {}
            )
            accepted = True
        except (ValidationError, VLLMValidationError, APIError, ValueError):
            accepted = False
        if rules.is_valid(body) != accepted:
            disagreements.append((body, accepted))
    return disagreements


def test_a_completions_rules_between_logprobs_echo_and_beam_search_are_vllms() -> None:
    """Round 31 (a fresh seed): a completion with beam search, echo and logprobs, refused
    by vLLM's validator ("beam search does not compute prompt logprobs"); beside it, beam
    search with logprob_token_ids, and logprob_token_ids with no output (echo, max_tokens
    0), and no output without echo unless by beam search (vLLM's beams take max_tokens 0:
    answered 200). Oracle: what the server runs on the body (``rule_disagreements``) over
    every combination of the fields involved, against the completion's published rules:
    the two must agree on each body."""
    import itertools

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    bodies = (
        {
            "model": "m",
            "prompt": "hi",
            "use_beam_search": beam,
            "echo": echo,
            "logprobs": logprobs,
            "logprob_token_ids": ids,
            "max_tokens": max_tokens,
        }
        for beam, echo, logprobs, ids, max_tokens in itertools.product(
            (False, True), (False, True), (None, 1), (None, [], [5]), (0, 4)
        )
    )
    disagreements = rule_disagreements(CompletionRequest, "CompletionRequest", bodies)
    assert not disagreements, disagreements


def test_a_completions_beam_width_is_bounded_by_half_the_engines_logprobs() -> None:
    """Fuzzing (2026-12-04), a fresh seed without a tool parser: a completion with beam search and
    n 14, refused by vLLM ("Requested sample logprobs of 28, which is greater than max
    allowed: 20"): a beam search asks the engine for 2 * n logprobs a step. Oracle: that
    factor in vLLM's own beam search source, and the published completion rules (the
    cross-field rules with the model's limits) read by a JSON Schema validator."""
    import inspect

    import jsonschema
    from vllm.entrypoints.generate.beam_search import online

    from app.vllm_routes.schema import declare_model_limits
    from app.vllm_routes.schema_rules import CROSS_FIELD_RULES

    assert "logprobs_num = 2 * beam_width" in inspect.getsource(online)
    schema: dict[str, Any] = {
        "components": {
            "schemas": {
                "CompletionRequest": {"properties": {}, "allOf": copy.deepcopy(CROSS_FIELD_RULES["CompletionRequest"])}
            }
        }
    }
    declare_model_limits(schema, vocab_size=1000, max_model_len=2048, max_logprobs=20)
    valid = jsonschema.Draft202012Validator(schema["components"]["schemas"]["CompletionRequest"]).is_valid
    assert valid({"use_beam_search": True, "n": 10}) and not valid({"use_beam_search": True, "n": 11})
    assert valid({"n": 16}) and valid({"use_beam_search": False, "n": 16}) and valid({"use_beam_search": True})
    assert "'n'" not in str(CROSS_FIELD_RULES["CompletionRequest"]), "the shared rule was changed in place"


def test_a_chats_rules_between_fields_are_vllms_but_beam_searchs() -> None:
    """The chat request's published rules between streaming, logprobs, beam search and
    continuing the final message, against what the server runs on the body
    (``rule_disagreements``) over every combination of those fields. They agree but on
    one rule, left unstated because schemathesis's generator has no room for a sixth rule
    on a chat request (docs/reliability.md): beam search takes no logprob_token_ids. A
    new disagreement fails here."""
    import itertools

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    bodies = (
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": stream,
            "stream_options": options,
            "prompt_logprobs": prompt_logprobs,
            "logprobs": logprobs,
            "top_logprobs": top,
            "logprob_token_ids": ids,
            "use_beam_search": beam,
            "continue_final_message": cont,
            "add_generation_prompt": prompt,
        }
        for stream, options, prompt_logprobs, logprobs, top, ids, beam, cont, prompt in itertools.product(
            (False, True),
            (None, {"include_usage": True}),
            (None, 1),
            (False, True),
            (None, 0, 2),
            (None, [5]),
            (False, True),
            (False, True),
            (True, False),
        )
    )
    disagreements = [body for body, _ in rule_disagreements(ChatCompletionRequest, "ChatCompletionRequest", bodies)]
    assert disagreements and all(body["use_beam_search"] and body["logprob_token_ids"] for body in disagreements), (
        disagreements
    )
