"""Chat turns on a session: the text each turn appends, so that the session's context is
the model's chat template applied to the whole conversation. No FastAPI here.

A turn is rendered as the continuation of a stand-in conversation: what the template
puts after a closed assistant turn is the start of the next one. Before it goes the
close of the session's own last reply, as the template closes an assistant turn (found
by rendering one, not written per model family), less what the reply's last token
already closed: a reply that ended on its own ends on the template's end-of-turn token
(SmolLM2's ``<|im_end|>``), then only the rest (``\\n``) is sent; a reply cut at
``max_tokens`` gets the whole close.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

Messages = list[dict[str, str]]

# A stand-in conversation whose rendering is the prefix that a later turn continues.
_BEFORE_A_TURN: Messages = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
# An assistant reply no template rewrites, to find where the template's close begins.
_REPLY_MARK = "Zq7xW"


def render_turn(tokenizer: Any, messages: Messages, context_ids: list[int]) -> str:
    """The text to append for ``messages`` and the assistant prefix, to a session whose
    context is ``context_ids`` (empty: the conversation starts here). Raises ValueError
    where the template cannot continue a conversation (it rewrites earlier turns)."""
    if getattr(tokenizer, "chat_template", None) is None:
        # No template: a plain transcript format, one line a message.
        turn = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return f"\n{turn}" if context_ids else turn
    if not context_ids:
        return _apply(tokenizer, messages, generation_prompt=True)
    before = _apply(tokenizer, _BEFORE_A_TURN)
    full = _apply(tokenizer, _BEFORE_A_TURN + messages, generation_prompt=True)
    if not full.startswith(before):
        raise ValueError("the model's chat template does not render conversations incrementally")
    return reply_close(tokenizer, context_ids[-1]) + full[len(before):]


def max_messages(tokenizer: Any, max_tokens: int) -> int | None:
    """The most (empty) messages one turn of at most ``max_tokens`` tokens can hold, for
    the published schema; None where a message costs no tokens."""
    def tokens(count: int) -> int:  # as a first turn or a later one, whichever is longer
        messages = [{"role": "user", "content": ""}] * count
        return max(len(tokenizer.encode(render_turn(tokenizer, messages, context), add_special_tokens=False))
                   for context in ([], [0]))

    per_message = tokens(2) - tokens(1)
    return max((max_tokens - tokens(1)) // per_message + 1, 1) if per_message > 0 else None


def reply_close(tokenizer: Any, last_token_id: int) -> str:
    """What the template puts after an assistant reply's text, less the part of it
    that the reply's last token (``last_token_id``) already is."""
    close = _close_of_a_reply(tokenizer)
    emitted = tokenizer.decode([last_token_id], skip_special_tokens=False)
    return close[len(emitted):] if emitted and close.startswith(emitted) else close


def _close_of_a_reply(tokenizer: Any) -> str:
    key = (id(tokenizer), tokenizer.chat_template)
    if (close := _CLOSES.get(key)) is None:
        rendered = _apply(tokenizer, [{"role": "user", "content": "."}, {"role": "assistant", "content": _REPLY_MARK}])
        close = _CLOSES[key] = rendered[rendered.rindex(_REPLY_MARK) + len(_REPLY_MARK):]
    return close


# A close per tokenizer and template (a server has one; tests switch templates).
_CLOSES: dict[tuple[int, str], str] = {}


def _apply(tokenizer: Any, messages: Messages, generation_prompt: bool = False) -> str:
    try:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))
    except TemplateError as exc:
        # A template that refuses the conversation (Gemma: no system role; Mistral:
        # roles must alternate): the client's input, not a server fault.
        raise ValueError(f"the model's chat template refused the conversation: {exc}") from exc
