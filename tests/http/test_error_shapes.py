"""Errors that fuzzing found shaped wrong: each must be a 4xx in the OpenAI shape."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.realtime.test_realtime import close_sessions
from tests.conftest import auth, make_settings
from tests.helpers import running_app
from tests.http.test_errors import assert_openai_error

pytestmark = pytest.mark.server


async def test_a_body_that_is_not_json_to_vllms_routes_gets_400_not_500(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=30) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = await http.post(path, content=b"prompt=1", headers={"content-type": "text/plain"})
            error = assert_openai_error(response, 400, "invalid_request")
            assert "application/json" in error["message"]


async def test_405_names_every_method_the_path_serves(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=30) as http:
        response = await http.put("/v1/sessions")
        assert_openai_error(response, 405)
        assert set(response.headers["allow"].split(", ")) == {"GET", "POST"}
        response = await http.patch("/v1/sessions/sess_x")
        assert_openai_error(response, 405)
        assert set(response.headers["allow"].split(", ")) == {"GET", "DELETE"}


# Schema-invalid bodies that vLLM's models, in pydantic's lax mode, would coerce and
# accept (schemathesis's negative_data_rejection found all but the first), and the
# parameter the 400 names.
LAX_BODIES = {
    "completions": ("/v1/completions", {"model": "embedded-tiny", "prompt": [1, 2], "max_tokens": "1"}, "max_tokens"),
    "detokenize": ("/detokenize", {"model": "embedded-tiny", "tokens": ["1", 2]}, "tokens.0"),
    "tokenize": (
        "/tokenize",
        {"model": "embedded-tiny", "prompt": "hi", "add_special_tokens": "yes"},
        "add_special_tokens",
    ),
    "responses": (
        "/v1/responses",
        {"model": "embedded-tiny", "input": "hi", "max_output_tokens": 1, "stream": "false"},
        "stream",
    ),
    # pydantic validates the openai SDK's Iterable[...] fields (message content) lazily
    # and takes any iterable: an object for the array, and items never checked.
    "object-for-content": (
        "/tokenize",
        {"model": "embedded-tiny", "messages": [{"role": "tool", "tool_call_id": "t", "content": {}}]},
        "messages.0.content",
    ),
    "bad-content-part": (
        "/v1/chat/completions/batch",
        {
            "model": "embedded-tiny",
            "max_tokens": 1,
            "messages": [[{"role": "tool", "tool_call_id": "t", "content": [[None, None]]}]],
        },
        "messages.0.0.content.0",
    ),
    # vLLM's own before-validator builds a function_call input item in lax mode, so the
    # integer reached the strict pass as a finished model holding False.
    "coerced-in-vllms-validator": (
        "/v1/responses",
        {
            "model": "embedded-tiny",
            "max_output_tokens": 1,
            "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "async": 0}],
        },
        "input.0.async",
    ),
    "coerced-in-a-list": (
        "/v1/responses",
        {
            "model": "embedded-tiny",
            "max_output_tokens": 1,
            "input": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [
                        {
                            "type": "output_text",
                            "text": "a",
                            "logprobs": [{"token": "a", "logprob": 0.0, "bytes": [97, False], "top_logprobs": []}],
                        }
                    ],
                }
            ],
        },
        "input.0.content.0.logprobs.0.bytes.1",
    ),
    # A list pydantic made of an object's keys (vLLM's message types take any iterable).
    "object-for-tool-calls": (
        "/v1/chat/completions",
        {"model": "embedded-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi", "tool_calls": {}}]},
        "messages.0.tool_calls",
    ),
    # SageMaker's route, validated strictly as a chat or a completion request.
    "invocations": ("/invocations", {"model": "embedded-tiny", "prompt": "hi", "max_tokens": "1"}, "max_tokens"),
    # Our field on the Responses request, which vLLM's model (the strict pass) lacks.
    "responses-generate": (
        "/v1/responses",
        {"model": "embedded-tiny", "input": "hi", "max_output_tokens": 1, "generate": 0},
        "generate",
    ),
    # A penalty that float32 holds as 0: vLLM divided the logits by it and a constrained
    # reply died in its grammar check, a 500 (fresh-seed fuzzing). Now out of range.
    "underflowing-penalty": (
        "/v1/responses",
        {
            "model": "embedded-tiny",
            "input": "x",
            "store": False,
            "max_output_tokens": 2,
            "repetition_penalty": 5e-324,
            "structured_outputs": {"choice": ["a"]},
        },
        "repetition_penalty",
    ),
    "underflowing-penalty-completions": (
        "/v1/completions",
        {
            "model": "embedded-tiny",
            "prompt": "0",
            "max_tokens": 2,
            "repetition_penalty": 5e-324,
            "structured_outputs": {"choice": [""]},
        },
        "repetition_penalty",
    ),
    # ... and one that overflows it (1.4e308 became inf): a 500 on a batch with a grammar
    # (fresh-seed fuzzing, round 23).
    "overflowing-penalty-batch": (
        "/v1/chat/completions/batch",
        {
            "model": "embedded-tiny",
            "max_tokens": 2,
            "messages": [[{"role": "user", "content": "hi"}]],
            "repetition_penalty": 1.4e308,
            "structured_outputs": {"choice": ["a"]},
        },
        "repetition_penalty",
    ),
    # A chat request's max_tokens below 1 beside max_completion_tokens (vLLM takes it
    # there only; the schema, which cannot say so, says from 1).
    "chat-max-tokens-below-1": (
        "/v1/chat/completions",
        {
            "model": "embedded-tiny",
            "max_tokens": 0,
            "max_completion_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        },
        "max_tokens",
    ),
    "chat-max-tokens-beyond-the-model": (
        "/v1/chat/completions",
        {
            "model": "embedded-tiny",
            "max_tokens": 10**6,
            "max_completion_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        },
        "max_tokens",
    ),
    # A grammar that allows none of the allowed ids: vLLM sampled a token its grammar
    # rejected, a 500 (fresh-seed fuzzing).
    "allowed-ids-with-a-grammar": (
        "/v1/completions",
        {
            "model": "embedded-tiny",
            "prompt": "0",
            "max_tokens": 2,
            "allowed_token_ids": [5],
            "structured_outputs": {"choice": ["a"]},
        },
        "allowed_token_ids",
    ),
    # Empty allowed ids on a streamed completion: vLLM refused them inside its 200, as an
    # error event (seven of nine no-parser seeds: schema-violating data "accepted").
    "empty-allowed-ids-streamed": (
        "/v1/completions",
        {"model": "embedded-tiny", "prompt": "0", "max_tokens": 2, "stream": True, "allowed_token_ids": []},
        "allowed_token_ids",
    ),
    # A coercion in a field named like a request part: the param names the body's field.
    "coerced-query": (
        "/generative_scoring",
        {"model": "embedded-tiny", "label_token_ids": [1], "items": ["a"], "query": [176.0, "5"]},
        "query.1",
    ),
    # A batch's response format, which vLLM validates later, in lax mode, per conversation.
    "batch-response-format": (
        "/v1/chat/completions/batch",
        {
            "model": "embedded-tiny",
            "max_tokens": 1,
            "messages": [[{"role": "user", "content": "hi"}]],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "1"}},
        },
        "response_format.json_schema.strict",
    ),
    # A part that names its type is that part (in a message of a role of its own, vLLM's
    # union of parts also takes any object, and its parser rendered this one): fresh
    # seeds, ten of ten.
    "typed-part": (
        "/v1/chat/completions",
        {
            "model": "embedded-tiny",
            "max_tokens": 1,
            "messages": [{"role": "narrator", "content": [{"type": "thinking", "thinking": 5}]}],
        },
        "messages.0.content.0.thinking",
    ),
    "typed-part-in-a-batch": (
        "/v1/chat/completions/batch",
        {
            "model": "embedded-tiny",
            "max_tokens": 1,
            "messages": [[{"role": "narrator", "content": [{"type": "thinking", "closed": "x", "thinking": "t"}]}]],
        },
        "messages.0.0.content.0.closed",
    ),
    # vLLM's salt rule, which its chat batches skip: every route now applies it.
    "batch-salt": (
        "/v1/chat/completions/batch",
        {
            "model": "embedded-tiny",
            "max_tokens": 1,
            "cache_salt": "a/b",
            "messages": [[{"role": "user", "content": "hi"}]],
        },
        "cache_salt",
    ),
    # Refused by one of vLLM's own validators (a VLLMValidationError), which our salting
    # would otherwise have mended by replacing the empty salt.
    "empty-salt": (
        "/v1/responses",
        {"model": "embedded-tiny", "input": "hi", "max_output_tokens": 1, "cache_salt": ""},
        "cache_salt",
    ),
}


@pytest.mark.parametrize("case", sorted(LAX_BODIES))
async def test_vllm_routes_enforce_their_schema_strictly(server: str, case: str) -> None:
    path, body, param = LAX_BODIES[case]
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        error = assert_openai_error(await http.post(path, json=body), 400, "invalid_request")
        assert error["param"] == param, error


async def test_lax_validation_is_vllms_own_when_asked_for(engine: Any) -> None:
    # The negative control: with strict validation off, vLLM coerces the same bodies.
    async with (
        running_app(make_settings(openai_strict_validation=False), engine) as url,
        httpx.AsyncClient(base_url=url, headers=auth(), timeout=60) as http,
    ):
        for case in ("completions", "detokenize"):
            path, body, _ = LAX_BODIES[case]
            response = await http.post(path, json=body)
            assert response.status_code == 200, response.text


async def test_errors_of_vllms_responses_handler_take_the_openai_shape(server: str) -> None:
    # store: false goes to vLLM's own handler, which answers "code": 400 and its
    # exception's name as the type; ours answers OpenAI's string code, as every route does.
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        response = await http.post(
            "/v1/responses",
            json={
                "model": "embedded-tiny",
                "input": "hi",
                "store": False,
                "max_output_tokens": 1,
                "stop_token_ids": [2**31 - 2],
            },
        )
        error = assert_openai_error(response, 400, "invalid_request")
        assert error["type"] == "invalid_request_error" and error["param"] == "stop_token_ids", error


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "invalid_request"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "invalid_request"),
        (
            "/v1/chat/completions",
            {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "model_not_found",
        ),
        ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model_not_found"),
    ],
)
async def test_errors_vllms_handlers_answer_take_the_openai_shape(
    server: str, path: str, body: dict[str, Any], status: int, code: str
) -> None:
    # Refused inside vLLM's handler (past every check before it), which answers its
    # exception's name as the type and the status as an integer code; the official SDK
    # and OpenAI's shape expect a string code (app.http.errors.openai_error_bytes).
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        response = await http.post(path, json={"model": "embedded-tiny", **body})
        error = assert_openai_error(response, status, code)
        assert error["type"] in ("invalid_request_error", "not_found_error"), error
        assert int(response.headers["content-length"]) == len(response.content)


ANTHROPIC_MESSAGE = {"model": "embedded-tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_beam_searchs_length_penalty_is_bounded(server: str, path: str) -> None:
    # A no-parser fuzz seed: length_penalty -2.8e16 with beam search made a beam's score
    # divide by the length to that power, 0.0: ZeroDivisionError, a 500.
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        for penalty, refused in ((-2.8e16, True), (1e16, True), (-10, False), (10, False)):
            response = await http.post(
                path,
                json={
                    "model": "embedded-tiny",
                    "max_tokens": 3,
                    "use_beam_search": True,
                    "n": 2,
                    "length_penalty": penalty,
                    **body,
                },
            )
            if refused:
                assert response.status_code == 400 and "length_penalty" in response.text, response.text
            else:
                assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "top_k"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "stream_interval"),
        ("/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": "hi"}]]}, "top_k"),
        ("/v1/completions", {"prompt": "hi"}, "top_k"),
        ("/v1/completions", {"prompt": "hi"}, "stream_interval"),
        ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}, "top_k"),
    ],
)
async def test_an_integer_beyond_64_bits_is_a_400_on_vllms_routes(
    server: str, path: str, body: dict[str, Any], field: str
) -> None:
    # A no-parser fuzz seed: vLLM takes top_k and stream_interval unbounded, then cannot
    # send them to its engine core ("can't serialize ints"): a 500. Refused and stated,
    # as our own routes bound their integers (app.vllm_routes.sampling.SAMPLING_RANGES).
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        response = await http.post(path, json={"model": "embedded-tiny", "max_tokens": 2, **body, field: 2**70})
        assert response.status_code == 400, response.text
        assert field in response.text, response.text
        accepted = await http.post(path, json={"model": "embedded-tiny", "max_tokens": 2, **body, field: 2**53 - 1})
        assert accepted.status_code == 200, accepted.text
        schemas = (await http.get("/openapi.json")).json()["components"]["schemas"]
        assert {
            variant.get("maximum")
            for name in ("ChatCompletionRequest", "CompletionRequest")
            for variant in schemas[name]["properties"][field]["anyOf"]
            if variant.get("type") == "integer"
        } == {2**53 - 1}


@pytest.mark.parametrize(
    ("path", "body", "field", "number"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "ec_transfer_params",
            2**70,
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "kv_transfer_params",
            1e30,
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "vllm_xargs", -(2**63) - 1),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, "kv_transfer_params", 2**64),  # a session's
    ],
)
async def test_numbers_sent_on_in_extra_args_are_refused_beyond_messagepacks_range(
    server: str, path: str, body: dict[str, Any], field: str, number: float
) -> None:
    # Seven of seven hermes fuzz seeds: vLLM refuses an integer beyond 64 bits in the
    # free-form fields it passes its engine core, which the schema took; now the schema
    # bounds their numbers (at any depth) and the server refuses the same, floats too.
    value = [{"deep": number}] if field != "vllm_xargs" else [number]
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        response = await http.post(path, json={"model": "embedded-tiny", **body, field: {"k": value}})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field, response.text
        within = [{"deep": 2**63 - 1}] if field != "vllm_xargs" else [2**63 - 1]
        accepted = await http.post(path, json={"model": "embedded-tiny", **body, field: {"k": within}})
        assert accepted.status_code == 200, accepted.text


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "kind"),
    [
        ("/v1/messages", {**ANTHROPIC_MESSAGE, "model": "nope"}, None, 404, "not_found_error"),  # vLLM's handler
        ("/v1/messages", {**ANTHROPIC_MESSAGE, "messages": []}, None, 400, "invalid_request_error"),  # vLLM's renderer
        ("/v1/messages", {**ANTHROPIC_MESSAGE, "max_tokens": 0}, None, 400, "invalid_request_error"),  # our range check
        ("/v1/messages", {**ANTHROPIC_MESSAGE, "top_k": "1"}, None, 400, "invalid_request_error"),  # strict validation
        ("/v1/messages/count_tokens", {"model": "embedded-tiny"}, None, 400, "invalid_request_error"),
        ("/v1/messages", ANTHROPIC_MESSAGE, {"Authorization": "Bearer wrong"}, 401, "authentication_error"),  # key
    ],
)
async def test_errors_on_anthropics_routes_take_anthropics_shape(
    server: str, path: str, body: dict[str, Any], headers: dict[str, str] | None, status: int, kind: str
) -> None:
    # Anthropic's SDK reads {"type": "error", "error": {"type", "message"}} with its own
    # types, whichever layer refused the request (app.http.middleware.AnthropicErrorMiddleware).
    async with httpx.AsyncClient(base_url=server, headers=headers or auth(), timeout=60) as http:
        response = await http.post(path, json=body)
        assert response.status_code == status, response.text
        assert response.json() == {
            "type": "error",
            "error": {"type": kind, "message": response.json()["error"]["message"]},
        }
        assert response.json()["error"]["message"] and int(response.headers["content-length"]) == len(response.content)
        if status == 404:  # and the server's schema says so, the middlewares' refusals too
            declared = (await http.get("/openapi.json")).json()["paths"]["/v1/messages"]["post"]["responses"]
            assert {
                declared[code]["content"]["application/json"]["schema"]["$ref"] for code in ("400", "401", "429")
            } == {"#/components/schemas/AnthropicErrorResponse"}


@pytest.mark.parametrize("field", ["mm_processor_kwargs", "chat_template_kwargs"])
async def test_stored_responses_refuse_what_a_session_cannot_honour(server: str, field: str) -> None:
    # Multimodal kwargs as vLLM's own handler refuses them (the server does not trust
    # them); template kwargs, since a session renders with the server's template: never
    # dropped silently.
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        response = await http.post(
            "/v1/responses", json={"model": "embedded-tiny", "input": "hi", "max_output_tokens": 1, field: {"a": 1}}
        )
        assert assert_openai_error(response, 400, "unsupported_parameter")["param"] == field


async def test_a_null_truncation_is_the_default_on_every_responses_path(server: str) -> None:
    # vLLM's handler (store: false) answered a null with a 400 from its own response model.
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        for store in (False, True):
            response = await http.post(
                "/v1/responses",
                json={
                    "model": "embedded-tiny",
                    "input": "hi",
                    "max_output_tokens": 1,
                    "store": store,
                    "truncation": None,
                },
            )
            assert response.status_code == 200 and response.json()["truncation"] == "disabled", response.text
            if store:  # the response's session (named by its id): closed, as every test leaves the shared engine
                assert (await http.delete(f"/v1/sessions/{response.json()['id']}")).status_code == 200


async def test_metrics_answer_reads_only(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=30) as http:
        assert (await http.get("/metrics")).status_code == 200
        for method in ("TRACE", "DELETE", "POST"):
            response = await http.request(method, "/metrics")
            assert_openai_error(response, 405)
            assert response.headers["allow"] == "GET, HEAD"


async def test_routes_that_cannot_work_here_are_not_served(server: str) -> None:
    # One engine per replica: a rescale could only fail, and any key could ask for it.
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=30) as http:
        assert_openai_error(await http.post("/scale_elastic_ep", json={"new_data_parallel_size": 2}), 404)
        assert_openai_error(await http.post("/is_scaling_elastic_ep"), 404)
        # Nor a route the model has no handler for (vLLM would answer 501 on every call).
        assert_openai_error(await http.post("/v1/systemone", json={"questions": {}, "state": None}), 404)
        paths = (await http.get("/openapi.json")).json()["paths"]
        assert not {"/scale_elastic_ep", "/v1/systemone"} & set(paths)


async def test_the_schema_does_not_require_what_vllm_fills_in(server: str) -> None:
    # vLLM gives a reasoning input item without an id one of its own; the openai SDK's
    # type, and so the schema vLLM publishes, required it (schemathesis found the gaps).
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        components = (await http.get("/openapi.json")).json()["components"]["schemas"]
        assert "id" not in components["ResponseReasoningItemParam"].get("required", [])
        # So for an assistant message's id and status and its texts' annotations.
        assert not {"id", "status"} & set(components["ResponseOutputMessageParam"]["required"])
        assert "annotations" not in components["ResponseOutputTextParam"]["required"]
        # store: false, with no previous response or conversation: vLLM's own handler.
        response = await http.post(
            "/v1/responses",
            json={
                "model": "embedded-tiny",
                "max_output_tokens": 1,
                "store": False,
                "input": [
                    {"type": "reasoning", "summary": []},
                    {"role": "user", "content": "hi"},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
                    {"role": "user", "content": "go on"},
                ],
            },
        )
        assert response.status_code == 200, response.text


# Input items as a response returned them (with id, status, created_by), which vLLM 0.32
# converts through model branches that fail on them (500s; schemathesis found them):
# app/vllm_routes/fixes.py hands them over as dicts.
ITEMS_SENT_BACK = {
    "tool-output-list": {
        "type": "function_call_output",
        "call_id": "c",
        "id": "fco_1",
        "status": "completed",
        "created_by": "tool",
        "output": [{"type": "input_text", "text": "42"}],
    },
    "assistant-empty": {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": []},
    "assistant-refusal": {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": [{"type": "refusal", "refusal": "no"}],
    },
}


@pytest.mark.parametrize("case", sorted(ITEMS_SENT_BACK))
async def test_input_items_sent_back_as_returned_are_answered(server: str, case: str) -> None:
    # Stateless (store: false): vLLM's own handler, which app/vllm_routes/fixes.py patches.
    body = {
        "model": "embedded-tiny",
        "max_output_tokens": 1,
        "store": False,
        "input": [{"role": "user", "content": "hi"}, ITEMS_SENT_BACK[case], {"role": "user", "content": "go on"}],
    }
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        response = await http.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text


async def test_a_stored_input_items_id_is_a_string(server: str) -> None:
    # vLLM's request model keeps any id on a message, and a stored response took `{}` as
    # its id (fresh-seed fuzzing: schema-invalid, answered 200): refused, naming the item.
    body = {
        "model": "embedded-tiny",
        "max_output_tokens": 1,
        "input": [{"type": "message", "role": "user", "content": "hi", "id": {}}],
    }
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        response = await http.post("/v1/responses", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "input[0].id"
        body["input"][0]["id"] = "msg_1"
        answered = await http.post("/v1/responses", json=body)
        assert answered.status_code == 200, answered.text
        await close_sessions(server, answered.json()["id"])


async def test_forms_json_schema_allows_are_taken_in_every_branch_of_a_union(server: str) -> None:
    # JSON Schema's integers include 176.0. Strict validation refused it, and in a union
    # (a query is text or token ids) the refusal named the other branch: "str: Input
    # should be a valid string" (fresh-seed fuzzing, ten seeds of ten).
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        response = await http.post(
            "/generative_scoring",
            json={"model": "embedded-tiny", "label_token_ids": [1], "items": ["a"], "query": [176.0, 5]},
        )
        assert response.status_code == 200, response.text


async def test_the_schema_states_what_this_server_was_started_with(server: str) -> None:
    # The suite's server has no tool parser, a model that is not harmony's, and prompt
    # embeddings off: each form the schema no longer offers is refused, and the ones it
    # keeps are answered (fresh seeds found the schema offering all three).
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        components = (await http.get("/openapi.json")).json()["components"]["schemas"]
        chat = components["ChatCompletionRequest"]
        assert {v.get("const") for v in chat["properties"]["tool_choice"]["anyOf"]} == {"none", None}
        assert "openai_harmony__Message" not in str(chat["properties"]["messages"])
        assert components["CompletionRequest"]["properties"]["prompt_embeds"]["type"] == "null"
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        chat_body = {
            "model": "embedded-tiny",
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": tools,
        }
        assert_openai_error(await http.post("/v1/chat/completions", json=chat_body), 400)  # defaults to auto
        response = await http.post("/v1/chat/completions", json={**chat_body, "tool_choice": "none"})
        assert response.status_code == 200, response.text
        harmony = {"author": {"role": "user"}, "content": [{"type": "text", "text": "hi"}]}
        assert_openai_error(await http.post("/tokenize", json={"model": "embedded-tiny", "messages": [harmony]}), 400)
        assert_openai_error(
            await http.post(
                "/v1/completions",
                json={"model": "embedded-tiny", "prompt": "0", "max_tokens": 1, "prompt_embeds": "QQ=="},
            ),
            400,
        )
        # A text-only model: no image parts offered, and one sent is refused.
        assert "ChatCompletionContentPartImageParam" not in str(components["ChatCompletionUserMessageParam"])
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        assert_openai_error(
            await http.post(
                "/v1/chat/completions",
                json={"model": "embedded-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [image]}]},
            ),
            400,
        )


async def test_a_chat_body_to_invocations_is_a_chat(server: str) -> None:
    # The strict pass tried both body models at once, and the completion model's own
    # validator refused the chat ("Either prompt or prompt_embeds must be provided"):
    # fresh-seed fuzzing, seven seeds of ten. vLLM takes the first that validates.
    async with httpx.AsyncClient(base_url=server, headers=auth(), timeout=60) as http:
        response = await http.post(
            "/invocations", json={"messages": [{"content": "", "role": "developer"}], "max_tokens": 1}
        )
        assert response.status_code == 200, response.text
        assert response.json()["object"] == "chat.completion"
        # A chat body with an integral float, which strict mode refuses and JSON Schema
        # takes: the chat model takes it (the completion model's validator refused it).
        response = await http.post(
            "/invocations", json={"messages": [{"content": "hi", "role": "user"}], "max_tokens": 1.0}
        )
        assert response.status_code == 200, response.text
        assert response.json()["object"] == "chat.completion"
