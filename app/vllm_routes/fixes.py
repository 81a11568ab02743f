"""Fixes for faults in vLLM's own OpenAI handlers that refuse valid requests (a 500, or
a 400 of an error that is vLLM's own).

Each is found by fuzzing this server's schema (docs/reliability.md), is guarded so it
does nothing where vLLM's code differs, and has a test that fails without it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any


def apply() -> None:
    _model_items_vllm_cannot_convert_go_as_dicts()
    _batch_conversations_are_rendered_from_a_copy()


def _batch_conversations_are_rendered_from_a_copy() -> None:
    """vLLM 0.32's batch chat completions render each conversation from the batch's own
    message dicts (rendering turns a tool call's ``arguments`` into a dict, in place)
    and, with a tool parser, build the conversation's request again from the same dicts
    to parse the reply: which then fails (400 "function.arguments Input should be a
    valid string") on any conversation with a tool call. Rendering gets a copy."""
    from vllm.entrypoints.openai.chat_completion.batch_serving import OpenAIServingChatBatch

    render = OpenAIServingChatBatch.render_batch_chat_request
    if getattr(render, "_streamsess_fixed", False):
        return

    @functools.wraps(render)
    async def render_a_copy(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _materialize(request.messages)
        request = request.model_copy(update={"messages": copy.deepcopy(request.messages)})
        return await render(self, request, *args, **kwargs)

    render_a_copy._streamsess_fixed = True  # type: ignore[attr-defined]
    OpenAIServingChatBatch.render_batch_chat_request = render_a_copy  # type: ignore[method-assign]


def _materialize(value: Any) -> None:
    """pydantic validates an Iterable field lazily (an assistant message's tool calls, where
    its content is null): a ValidatorIterator, which cannot be copied. Each becomes a list,
    in place, as vLLM's own chat request does with its messages."""
    entries = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, entry in list(entries):
        if isinstance(entry, Iterator):
            entry = value[key] = list(entry)
        _materialize(entry)


def _model_items_vllm_cannot_convert_go_as_dicts() -> None:
    """vLLM 0.32's Responses API turns each input item into a chat message. Items that
    validate as one of the SDK's output models (as sent back from a response that
    returned them: with ``id`` and ``status``) take model branches that fail on valid
    content (500s; schemathesis found them):

    - a ``function_call_output`` item's list ``output`` stays pydantic models, which
      vLLM's chat parser asserts are dicts (AssertionError);
    - an assistant ``message`` whose content is empty, or starts with a refusal, is read
      as ``content[0].text`` (IndexError, AttributeError).

    The same items as dicts (the input-param form) take vLLM's dict branches, which
    handle them, so such items are handed over as their dicts."""
    from vllm.entrypoints.openai.responses import utils

    try:
        from openai.types.responses import ResponseFunctionToolCallOutputItem, ResponseOutputMessage
    except ImportError:  # an SDK without these models: nothing to mend
        return
    construct = getattr(utils, "_construct_message_from_response_item", None)
    if construct is None or getattr(construct, "_streamsess_fixed", False):
        return

    def unconvertible(item: Any) -> bool:
        if isinstance(item, ResponseFunctionToolCallOutputItem):
            return not isinstance(item.output, str)
        if isinstance(item, ResponseOutputMessage):
            return not item.content or not isinstance(getattr(item.content[0], "text", None), str)
        return False

    @functools.wraps(construct)
    def construct_message(item: Any, *args: Any, **kwargs: Any) -> Any:
        if unconvertible(item):
            item = item.model_dump(mode="json", exclude_none=True)
        return construct(item, *args, **kwargs)

    construct_message._streamsess_fixed = True  # type: ignore[attr-defined]
    utils._construct_message_from_response_item = construct_message
