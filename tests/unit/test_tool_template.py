"""The default model's chat template with function calling (app/models/smollm2_chat_template.jinja).

Oracles: SmolLM2-Instruct's own template (as its GGUF carries it, copied below) for every
conversation without tools, byte for byte; and vLLM's ``hermes`` parser, which must read
back the calls that the template renders into an assistant turn.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from app.models.builder import ensure_model
from app.models.smollm2 import CHAT_TEMPLATE
from app.tools.parsing import OutputParser

SMOLLM2_OWN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "x"}],
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(ensure_model("tiny")))


def render(tokenizer: Any, template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return str(tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs))


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_without_tools_it_renders_as_the_models_own(
    tokenizer: Any, conversation: list[dict[str, Any]], generation_prompt: bool
) -> None:
    ours = CHAT_TEMPLATE.read_text()
    assert render(tokenizer, ours, conversation, add_generation_prompt=generation_prompt) == render(
        tokenizer, SMOLLM2_OWN, conversation, add_generation_prompt=generation_prompt
    )


def test_tools_go_in_the_system_turn_and_calls_read_back_with_hermes(tokenizer: Any) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    rendered = render(tokenizer, CHAT_TEMPLATE.read_text(), conversation, tools=TOOLS, add_generation_prompt=True)
    head, _, rest = rendered.partition("<|im_end|>\n")
    assert head.startswith("<|im_start|>system\nBe brief.") and json.dumps(TOOLS[0]) in head
    assert "Be brief." not in rest  # the system message is rendered once, in the head
    reply = rest.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = OutputParser(tokenizer, "hermes", None, TOOLS).final(reply)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})] * 2
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in rest
