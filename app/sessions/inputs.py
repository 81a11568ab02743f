"""A chunk's input and sampling checks: pure functions, every refusal an ``APIError``."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from app.errors import APIError
from app.protocol import (
    SAMPLING_FIELDS,
    SESSION_ID_PATTERN,
    ChatMessage,
    SamplingOptions,
    SessionDefaults,
)
from app.sessions import chat
from app.sessions.chat import ChatState

DEFAULT_MAX_TOKENS = 16
SESSION_ID = re.compile(SESSION_ID_PATTERN)


@dataclass
class Turn:
    """What a chunk sends: its token ids, and where in the session's context they go.
    ``start`` None: after the whole context (a streaming session's normal append).
    Otherwise the context is cut to its first ``start`` tokens first: a chat whose
    template rewrote an earlier turn keeps the prefix it shares with the new rendering
    and recomputes only the rest."""

    input_ids: list[int]
    start: int | None = None
    # The conversation once this turn's messages are in (its reply is added when it
    # ends); None where the context is not a chat's (raw text or token ids).
    chat: chat.ChatState | None = None
    # Leading input ids that repeat a context computed before (a new session that
    # continues an older point of another): served from the cache, so not counted
    # against the chunk size limit.
    replayed: int = 0
    # A grammar for this chunk's answer alone (vLLM's StructuredOutputsParams): a call
    # that tool_choice requires. Each chunk gets its own (connectors/streaming_grammar.py).
    structured_outputs: Any = None
    # The reply as the conversation records it, from its text (a tool call's parsed
    # message); None: the text as an assistant message's content.
    reply: Callable[[str], dict[str, Any]] | None = None
    # False: a warm-up (the Responses websocket's ``generate: false``): the chunk is
    # prefilled and nothing is answered; the one token the engine samples after it is
    # not the session's (the engine drops it when the next chunk comes).
    generate: bool = True

    def conversation_after(self, text: str) -> ChatState | None:
        """The conversation once the turn has ended with the reply ``text``: with the
        reply, or closed after a warm-up; None where the context is not a chat's."""
        if self.chat is None:
            return None
        if not self.generate:
            return self.chat.warmed()
        return self.chat.with_messages([self.reply(text) if self.reply else {"role": "assistant", "content": text}])


# A chunk whose tokens depend on the session's context at the moment it runs (a chat
# turn that re-renders the conversation): called with the context and its
# conversation, under the lock.
TurnPlan = Callable[[list[int], "chat.ChatState | None"], Turn]
ChunkInput = str | list[int] | list[ChatMessage] | TurnPlan


def plan(
    tokenizer: Any,
    vocab_size: int,
    chunk_input: ChunkInput,
    context_ids: list[int],
    conversation: chat.ChatState | None,
    generate: bool = True,
) -> Turn:
    """The chunk's ``Turn`` against ``context_ids``, which renders ``conversation``.
    ``generate`` False: a warm-up (a ``TurnPlan`` decides it for itself)."""
    if callable(chunk_input):
        with _template_errors():
            turn = chunk_input(context_ids, conversation)
    elif chunk_input and isinstance(chunk_input[0], ChatMessage):
        messages = [message.model_dump() for message in chunk_input if isinstance(message, ChatMessage)]
        wanted = None if conversation is None else conversation.with_messages(messages)
        with _template_errors():
            if wanted is None:
                ids, start = chat.plan_turn(tokenizer, None, messages, context_ids, generation_prompt=generate)
            else:
                ids, start = chat.continue_to(tokenizer, conversation, wanted, context_ids, generation_prompt=generate)
        turn = Turn(ids, start, wanted, generate=generate)
    else:
        return Turn(encode(tokenizer, vocab_size, chunk_input), generate=generate)
    check_token_ids(turn.input_ids, vocab_size, "input")
    if turn.start is not None and not 0 <= turn.start <= len(context_ids):
        raise ValueError(f"a turn cannot start at {turn.start} of a {len(context_ids)}-token context")
    return turn


@contextlib.contextmanager
def _template_errors() -> Iterator[None]:
    """A template that refuses the conversation (a ValueError) is the client's input error."""
    try:
        yield
    except ValueError as exc:
        raise APIError(400, str(exc), code="template_error", param="input") from exc


def depends_on_context(chunk_input: ChunkInput) -> bool:
    """Whether the chunk must be planned again once its session's lock is held."""
    return callable(chunk_input) or (bool(chunk_input) and isinstance(chunk_input[0], ChatMessage))


def check_session_id(session_id: str) -> None:
    if not SESSION_ID.fullmatch(session_id):
        raise APIError(
            400,
            "A session id is 1 to 128 letters, digits, '_', '-' or '.', starting with a letter or digit.",
            code="invalid_session_id",
            param="X-Session-ID",
        )


def encode(tokenizer: Any, vocab_size: int, chunk_input: str | list[int] | list[ChatMessage]) -> list[int]:
    """A raw chunk's token ids: text encoded without special tokens (chunks concatenate
    into one context), or token ids checked against the vocabulary."""
    if isinstance(chunk_input, str):
        ids = list(tokenizer.encode(chunk_input, add_special_tokens=False))
        if not ids:
            raise APIError(400, "The chunk's text encodes to no tokens.", code="empty_input", param="input")
        return ids
    token_ids = [t for t in chunk_input if isinstance(t, int)]
    check_token_ids(token_ids, vocab_size, "input")
    return token_ids


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"Token id {bad} is outside the vocabulary (size {vocab_size}).",
            code="invalid_token_id",
            param=param,
        )


def check_sampling(options: SamplingOptions, param: str, max_output_tokens: int, vocab_size: int) -> None:
    """What the engine would refuse, refused first (vLLM's own bounds)."""
    prefix = f"{param}." if param != "chunk" else ""
    if options.max_tokens is not None and options.max_tokens > max_output_tokens:
        raise APIError(
            400,
            f"max_tokens may be at most {max_output_tokens} per chunk.",
            code="max_tokens_too_large",
            param=f"{prefix}max_tokens",
        )
    check_token_ids(options.stop_token_ids or [], vocab_size, f"{prefix}stop_token_ids")


def check_chunk(
    context_tokens: int,
    max_context: int,
    input_ids: list[int],
    params: SamplingParams,
    max_chunk_tokens: int,
    replayed: int = 0,
) -> None:
    if len(input_ids) - replayed > max_chunk_tokens:
        raise APIError(
            400,
            f"The chunk has {len(input_ids) - replayed} new tokens; the limit is {max_chunk_tokens}.",
            code="chunk_too_large",
            param="input",
        )
    if context_tokens + len(input_ids) + (params.max_tokens or 0) > max_context:
        raise APIError(
            400,
            f"The session holds {context_tokens} tokens; this chunk ({len(input_ids)} tokens) "
            f"plus max_tokens ({params.max_tokens}) would exceed the maximum context of "
            f"{max_context} tokens. Open a new session.",
            code="context_length_exceeded",
            param="input",
        )


def declare_bounds(
    schema: dict[str, Any],
    vocab_size: int,
    max_output_tokens: int,
    max_chunk_tokens: int,
    max_messages: int | None = None,
) -> None:
    """Put this server's bounds in its published OpenAPI schema, so that the schema says
    what the checks above accept: token ids below the vocabulary, at most
    ``max_chunk_tokens`` of them (stop token ids too), at most ``max_messages`` chat
    messages (as many as a turn of ``max_chunk_tokens`` holds), and ``max_tokens`` up to
    the per-chunk cap (a stored response's ``max_output_tokens`` too)."""
    components = schema.get("components", {}).get("schemas", {})
    for name, field in (
        ("ChunkRequest", "max_tokens"),
        ("SessionDefaults", "max_tokens"),
        ("ResponsesCreateRequest", "max_output_tokens"),
    ):
        properties = components.get(name, {}).get("properties", {})
        for variant in properties.get(field, {}).get("anyOf", []):
            if variant.get("type") == "integer":
                variant["maximum"] = max_output_tokens
        for listed in ("input", "stop_token_ids"):
            for variant in properties.get(listed, {}).get("anyOf", []):
                if variant.get("type") != "array":
                    continue
                if variant["items"].get("type") == "integer":  # token ids
                    variant["items"]["maximum"] = vocab_size - 1
                    if listed == "input":
                        variant["maxItems"] = max_chunk_tokens
                elif max_messages is not None:  # chat messages
                    variant["maxItems"] = max_messages


def model_sampling_defaults(model_config: Any) -> dict[str, Any]:
    """The model's own sampling defaults (its generation_config.json, as vLLM reads it for
    its routes), limited to what a chunk may set."""
    read = getattr(model_config, "get_diff_sampling_param", None)
    defaults = read() if callable(read) else {}
    return {name: value for name, value in defaults.items() if name in SAMPLING_FIELDS and name != "max_tokens"}


def sampling_params(
    defaults: SessionDefaults,
    options: SamplingOptions,
    max_output_tokens: int,
    vocab_size: int,
    model_defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """The chunk's options over the session's defaults over the model's, as vLLM's
    streaming input takes them."""
    check_sampling(options, "chunk", max_output_tokens, vocab_size)
    chosen: dict[str, Any] = {**(model_defaults or {}), **defaults.model_dump(exclude_none=True)}
    chosen.update({k: v for k in SAMPLING_FIELDS if (v := getattr(options, k)) is not None})
    chosen.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    try:
        # Streaming input needs n == 1, no stop strings and a non-final output kind.
        # Made for this chunk alone, so vLLM need not deep-copy it (as its own routes).
        return SamplingParams(output_kind=RequestOutputKind.DELTA, skip_clone=True, **chosen)
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"Invalid sampling parameters: {exc}", code="invalid_sampling_params") from exc
