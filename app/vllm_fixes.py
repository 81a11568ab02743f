"""Fixes for faults in vLLM's own OpenAI handlers that answer valid requests with 500.

Each is found by fuzzing this server's schema (docs/reliability.md), is guarded so it
does nothing where vLLM's code differs, and has a test that fails without it.
"""

from __future__ import annotations

import functools
from typing import Any


def apply() -> None:
    _tool_output_item_with_list_output()


def _tool_output_item_with_list_output() -> None:
    """vLLM 0.32's Responses API turns an input ``function_call_output`` item into a
    chat tool message. An item that validates as the output-item model
    (``ResponseFunctionToolCallOutputItem``: one sent back as a response returned it,
    with ``id``, ``status`` or ``created_by``) keeps a list ``output`` as pydantic
    models, which vLLM's chat parser asserts are dicts: AssertionError, 500. The same
    item as a dict (the input-param form) works, so such an item is handed over as
    its dict."""
    from vllm.entrypoints.openai.responses import utils

    try:
        from openai.types.responses import ResponseFunctionToolCallOutputItem
    except ImportError:  # an SDK without the model: nothing to mend
        return
    construct = getattr(utils, "_construct_message_from_response_item", None)
    if construct is None or getattr(construct, "_streamsess_fixed", False):
        return

    @functools.wraps(construct)
    def construct_message(item: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(item, ResponseFunctionToolCallOutputItem) and not isinstance(item.output, str):
            item = item.model_dump(mode="json", exclude_none=True)
        return construct(item, *args, **kwargs)

    construct_message._streamsess_fixed = True  # type: ignore[attr-defined]
    utils._construct_message_from_response_item = construct_message
