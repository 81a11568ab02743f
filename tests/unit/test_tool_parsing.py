"""Tool calls read from scripted token streams with vLLM's own parsers (app/tools/parsing.py):
a parser's job needs no trained model. Three formats: Hermes/Qwen ``<tool_call>`` (the
default model's), Llama 3's JSON and Mistral's ``[TOOL_CALLS]``; each with text before a
call, two parallel calls, a call split across many deltas, and malformed JSON.

Oracle: the calls written into the scripted output. The stream's deltas (one token at a
time, and three at a time) must add up to the calls that the final extraction (the
authority) returns, and those to the calls written; malformed JSON ends as text,
flagged, never an exception.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from app.errors import APIError
from app.models.builder import ensure_model
from app.tools.parsing import OutputParser, ParsedOutput, ReplyParsers, chat_tools

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
    },
]
PARIS = ("get_weather", {"city": "Paris"})
CET = ("get_time", {"zone": "CET"})


def hermes(*calls: tuple[str, dict[str, Any]]) -> str:
    return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>' for n, a in calls)


def llama3(*calls: tuple[str, dict[str, Any]]) -> str:
    return "<|python_tag|>" + "; ".join(f'{{"name": "{n}", "parameters": {json.dumps(a)}}}' for n, a in calls)


def mistral(*calls: tuple[str, dict[str, Any]]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


FORMATS = {"hermes": hermes, "llama3_json": llama3, "mistral": mistral}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model("tiny")))
    # Each format's markers as the special tokens its models have.
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]"]}
    )
    return tokenizer


def run(tokenizer: Any, parser_name: str, output: str, step: int = 1) -> tuple[str, dict[int, list[str]], ParsedOutput]:
    """The output fed ``step`` tokens at a time: the streamed text, each streamed call's
    name and arguments, and the final extraction."""
    parser = OutputParser(tokenizer, parser_name, None, TOOLS)
    ids = tokenizer.encode(output, add_special_tokens=False)
    text, calls = "", {}
    for at in range(0, len(ids), step):
        delta_ids = ids[at : at + step]
        delta = parser.feed(
            tokenizer.decode(delta_ids, skip_special_tokens=False), delta_ids, finished=at + step >= len(ids)
        )
        text += delta.text
        for call in delta.calls:
            name_and_arguments = calls.setdefault(call.index, ["", ""])
            name_and_arguments[0] += call.name or ""
            name_and_arguments[1] += call.arguments
    return text, calls, parser.final(output, ids)


def as_written(parsed: ParsedOutput) -> list[tuple[str, dict[str, Any]]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("parser_name", FORMATS)
def test_parallel_calls_stream_as_the_final_extraction_reads_them(tokenizer: Any, parser_name: str, step: int) -> None:
    text, streamed, final = run(tokenizer, parser_name, FORMATS[parser_name](PARIS, CET), step)
    assert as_written(final) == [PARIS, CET]
    assert [(name, json.loads(arguments)) for name, arguments in streamed.values()] == [PARIS, CET]
    # Arguments as the model wrote them: the deltas add up to the final ones, string for string.
    assert [arguments for _, arguments in streamed.values()] == [call.arguments for call in final.calls]
    assert text.strip() == final.text.strip() == ""
    assert len({call.call_id for call in final.calls}) == 2 and not final.malformed


@pytest.mark.parametrize("parser_name", ["hermes", "mistral"])
def test_text_before_a_call_streams_as_text(tokenizer: Any, parser_name: str) -> None:
    text, streamed, final = run(tokenizer, parser_name, "Let me check. " + FORMATS[parser_name](PARIS))
    assert as_written(final) == [PARIS]
    assert text == final.text == "Let me check. "
    assert [name for name, _ in streamed.values()] == ["get_weather"]


def test_llama3_reads_a_call_only_at_the_start_of_the_output(tokenizer: Any) -> None:
    """Llama 3's JSON format has no text before a call: vLLM's parser streams such an
    output as text, and its final extraction still finds the call (it is the authority:
    the call is kept, the text before it is not)."""
    output = 'Let me check. {"name": "get_weather", "parameters": {"city": "Paris"}}'
    text, streamed, final = run(tokenizer, "llama3_json", output)
    assert streamed == {} and text == output
    assert as_written(final) == [PARIS] and final.text == ""


@pytest.mark.parametrize("parser_name", FORMATS)
def test_a_call_split_across_many_deltas_is_one_call(tokenizer: Any, parser_name: str) -> None:
    arguments = {"city": "Saint-Rémy-de-Provence, Bouches-du-Rhône, " + "France " * 20}
    text, streamed, final = run(tokenizer, parser_name, FORMATS[parser_name](("get_weather", arguments)))
    assert as_written(final) == [("get_weather", arguments)]
    assert len(streamed) == 1 and json.loads(streamed[0][1]) == arguments and text.strip() == ""


@pytest.mark.parametrize("parser_name", FORMATS)
def test_malformed_json_ends_as_text_never_an_exception(tokenizer: Any, parser_name: str) -> None:
    output = FORMATS[parser_name](PARIS)
    cut = output[: output.index("Paris") + 3]  # the arguments' string never closes
    _, _, final = run(tokenizer, parser_name, cut)
    assert final.calls == [] and final.malformed
    assert "Par" in final.text


def test_without_a_parser_or_with_tool_choice_none_everything_is_text(tokenizer: Any) -> None:
    output = hermes(PARIS)
    for parser in (
        OutputParser(tokenizer, None, None, TOOLS),
        OutputParser(tokenizer, "hermes", None, TOOLS, "none"),
        OutputParser(tokenizer, "hermes", None, None),
    ):
        ids = tokenizer.encode(output, add_special_tokens=False)
        assert parser.feed(output, ids, finished=True).calls == []
        assert parser.final(output, ids) == ParsedOutput(output, None, [])


def test_required_and_named_calls_get_the_grammar_of_vllms_chat_completions(tokenizer: Any) -> None:
    """Under vLLM's strict tool calling (its default), Hermes calls get a structural tag
    (the format with each tool's schema); tool_choice none gets no grammar."""
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        grammar = OutputParser(tokenizer, "hermes", None, TOOLS, choice).structured_outputs()
        assert (
            grammar is not None and "get_weather" in grammar.structural_tag and "<tool_call>" in grammar.structural_tag
        )
    assert OutputParser(tokenizer, "hermes", None, TOOLS, "none").structured_outputs() is None
    assert OutputParser(tokenizer, None, None, TOOLS, "required").structured_outputs() is None


def test_the_final_extraction_of_one_output_keeps_its_call_ids(tokenizer: Any) -> None:
    parser = OutputParser(tokenizer, "hermes", None, TOOLS)
    assert parser.final(hermes(PARIS)).calls[0].call_id == parser.final(hermes(PARIS)).calls[0].call_id


def test_tools_of_either_shape_become_chat_completions_tools() -> None:
    shaped = chat_tools(TOOLS)
    assert shaped is not None
    assert [tool["function"]["name"] for tool in shaped] == ["get_weather", "get_time"]
    assert all(tool["type"] == "function" and "parameters" in tool["function"] for tool in shaped)
    assert chat_tools(None) is None and chat_tools([]) is None


def test_a_tool_choice_a_reply_cannot_honour_is_refused_in_this_servers_shape(tokenizer: Any) -> None:
    """Fresh-seed fuzzing sent a stored response a `programmatic_tool_calling` choice:
    vLLM's chat request refused it from inside a turn, in vLLM's error shape (an integer
    code, against the published one). Refused first, by name, as OpenAI's 400."""
    parsers = ReplyParsers(tokenizer, "hermes", None)
    for choice in (
        "none",
        "auto",
        "required",
        None,
        {"type": "function", "name": "get_time"},
        {"type": "function", "function": {"name": "get_weather"}},
    ):
        assert isinstance(parsers.reply_parser(TOOLS, choice), OutputParser)
    for choice, code in (
        ({"type": "programmatic_tool_calling"}, "unsupported_parameter"),
        ("any", "unsupported_parameter"),
        ({"type": "function", "name": "nope"}, "invalid_value"),
        ({"type": "function", "function": None}, "invalid_value"),
    ):
        with pytest.raises(APIError) as refused:
            parsers.reply_parser(TOOLS, choice)
        assert (refused.value.status, refused.value.code, refused.value.param) == (400, code, "tool_choice")
    with pytest.raises(APIError, match="not found in tools"):
        parsers.reply_parser(None, {"type": "function", "name": "get_time"})
