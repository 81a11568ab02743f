"""Jump-forward over a required call's opening (app/tools/opening.py): the text the grammar
forces is prefilled with the turn, and the grammar takes the reply from there.

Oracle: vLLM's own grammar for the request (what its chat completions would decode
under), compiled by xgrammar on the test tokenizer. An output in the template's spelling
is admitted by vLLM's grammar exactly when its rest, after the opening, is admitted by
ours; and the reply read as the opening and its rest is the calls written. Negative
controls: without the opening put back, the rest alone reads as no call.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from app.models.builder import ensure_model
from app.tools.opening import forced_opening
from app.tools.parsing import OutputParser
from tests.unit.test_tool_parsing import CET, PARIS, TOOLS, hermes, llama3, tokenizer  # noqa: F401

WEATHER = {"type": "function", "name": "get_weather"}


def admits(compiler: Any, eos: int, structural_tag: str, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_structural_tag(structural_tag)))
    return matcher.accept_string(text) and matcher.accept_token(eos)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Any:  # noqa: F811
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))


CASES = [  # tools, tool_choice, parallel calls, the opening
    (TOOLS[:1], "required", True, '<tool_call>\n{"name": "get_weather", "arguments":'),
    (TOOLS, WEATHER, True, '<tool_call>\n{"name": "get_weather", "arguments":'),
    # Two functions named get_…: the name is the model's to decode, whole.
    (TOOLS, "required", True, '<tool_call>\n{"name": "'),
    (TOOLS, "required", False, '<tool_call>\n{"name": "'),
]
OUTPUTS = [
    hermes(PARIS),
    hermes(CET),
    hermes(PARIS, CET).replace("\n<tool_call>", "<tool_call>"),
    hermes(("get_weather", {"city": 3})),
    hermes(("nope", {})),
    "Paris is sunny.",
]


@pytest.mark.parametrize(("tools", "choice", "parallel", "opening"), CASES)
def test_the_rest_of_the_grammar_admits_what_vllms_admits_after_the_opening(
    tokenizer: Any,  # noqa: F811
    compiler: Any,
    tools: list[dict[str, Any]],
    choice: Any,
    parallel: bool,
    opening: str,
) -> None:
    parser = OutputParser(tokenizer, "hermes", None, tools, choice, "parameter", parallel)
    ids, rest = parser.answer([7, 8])
    vllm_grammar = parser.structured_outputs().structural_tag
    assert ids == [7, 8, *tokenizer.encode(opening, add_special_tokens=False)]
    admitted = 0
    for output in OUTPUTS:
        ours = output.startswith(opening) and admits(
            compiler, tokenizer.eos_token_id, rest.structural_tag, output[len(opening) :]
        )
        assert ours == admits(compiler, tokenizer.eos_token_id, vllm_grammar, output), output
        admitted += ours
    assert admitted >= 1


@pytest.mark.parametrize("step", [1, 4])
def test_a_reply_after_its_opening_reads_as_the_whole_call(tokenizer: Any, step: int) -> None:  # noqa: F811
    output = hermes(PARIS)
    parser = OutputParser(tokenizer, "hermes", None, TOOLS[:1], "required", "parameter")
    opening = tokenizer.decode(parser.answer([])[0])
    assert output.startswith(opening) and opening.endswith('"arguments":')
    rest = output[len(opening) :]
    ids = tokenizer.encode(rest, add_special_tokens=False)
    names, arguments = [], ""
    for at in range(0, len(ids), step):
        delta = parser.feed(tokenizer.decode(ids[at : at + step]), ids[at : at + step], finished=at + step >= len(ids))
        assert delta.text == ""
        names += [call.name for call in delta.calls if call.name]
        arguments += "".join(call.arguments for call in delta.calls)
    assert names == ["get_weather"] and json.loads(arguments) == PARIS[1]
    final = parser.final(rest, ids)
    assert [(call.name, json.loads(call.arguments)) for call in final.calls] == [PARIS] and not final.malformed
    # Negative control: a parser that did not open the reply reads the rest as text.
    unopened = OutputParser(tokenizer, "hermes", None, TOOLS[:1], "required", "parameter")
    assert unopened.final(rest, ids).calls == []


def test_grammars_that_force_no_opening_are_kept(tokenizer: Any) -> None:  # noqa: F811
    auto = OutputParser(tokenizer, "hermes", None, TOOLS, "auto", "parameter")
    ids, grammar = auto.answer([1])
    assert (
        ids == [1] and grammar is auto.structured_outputs() and grammar is not None
    )  # triggered tags: text may come first
    ids, grammar = OutputParser(tokenizer, "hermes", None, TOOLS, "none").answer([1])
    assert ids == [1] and grammar is None
    assert forced_opening(None) == (None, "")


def test_with_a_reasoning_parser_nothing_is_prefilled() -> None:
    """vLLM applies the grammar once the reasoning ends (the reply opens with it): the
    call's opening is not the reply's start then."""
    reasoner = AutoTokenizer.from_pretrained(str(ensure_model("tiny")))
    reasoner.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>", "<think>", "</think>"]})
    parser = OutputParser(reasoner, "hermes", "qwen3", TOOLS[:1], "required", "parameter")
    ids, grammar = parser.answer([1])
    assert ids == [1] and grammar is parser.structured_outputs() and grammar is not None
    assert OutputParser(reasoner, "hermes", None, TOOLS[:1], "required", "parameter").answer([1])[0] != [1]


def test_a_single_tag_grammar_opens_with_its_begin(tokenizer: Any, compiler: Any) -> None:  # noqa: F811
    """Llama 3's JSON format names one function as a lone tag."""
    parser = OutputParser(tokenizer, "llama3_json", None, TOOLS, {"type": "function", "name": "get_time"}, "parameter")
    ids, rest = parser.answer([])
    opening = '{"name": "get_time", "parameters":'
    assert tokenizer.decode(ids) == opening
    output = llama3(CET)[len("<|python_tag|>") :]
    assert admits(compiler, tokenizer.eos_token_id, rest.structural_tag, output[len(opening) :])
    assert admits(compiler, tokenizer.eos_token_id, parser.structured_outputs().structural_tag, output)
