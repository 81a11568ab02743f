"""A chat session's context is the model's chat template over the whole conversation,
turn by turn (app/sessions/chat.py), on templates in the shape of each family. Oracle:
the tokenizer's own ``apply_chat_template`` over the whole conversation, tokenized at
once, against the session's context built as the server builds it: each turn's
rendered text, then the reply's tokens as the model would emit them (its end-of-turn
token when it ended on its own, none when cut at max_tokens).
"""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from app.models.builder import ensure_model
from app.sessions.chat import (
    ChatState,
    NotIncrementalError,
    Truncation,
    plan_turn,
    render_turn,
    unanswered_output,
)

CHATML = (  # SmolLM2's shape: a default system prompt where the conversation has none
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA = (  # refuses a system role
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MISTRAL = (  # refuses two turns of one role in a row
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]{% else %}"
    "{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
QWEN3 = (  # a reply keeps its reasoning block only while no user message follows it
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- set reasoning = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n')"
    " if '</think>' in m.content else '' -%}"
    "{%- if loop.index0 > ns.last_query -%}{{ '<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else -%}{{ content }}{%- endif -%}"
    "{%- else -%}{{ m.content }}{%- endif -%}{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|begin_of_text|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<think>",
    "</think>",
]
# Template, its bos token, the token a reply that ends on its own ends with.
FAMILIES = {"chatml": (CHATML, None, "<|im_end|>"), "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>")}
# Where the session's tokens are the whole rendering's tokens too. Llama 3's assistant
# prefix ends in "\n\n", one token at the end of a turn's text but two before the
# reply's first word when the whole conversation is tokenized at once (byte-level BPE
# splits whitespace before a word): the same text, other ids, there only.
CANONICAL = {"chatml"}


@pytest.fixture(scope="module")
def base_tokenizer() -> Any:
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model("tiny")))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tokenizer


def with_template(tokenizer: Any, template: str, bos: str | None) -> Any:
    tokenizer.chat_template = template
    tokenizer.bos_token = bos or tokenizer.eos_token
    return tokenizer


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("ended_on_its_own", [True, False], ids=["ended", "cut-at-max-tokens"])
def test_the_context_is_the_template_over_the_whole_conversation(
    base_tokenizer: Any, family: str, ended_on_its_own: bool
) -> None:
    template, bos, end_of_turn = FAMILIES[family]
    tokenizer = with_template(base_tokenizer, template, bos)
    end_id = tokenizer.convert_tokens_to_ids(end_of_turn)
    turns = [
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        [{"role": "user", "content": "And of Germany?"}],
        [{"role": "user", "content": "Thanks. Où est Zürich ?"}],
    ]
    replies = ["The capital of France is Paris.", "Berlin.", ""]  # an empty reply too
    context: list[int] = []
    conversation: list[dict[str, str]] = []
    for messages, reply in zip(turns, replies, strict=True):
        conversation += messages
        context += encode(tokenizer, render_turn(tokenizer, messages, context))
        context += encode(tokenizer, reply) + ([end_id] if ended_on_its_own else [])
        conversation.append({"role": "assistant", "content": reply})
    last = [{"role": "user", "content": "Bye."}]
    context += encode(tokenizer, render_turn(tokenizer, last, context))
    expected_text = tokenizer.apply_chat_template(conversation + last, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(context, skip_special_tokens=False) == expected_text
    if family in CANONICAL:
        assert context == encode(tokenizer, expected_text)


def test_without_the_turn_close_the_context_is_not_the_conversation(base_tokenizer: Any) -> None:
    """Negative control: the render before issue 26 (no close of the previous reply)."""
    tokenizer = with_template(base_tokenizer, CHATML, None)
    first = [{"role": "user", "content": "Hi"}]
    context = encode(tokenizer, render_turn(tokenizer, first, []))
    context += [*encode(tokenizer, "Hello."), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    full = render_turn(tokenizer, [{"role": "user", "content": "Bye"}], context)
    assert full.startswith("\n<|im_start|>user")  # the close's rest: "<|im_end|>" was the reply's last token
    without_close = full[len("\n") :]
    conversation = [*first, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    expected = encode(
        tokenizer, tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    )
    assert context + encode(tokenizer, without_close) != expected
    assert context + encode(tokenizer, full) == expected


@pytest.mark.parametrize(
    ("template", "messages"),
    [
        (GEMMA, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
        (MISTRAL, [{"role": "user", "content": "Hi"}, {"role": "user", "content": "again"}]),
    ],
    ids=["gemma-system-role", "mistral-alternation"],
)
def test_a_template_that_refuses_the_conversation_is_a_value_error(
    base_tokenizer: Any, template: str, messages: list[dict[str, str]]
) -> None:
    """Raised as jinja2's TemplateError, which the Realtime connection did not catch
    (it closed with 1011); as a ValueError it becomes an ``error`` event."""
    tokenizer = with_template(base_tokenizer, template, "<|begin_of_text|>")
    with pytest.raises(ValueError, match="refused the conversation"):
        render_turn(tokenizer, messages, [])


def test_a_template_that_rewrites_earlier_turns_is_rendered_again_from_the_common_prefix(base_tokenizer: Any) -> None:
    """Qwen3's shape: each turn after the first cannot be appended (the previous reply
    loses its reasoning block once a user message follows), so the whole conversation
    is rendered again and the turn starts where that parts from the context. Oracle:
    the template over the whole conversation, token for token, after 4 turns; and
    each re-render recomputes no more than the previous reply and the new turn."""
    tokenizer = with_template(base_tokenizer, QWEN3, None)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(NotIncrementalError):
        render_turn(tokenizer, [{"role": "user", "content": "Hi"}], [end_id])
    questions = ["What is the capital of France?", "And of Germany?", "Où est Zürich ?", "Thanks."]
    replies = [
        "<think>\nA capital.\n</think>\n\nParis.",
        "<think>\n\n</think>\n\nBerlin.",
        "<think>\nSwiss.\n</think>\n\nIn Switzerland.",
        "<think>\n\n</think>\n\nYou are welcome.",
    ]
    context: list[int] = []
    conversation: list[dict[str, str]] = []
    for turn, (question, reply) in enumerate(zip(questions, replies, strict=True)):
        messages = [{"role": "user", "content": question}]
        ids, start = plan_turn(tokenizer, conversation, messages, context)
        if turn == 0:
            assert start is None
        else:
            assert start is not None and start < len(context)
            previous_reply = [*encode(tokenizer, replies[turn - 1]), end_id]
            assert len(context) - start <= len(previous_reply) + 1, "more than the previous reply was recomputed"
            context = context[:start]
        context += ids
        conversation += messages
        expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert context == encode(tokenizer, expected)
        context += [*encode(tokenizer, reply), end_id]
        conversation.append({"role": "assistant", "content": reply})
    # Without the conversation (a context built elsewhere), the turn is refused, not guessed.
    with pytest.raises(NotIncrementalError, match="not known"):
        plan_turn(tokenizer, None, [{"role": "user", "content": "Bye."}], context)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("first_turn", ["warm-up", "answered"])
def test_a_warm_up_adds_its_messages_without_the_assistant_prefix(
    base_tokenizer: Any, family: str, first_turn: str
) -> None:
    """``generate: false``: a turn's messages computed with no assistant prefix (the
    context ends with the template's close of its last message), then the turn that
    continues it adds only what follows. Oracle: the template over the whole
    conversation, as above; and a warm-up then a turn of no new messages adds exactly
    the assistant prefix."""
    from app.sessions.chat import ChatState, continue_to

    template, bos, end_of_turn = FAMILIES[family]
    tokenizer = with_template(base_tokenizer, template, bos)
    context: list[int] = []
    have = ChatState()  # a new session's
    instructions = ChatState("Answer briefly.")
    if first_turn == "answered":
        wanted = instructions.with_messages([{"role": "user", "content": "Hi."}])
        ids, start = continue_to(tokenizer, have, wanted, context)
        context += ids + encode(tokenizer, "Hello.") + [tokenizer.convert_tokens_to_ids(end_of_turn)]
        have = wanted.with_messages([{"role": "assistant", "content": "Hello."}])
    # Two warm-ups, then the turn that continues them with no message of its own.
    for messages in (
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "And of Germany?"}],
    ):
        wanted = (have if have.messages else instructions).with_messages(messages)
        ids, start = continue_to(tokenizer, have, wanted, context, generation_prompt=False)
        assert start in (None, len(context))  # appended (a new session's first turn renders whole)
        context += ids
        have = wanted.warmed()
        assert tokenizer.decode(context, skip_special_tokens=False) == tokenizer.apply_chat_template(
            have.rendered(), tokenize=False
        )
    warmed = list(context)
    ids, start = continue_to(tokenizer, have, have.with_messages([]), context)
    assert start is None
    context += ids
    expected = tokenizer.apply_chat_template(have.rendered(), tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(context, skip_special_tokens=False) == expected
    assert (
        tokenizer.decode(context[len(warmed) :], skip_special_tokens=False)
        == expected[len(tokenizer.apply_chat_template(have.rendered(), tokenize=False)) :]
    )
    if family in CANONICAL:
        assert context == encode(tokenizer, expected)
    if family == "chatml":
        # Negative control: the same turn planned as if a sampled reply ended the context
        # (the closed state forgotten) closes the last message twice. (Llama 3's close is
        # its end-of-turn token alone, which the context's last token already is: there
        # the two plans agree.)
        forgotten = ChatState(have.instructions, have.messages, have.tools)
        ids, _ = continue_to(tokenizer, forgotten, forgotten.with_messages([]), warmed)
        assert tokenizer.decode(warmed + ids, skip_special_tokens=False) != expected


def test_a_tool_output_must_answer_a_call_made_before_it() -> None:
    """OpenAI's rule, on the request's own (last) messages only: a stored conversation
    with an orphan output stays usable."""
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    answer = {"role": "tool", "tool_call_id": "c1", "content": "1"}
    orphan = {"role": "tool", "tool_call_id": "c2", "content": "2"}
    user = {"role": "user", "content": "hi"}
    assert unanswered_output([user, call, answer], 1) is None  # the call is in the context
    assert unanswered_output([user, call, answer], 2) is None  # or in the same input
    assert unanswered_output([user, answer, call], 2) == "c1"  # made after its output
    assert unanswered_output([user, call, orphan], 1) == "c2"
    assert unanswered_output([orphan, user], 1) is None  # an old orphan is not the request's


def test_truncation_keeps_each_turn_within_the_context_and_cuts_seldom(base_tokenizer: Any) -> None:
    """A chat that outgrows its context (OpenAI's ``truncation: auto``). Oracle: the
    template over the conversation as planned (the kept messages), against the context
    built turn by turn; and the context never over its size with the answer's tokens.
    Negative control: the whole conversation would not fit."""
    tokenizer = with_template(base_tokenizer, CHATML, None)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    truncation, max_tokens = Truncation(max_context=400), 8
    have: ChatState | None = None  # a new session: its first turn renders the head too
    context: list[int] = []
    cuts, appends = 0, 0
    for index in range(40):
        question = {"role": "user", "content": f"Question {index}: what follows {index}?"}
        wanted = have.with_messages([question]) if have else ChatState("Answer briefly.", [question])
        planned, ids, start, earlier = truncation.plan(tokenizer, have, wanted, context, 1, max_tokens)
        context = (context if start is None else context[:start]) + ids
        assert len(context) + max_tokens <= truncation.max_context
        rendered = tokenizer.apply_chat_template(planned.rendered(), tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(context, skip_special_tokens=False) == rendered
        assert planned.messages[0]["role"] == "user" and planned.messages[-1] == wanted.messages[-1]
        if index == 0:
            pass  # the first turn renders the whole (new) conversation
        elif start is None:
            appends += 1
        else:
            cuts += 1
            assert 0 < earlier < len(ids)  # the earlier messages sent again, not counted as new input
        reply = f"It is {index + 1}."
        context += [*encode(tokenizer, reply), end_id]
        have = planned.with_messages([{"role": "assistant", "content": reply}])
    whole = ChatState(
        "Answer briefly.",
        [
            m
            for i in range(40)
            for m in (
                {"role": "user", "content": f"Question {i}: what follows {i}?"},
                {"role": "assistant", "content": f"It is {i + 1}."},
            )
        ],
    )
    whole_ids = encode(tokenizer, tokenizer.apply_chat_template(whole.rendered(), tokenize=False))
    assert len(whole_ids) > 2 * truncation.max_context  # without cuts, it could not fit
    assert cuts >= 2 and appends >= 3 * cuts  # each cut leaves a quarter of the room: several turns


def test_truncation_keeps_the_cut_a_conversation_has_already(base_tokenizer: Any) -> None:
    """A conversation's stored items are all of its messages; its session holds the
    window left after a cut: the next turn appends to that window, no new cut, and the
    messages cut before do not come back (that would recompute the whole context)."""
    tokenizer = with_template(base_tokenizer, CHATML, None)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(12)]
    have = ChatState(None, messages[6:])
    context = encode(tokenizer, tokenizer.apply_chat_template(have.rendered(), tokenize=False))
    wanted = ChatState(None, [*messages, {"role": "user", "content": "next"}])
    for max_context in (10_000, len(context) + 40):
        planned, _, start, earlier = Truncation(max_context).plan(tokenizer, have, wanted, context, 1, 8)
        assert planned.messages == [*messages[6:], wanted.messages[-1]] and start is None and earlier == 0
    # A context that holds the conversation from its beginning is appended to as it is.
    whole = ChatState(None, messages)
    planned, _, start, _ = Truncation(10_000).plan(tokenizer, whole, wanted, context, 1, 8)
    assert planned.messages == wanted.messages
    # The same message twice is a turn, not a window to look for.
    same = {"role": "user", "content": "again"}
    once = ChatState(None, [same])
    twice = ChatState(None, [same, same])
    assert Truncation(10_000).plan(tokenizer, once, twice, encode(tokenizer, "x"), 1, 8)[0] == twice
