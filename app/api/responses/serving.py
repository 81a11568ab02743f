"""The Responses API's logic on sessions. No FastAPI here.

A response that starts nothing (no ``previous_response_id``, no ``conversation``) opens
a session, named by its id; one that continues the latest response of a chain appends
its turn to that response's session; one that continues an older response (or one whose
session is closed, or busy with a response of its own) forks: a new session whose first
chunk replays the older response's context (token ids from the store, served from the
device cache or the CPU tier) and adds the turn. A response on a conversation appends
to the conversation's session, re-rendering from the common prefix where its items
changed (a deleted item, other instructions). Each turn's tokens are planned against
the session's context under its lock (``chat.continue_to``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage
from vllm.entrypoints.openai.responses.protocol import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponsesResponse,
    ResponseUsage,
)

from app import routing
from app.api.responses import items
from app.api.responses.errors import (
    conversation_not_found,
    previous_response_not_found,
    response_not_found,
    superseded,
)
from app.api.responses.protocol import ResponsesCreateRequest, check_supported
from app.errors import APIError
from app.protocol import SamplingOptions, SessionCreateRequest
from app.sessions.chat import ChatState, Truncation, continue_within, unanswered_output
from app.sessions.chunk import CANCELLED, ChunkResult
from app.sessions.errors import store_unavailable
from app.sessions.inputs import Turn, TurnPlan
from app.sessions.run import ChunkRun
from app.sessions.service import SessionService
from app.sessions.session import StreamingSession
from app.store import SessionStore, StoredObject, StoreUnavailableError
from app.tools.parsing import OutputParser, ReplyParsers

RESPONSE, ITEM = "response", "item"
CHAIN_PREFIX = "resp_"  # a chain's session is named by its first response
CONVERSATION_PREFIX = "conv_"


@dataclass
class ContextPoint:
    """Where a response left its session: enough to continue or fork from it."""

    session_id: str
    num_chunks: int
    token_end: int
    messages: int
    instructions: str | None
    tools: list[dict[str, Any]] | None = None
    closed: bool = False  # left by a warm-up: the context ends with its last message's close


@dataclass
class PendingResponse:
    """A response whose chunk is running."""

    id: str
    request: ResponsesCreateRequest
    run: ChunkRun
    session_id: str
    wanted: ChatState
    input_items: list[dict[str, Any]]
    params: Any  # the chunk's SamplingParams, for the response object
    parser: OutputParser  # reads the reply's text and calls
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: items.new_id("msg"))
    steered: bool = False  # stopped by response.steer: ends incomplete, reason "steered"
    point: ContextPoint | None = None  # where it left its session, once committed
    final: ResponsesResponse | None = None  # the response as stored, once committed


class ResponsesService:
    """``store`` keeps the API's objects (responses, conversation items) beside the
    sessions; ``tokenizer`` renders chats as the sessions do; ``parsers`` read replies."""

    def __init__(self, sessions: SessionService, store: SessionStore, tokenizer: Any, parsers: ReplyParsers) -> None:
        self.sessions = sessions
        self.store = store
        self.tokenizer = tokenizer
        self.parsers = parsers

    # ------------------------------------------------------------------ create
    async def start(
        self,
        owner: str,
        request: ResponsesCreateRequest,
        unstored: dict[str, ContextPoint] | None = None,
        route_key: str | None = None,
    ) -> PendingResponse:
        """Check the request, plan its turn and start its chunk; every refusal is raised
        here. ``unstored``: responses a websocket connection keeps although they are not
        stored (its latest), which ``previous_response_id`` may name. ``route_key``: the
        proxy's key for a new chain (``app.routing``); a turn of a chain or a
        conversation takes its key from the id it continues, so that every response id
        of one conversation routes to the replica that holds it."""
        check_supported(request)
        self.sessions.check_model(request.model)
        tools = self.parsers.declared_tools(
            [tool.model_dump(exclude_none=True) for tool in request.tools or []], "tools"
        )
        parser = self.parsers.reply_parser(tools, request.tool_choice, request.parallel_tool_calls)
        new_items = items.input_items(request.input)
        new_messages = items.as_messages(new_items)
        truncation = Truncation(self.sessions.max_context) if request.truncation == "auto" else None
        options = _Options(self._options(request), parser, request.generate, len(new_messages), truncation)
        conversation_id = request.conversation_id
        key = routing.key_of(conversation_id or request.previous_response_id) or route_key
        response_id = routing.mint("resp", key)
        if conversation_id is not None:
            stored = await self.conversation_items(owner, conversation_id)
            wanted = ChatState(request.instructions, items.as_messages([o.data for o in stored]) + new_messages, tools)
            run = await self._start(owner, conversation_id, self._plan(wanted, options), options)
            session_id = conversation_id
        elif request.previous_response_id is not None:
            point = (unstored or {}).get(request.previous_response_id) or await self._point(
                owner, request.previous_response_id
            )
            run, session_id, wanted = await self._continue(
                owner, point, new_messages, ChatState(request.instructions, [], tools), options
            )
        else:
            wanted = ChatState(request.instructions, new_messages, tools)
            session_id = await self._new_session(owner, response_id)
            run = await self._start(owner, session_id, self._plan(wanted, options), options, opened=True)
        params = self.sessions.sampling_params(run.session, options.sampling)
        pending = PendingResponse(
            response_id, request, run, session_id, options.planned or wanted, new_items, params, parser
        )
        run.on_commit(lambda result: self._store_turn(owner, pending, result))  # before any await
        return pending

    async def _continue(
        self, owner: str, point: ContextPoint, new_messages: list[dict[str, Any]], head: ChatState, options: _Options
    ) -> tuple[ChunkRun, str, ChatState]:
        """Append to the point's session if it is still there and still ends at the
        point; otherwise fork. ``head``: the turn's instructions and tools."""
        try:
            session = await self.sessions.attach(owner, point.session_id)
        except APIError:
            session = None  # closed (idle too long, deleted) or purged: fork from the store
        if session is not None and session.num_chunks == point.num_chunks and session.chat is not None:
            wanted = ChatState(head.instructions, session.chat.messages[: point.messages] + new_messages, head.tools)
            try:
                run = await self._start(owner, session.id, self._plan(wanted, options, expect=point), options)
                return run, session.id, wanted
            except APIError as exc:
                if exc.code not in ("response_superseded", "chunk_in_flight"):
                    raise
        return await self._fork(owner, point, new_messages, head, options)

    async def _fork(
        self, owner: str, point: ContextPoint, new_messages: list[dict[str, Any]], head: ChatState, options: _Options
    ) -> tuple[ChunkRun, str, ChatState]:
        prefix, chat = await self._context_at(owner, point)
        wanted = ChatState(head.instructions, chat.messages + new_messages, head.tools)

        def plan(context_ids: list[int], conversation: ChatState | None) -> Turn:
            # Planned against the older point's context, which the new session replays.
            turn = options.turn(self.tokenizer, chat, wanted, prefix)
            kept = prefix if turn.start is None else prefix[: turn.start]
            return replace(turn, input_ids=kept + turn.input_ids, start=None, replayed=len(kept) + turn.replayed)

        # The fork keeps its chain's key: the prefix it replays is on that replica.
        session_id = await self._new_session(owner, routing.mint("resp", routing.key_of(point.session_id)))
        return await self._start(owner, session_id, plan, options, opened=True), session_id, wanted

    async def _context_at(self, owner: str, point: ContextPoint) -> tuple[list[int], ChatState]:
        """The token ids and the conversation of ``owner``'s session as a response left it."""
        prefix, chat = await self.sessions.stored_context(owner, point.session_id, point.num_chunks, point.token_end)
        if prefix is None or chat is None or len(prefix) != point.token_end:
            raise APIError(
                400,
                "The previous response's context is no longer kept; start a new chain.",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        return prefix, ChatState(point.instructions, chat.messages[: point.messages], point.tools, point.closed)

    def _plan(self, wanted: ChatState, options: _Options, expect: ContextPoint | None = None) -> TurnPlan:
        tokenizer = self.tokenizer

        def plan(context_ids: list[int], conversation: ChatState | None) -> Turn:
            if expect is not None and (
                conversation is None
                or len(conversation.messages) != expect.messages
                or len(context_ids) != expect.token_end
            ):
                raise superseded()  # another response went first: the caller forks
            return options.turn(tokenizer, conversation, wanted, context_ids)

        return plan

    async def _new_session(self, owner: str, session_id: str) -> str:
        """A session for a new chain (or a fork). At the server's session limit, the
        least recently used idle chain makes room: closed, it is still continued later,
        by a fork from the store (conversations are never closed for room)."""
        try:
            return (await self.sessions.create(owner, SessionCreateRequest(), session_id=session_id)).id
        except APIError as exc:
            if exc.code != "too_many_sessions" or not await self.sessions.close_least_recent_idle(CHAIN_PREFIX):
                raise
        return (await self.sessions.create(owner, SessionCreateRequest(), session_id=session_id)).id

    async def _start(
        self, owner: str, session_id: str, plan: TurnPlan, options: _Options, opened: bool = False
    ) -> ChunkRun:
        try:
            # Admitted and its tokens charged by the middlewares, from the body, as on vLLM's routes.
            return await self.sessions.start_chunk(
                owner, session_id, plan, options.sampling, transport="responses", wait=False, charged=True
            )
        except BaseException:
            if opened:  # a session opened for this response alone goes with it
                await self.sessions.close(owner, session_id)
            raise

    def _options(self, request: ResponsesCreateRequest) -> SamplingOptions:
        limit = self.sessions.max_chunk_output_tokens
        if request.max_output_tokens is not None and not 1 <= request.max_output_tokens <= limit:
            raise APIError(
                400,
                f"max_output_tokens must be between 1 and {limit}.",
                code="invalid_value",
                param="max_output_tokens",
            )
        return SamplingOptions(
            max_tokens=request.max_output_tokens or limit,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            seed=request.seed,
            ignore_eos=request.ignore_eos or None,
            stop_token_ids=request.stop_token_ids or None,
        )

    # ------------------------------------------------------------------ finish
    def in_progress(self, pending: PendingResponse) -> ResponsesResponse:
        return self._response(pending, "in_progress", [], None)

    def finish(self, pending: PendingResponse, result: ChunkResult | None, error: APIError | None) -> ResponsesResponse:
        """The response once its chunk has ended: as stored at the commit, or failed."""
        if result is None:
            message = error.message if error else "The response failed."
            return self._response(pending, "failed", [], None, error={"code": "server_error", "message": message})
        assert pending.final is not None, "a chunk's result is told after its commit, which builds the response"
        return pending.final

    async def _store_turn(self, owner: str, pending: PendingResponse, result: ChunkResult) -> None:
        """The turn's durable effects, run by the chunk's own task once the chunk is
        committed (``ChunkRun.on_commit``), whatever the consumer does meanwhile: the
        response is built and stored (and added to its conversation) when it
        completed, or was cut at max_output_tokens, cancelled or steered."""
        reason = (
            "max_output_tokens"
            if result.finish_reason == "length"
            else "steered"
            if pending.steered and result.finish_reason == CANCELLED
            else None
        )
        status = "incomplete" if reason else "cancelled" if result.finish_reason == CANCELLED else "completed"
        generated = pending.request.generate
        if not generated:  # a warm-up: its input is in, and it answers nothing
            status, reason = "completed", None
        output = (
            items.output_items(
                pending.parser.final(result.text, result.token_ids),
                pending.message_id,
                status="completed" if status == "completed" else "incomplete",
            )
            if generated
            else []
        )
        response = pending.final = self._response(
            pending, status, output, _usage(result), incomplete_details={"reason": reason} if reason else None
        )
        usage = result.usage
        point = pending.point = ContextPoint(
            pending.session_id,
            result.index + 1,
            usage.prompt_tokens + usage.completion_tokens,
            len(pending.wanted.messages) + generated,
            pending.wanted.instructions,
            pending.wanted.tools,
            closed=not generated,
        )
        now = time.time()
        # The response and what it adds to its conversation, in one write: a store that
        # fails leaves neither (the session then re-renders from the items it has).
        objects = []
        if pending.request.store is not False:
            data = {
                "response": response.model_dump(mode="json"),
                "input_items": pending.input_items,
                "context": asdict(point),
            }
            objects.append(StoredObject(response.id, RESPONSE, owner, pending.session_id, result.index, now, data))
        if (conversation_id := pending.request.conversation_id) is not None:
            objects += await self._item_objects(owner, conversation_id, [*pending.input_items, *output])
        if objects:
            try:
                await self.store.put_objects(objects)
            except StoreUnavailableError as exc:
                raise store_unavailable() from exc

    def _response(
        self,
        pending: PendingResponse,
        status: str,
        output: list[dict[str, Any]],
        usage: ResponseUsage | None,
        **extra: Any,
    ) -> ResponsesResponse:
        request, params = pending.request, pending.params
        if (conversation_id := request.conversation_id) is not None:
            extra["conversation"] = {"id": conversation_id}
        return ResponsesResponse(
            id=pending.id,
            created_at=pending.created_at,
            instructions=request.instructions,
            metadata=request.metadata,
            model=self.sessions.model_name,
            output=[_OUTPUT_MODELS[item["type"]].model_validate(item) for item in output],
            parallel_tool_calls=request.parallel_tool_calls is not False,
            temperature=params.temperature,
            tool_choice=request.tool_choice,
            tools=request.tools or [],
            top_p=params.top_p,
            background=False,
            max_output_tokens=params.max_tokens,
            previous_response_id=request.previous_response_id,
            service_tier=request.service_tier,
            status=status,
            truncation=request.truncation or "disabled",
            usage=usage,
            user=request.user,
            store=request.store is not False,
            **extra,
        )

    # ------------------------------------------------------------------ stored objects
    async def _stored(self, owner: str, response_id: str) -> StoredObject | None:
        obj = await self.store.get_object(RESPONSE, response_id)
        return obj if obj is not None and obj.owner == owner else None  # another key's: not found

    async def _point(self, owner: str, response_id: str) -> ContextPoint:
        obj = await self._stored(owner, response_id)
        if obj is None:
            raise previous_response_not_found(response_id)
        return ContextPoint(**obj.data["context"])

    async def retrieve(self, owner: str, response_id: str) -> dict[str, Any]:
        obj = await self._stored(owner, response_id)
        if obj is None:
            raise response_not_found(response_id)
        return dict(obj.data["response"])

    async def delete(self, owner: str, response_id: str) -> dict[str, Any]:
        """The stored response goes; its session's context stays (a later response in
        the chain still continues it)."""
        if await self._stored(owner, response_id) is None or not await self.store.delete_object(RESPONSE, response_id):
            raise response_not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, owner: str, response_id: str) -> list[dict[str, Any]]:
        obj = await self._stored(owner, response_id)
        if obj is None:
            raise response_not_found(response_id)
        return list(obj.data["input_items"])

    # ------------------------------------------------------------------ conversations
    async def conversation(self, owner: str, conversation_id: str) -> StreamingSession:
        """A conversation's session, reopened if it was closed for being idle: OpenAI keeps
        conversations however long they are idle (ours until the closed-session purge)."""
        try:
            session = await self.sessions.attach(owner, conversation_id)
        except APIError as exc:
            if exc.code != "session_closed" or not conversation_id.startswith(CONVERSATION_PREFIX):
                raise conversation_not_found(conversation_id) from exc
            try:
                session = await self.sessions.reopen(owner, conversation_id)
            except APIError as closed:
                if closed.code == "session_closed":
                    raise conversation_not_found(conversation_id) from closed
                raise  # no room (429), the store down (503): say so
        return session

    async def conversation_items(self, owner: str, conversation_id: str) -> list[StoredObject]:
        await self.conversation(owner, conversation_id)
        return list(await self.store.list_objects(ITEM, conversation_id))

    async def add_items(self, owner: str, conversation_id: str, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Items appended to a conversation's log, all or none; they reach the model with
        its next response."""
        await self.store.put_objects(await self._item_objects(owner, conversation_id, new))
        return new

    async def delete_item(self, item_id: str) -> None:
        await self.store.delete_object(ITEM, item_id)

    async def _item_objects(self, owner: str, conversation_id: str, new: list[dict[str, Any]]) -> list[StoredObject]:
        stored = await self.store.list_objects(ITEM, conversation_id)
        seq = stored[-1].seq + 1 if stored else 0
        now = time.time()
        return [
            StoredObject(item["id"], ITEM, owner, conversation_id, seq + offset, now, item)
            for offset, item in enumerate(new)
        ]


@dataclass
class _Options:
    """A turn's sampling options and the parser of its reply: each chunk the turn
    plans gets the reply's grammar (a required call) and records the reply as the
    parser reads it."""

    sampling: SamplingOptions
    parser: OutputParser
    generate: bool = True  # False: a warm-up (no grammar: nothing is answered)
    new_messages: int = 0  # the request's own, last in every turn's conversation
    truncation: Truncation | None = None  # truncation "auto": the oldest messages cut where it would not fit
    planned: ChatState | None = None  # the conversation the turn's context holds, once planned (after a cut)

    def turn(self, tokenizer: Any, have: ChatState | None, wanted: ChatState, context_ids: list[int]) -> Turn:
        """The turn taking a context that renders ``have`` to one that renders ``wanted``:
        here, where each path (new, continued, forked, conversation) has the whole
        conversation, before the chunk starts."""
        if (call_id := unanswered_output(wanted.messages, self.new_messages)) is not None:
            raise APIError(
                400,
                f"No tool call found for function call output with call_id {call_id}.",
                code="tool_call_not_found",
                param="input",
            )
        wanted, ids, start, earlier = continue_within(
            self.truncation,
            tokenizer,
            have,
            wanted,
            context_ids,
            self.new_messages,
            self.sampling.max_tokens or 0,
            self.generate,
        )
        self.planned = wanted
        ids, grammar = self.parser.answer(ids) if self.generate else (ids, None)  # a warm-up: no grammar
        return Turn(
            ids,
            start,
            wanted,
            earlier,
            structured_outputs=grammar,
            reply=lambda text: items.reply_message(self.parser.final(text)),
            generate=self.generate,
        )


_OUTPUT_MODELS: dict[str, Any] = {"message": ResponseOutputMessage, "function_call": ResponseFunctionToolCall}


def _usage(result: ChunkResult) -> ResponseUsage:
    """OpenAI's usage, with our split of the cached input as extra details."""
    usage, details = result.usage, result.usage.prompt_tokens_details
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=details.cached_tokens,
            cache_write_tokens=0,
            device_tokens=details.device_tokens,
            cpu_tier_tokens=details.cpu_tier_tokens,
            disk_tier_tokens=details.disk_tier_tokens,
            computed_tokens=details.computed_tokens,
        ),
        output_tokens_details=OutputTokensDetails(),
    )
