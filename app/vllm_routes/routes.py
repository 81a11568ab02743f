"""Which of vLLM's routes this server serves, and what it checks in their bodies.

vLLM's ``build_app`` mounts far more than ``/v1/completions`` and
``/v1/chat/completions``: the Responses and Anthropic Messages APIs, chat batches,
SageMaker's ``/invocations``, structured decisions, generative scoring. Each of those
generates on the shared prefix cache, so each must carry the caller's cache salt, or
one key reads another's prompts through its usage (``cached_tokens``). The table is
built from the app's own routes: a route whose body model declares ``cache_salt``
generates, so routes a newer vLLM adds are salted by construction.

The same table validates those bodies strictly (``strict_errors``), and the schema
patches below make the published schema say what the server enforces, no more, no less.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError, create_model
from starlette.routing import Mount
from starlette.types import ASGIApp, Receive, Scope, Send
from vllm.exceptions import VLLMValidationError

from app.errors import APIError
from app.http.errors import send_http_error

# SageMaker's route reads its body itself and hands it to the first of these routes
# whose body model validates it (vLLM's get_generate_invocation_types, in its order): it
# generates, and is validated strictly as one of them.
DISPATCHING_GENERATE_PATHS = {"/invocations": ("/v1/chat/completions", "/v1/completions")}
# Data-parallel rescaling: this server runs one engine per replica, so a rescale
# can only fail (vLLM answers 500), and any key could ask for it. Not served.
UNSERVED_PATHS = frozenset({"/scale_elastic_ep", "/is_scaling_elastic_ep"})
# vLLM's routes that ours replace (app.api.responses: stateful Responses on sessions). Their
# body model still tells the request middleware how to validate, salt and charge the
# body; then they go, so that no path is served twice.
REPLACED_PATHS = frozenset({"/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"})
# What continues a stored conversation: honoured on the Responses API only. vLLM's other
# routes would drop them with every unknown field, and answer as if no history existed.
STATEFUL_FIELDS = ("conversation", "previous_response_id")
# Routes vLLM mounts for every model but answers 501 on models without their serving
# handler (set in app.state by vLLM's init_app_state): served only where they work.
MODEL_DEPENDENT_PATHS = {"/v1/systemone": "serving_structured_decisions"}


@dataclass(frozen=True)
class OpenAIBodyRoute:
    """What the server does with a vLLM route's JSON body before vLLM reads it."""

    # Validate in strict mode, as the first of these body models (by name) that takes it,
    # in vLLM's order (None: leave it to vLLM).
    strict_validator: tuple[tuple[str, TypeAdapter[Any]], ...] | None
    generates: bool  # it reaches the prefix cache: salt it, charge its tokens
    stateful: bool = False  # it honours STATEFUL_FIELDS (ours replaces vLLM's: app.api.responses)


def strict_errors(validators: tuple[tuple[str, TypeAdapter[Any]], ...], body: bytes, payload: Any) -> list[Any]:
    """The body's validation errors in pydantic's strict mode as the first of
    ``validators`` that takes it (none: the errors of each, under its name, as a union's
    are). Errors of vLLM's own validators propagate (they are not pydantic's), where no
    model takes the body: SageMaker's route raised the completion model's on a chat body
    whose strict pass had failed on an integral float, one the chat model then took."""
    errors: list[Any] = []
    raised: VLLMValidationError | None = None
    for name, validator in validators:
        try:
            found = _strict_errors(validator, body, payload)
        except VLLMValidationError as refusal:
            raised = raised or refusal
            continue
        if not found:
            return []
        errors += found if len(validators) == 1 else [{**error, "loc": (name, *error["loc"])} for error in found]
    if raised is not None:
        raise raised
    return errors


def _strict_errors(validator: TypeAdapter[Any], body: bytes, payload: Any) -> list[Any]:
    """The errors of one body model, including what strict validation alone misses
    (``missed_errors``; ``payload`` is the body parsed)."""
    try:
        validated = validator.validate_json(body, strict=True)
    except ValidationError as invalid:
        if not any(map(_json_schema_form, invalid.errors())):
            return invalid.errors()
        # Strict mode refuses forms the schema allows: JSON Schema's integers include
        # 35148.0, and a binary string is a JSON string. vLLM's (lax) validation takes
        # both; such a body is validated as vLLM does, and then checked for coercions,
        # which is all that strict mode adds (so a union keeps the branch they fit).
        try:
            validated = validator.validate_json(body)
        except ValidationError as lax:
            return lax.errors()
    errors = missed_errors(validated, payload, ())
    if type(validated).__name__ in CHAT_BODIES:
        errors += typed_part_errors(payload)
    return errors


# Chat bodies whose message content parts vLLM's parser reads by their type.
CHAT_BODIES = frozenset({"ChatCompletionRequest", "BatchChatCompletionRequest", "TokenizeChatRequest"})


@functools.cache
def _typed_parts() -> dict[str, TypeAdapter[Any]]:
    """vLLM's chat content part models by the ``type`` each declares."""
    from vllm.renderers.chat_utils import ChatCompletionContentPartParam

    parts: dict[str, TypeAdapter[Any]] = {}
    for member in typing.get_args(ChatCompletionContentPartParam):
        declared = typing.get_type_hints(member).get("type") if isinstance(member, type) else None
        for kind in typing.get_args(declared) if declared is not None else ():
            parts[kind] = TypeAdapter(member)
    return parts


def typed_part_errors(payload: Any) -> list[Any]:
    """A content part that names its type must be that part: vLLM's union of parts also
    holds models that take any object (a part told apart by its key, such as
    ``{"image_url": ...}``), so pydantic let ``{"type": "thinking", "thinking": 5}``
    through, and vLLM's parser rendered it (fresh-seed fuzzing, ten seeds of ten)."""
    messages = payload.get("messages") if isinstance(payload, dict) else None
    if not isinstance(messages, list):
        return []
    batched = bool(messages) and all(isinstance(conversation, list) for conversation in messages)
    located: list[tuple[tuple[int, ...], list[Any]]] = (
        [((number,), conversation) for number, conversation in enumerate(messages)] if batched else [((), messages)]
    )
    errors: list[Any] = []
    parts = _typed_parts()
    for prefix, conversation in located:
        for index, message in enumerate(conversation):
            content = message.get("content") if isinstance(message, dict) else None
            for position, part in enumerate(content if isinstance(content, list) else []):
                adapter = parts.get(str(part.get("type"))) if isinstance(part, dict) else None
                if adapter is None:
                    continue
                try:
                    adapter.validate_python(part, strict=True)
                except ValidationError as invalid:
                    loc = ("messages", *prefix, index, "content", position)
                    errors += [{**error, "loc": (*loc, *error["loc"])} for error in invalid.errors()]
    return errors


def _json_schema_form(error: Any) -> bool:
    value = error.get("input")
    return (error.get("type") == "int_type" and isinstance(value, float) and value.is_integer()) or (
        error.get("type") == "bytes_type" and isinstance(value, str)
    )


def missed_errors(value: Any, raw: Any, loc: tuple[Any, ...]) -> list[Any]:
    """Walk the validated ``value`` beside the ``raw`` JSON it came from, for two
    things a strict validation lets through:

    - pydantic validates an ``Iterable[...]`` field lazily, when it is iterated, and
      takes any iterable input (a JSON object too); vLLM's message types, from the
      openai SDK's TypedDicts, have such fields (``content``). Each such iterator is
      exhausted here: the schema says array, and the items must validate;
    - a model one of vLLM's before-validators built itself, in lax mode, may hold a
      coerced scalar (a Responses ``function_call`` input item is built as
      ``ResponseFunctionToolCall(**item)``, so ``"async": 0`` became ``False``): a
      scalar whose JSON type differs from the body's is an error; so is a list made
      of a JSON object (a chat message's ``"tool_calls": {}`` became ``[]``, its keys)."""
    if isinstance(value, Iterator) or (isinstance(value, list) and isinstance(raw, dict)):
        if not isinstance(raw, list):
            return [{"type": "list_type", "loc": loc, "msg": "Input should be a valid array", "input": raw}]
        try:
            items = list(value)
        except ValidationError as invalid:
            return [{**error, "loc": (*loc, *error["loc"])} for error in invalid.errors()]
        return _list_errors(items, raw, loc)
    if isinstance(value, BaseModel) and isinstance(raw, dict):
        return _nested_errors(
            [
                (field.alias or name, getattr(value, name), raw.get(field.alias or name))
                for name, field in type(value).model_fields.items()
            ],
            loc,
        )
    if isinstance(value, dict) and isinstance(raw, dict):
        return _nested_errors([(key, item, raw.get(key)) for key, item in value.items()], loc)
    if isinstance(value, list) and isinstance(raw, list):
        return _list_errors(value, raw, loc)
    return []


_SCALARS = frozenset({int, str, float, bool, type(None)})


def _list_errors(value: list[Any], raw: list[Any], loc: tuple[Any, ...]) -> list[Any]:
    # Prompts are lists of thousands of token ids: where every item kept its type,
    # only containers are walked (a test at C speed).
    types = list(map(type, value))
    if types == list(map(type, raw)):
        if _SCALARS.issuperset(types):
            return []
        return _nested_errors(
            [(index, item, raw[index]) for index, item in enumerate(value) if type(item) not in _SCALARS], loc
        )
    return _nested_errors(list(zip(range(len(value)), value, raw, strict=False)), loc)


def _nested_errors(children: list[tuple[Any, Any, Any]], loc: tuple[Any, ...]) -> list[Any]:
    errors: list[Any] = []
    for key, value, raw in children:
        if type(value) not in _SCALARS:
            errors += missed_errors(value, raw, (*loc, key))
        elif _coerced(value, raw):
            errors.append(
                {
                    "type": f"{_json_type(value)}_type",
                    "loc": (*loc, key),
                    "msg": f"Input should be a valid {_json_type(value)}",
                    "input": raw,
                }
            )
    return errors


def _coerced(value: Any, raw: Any) -> bool:
    # Nulls either side are not coercions: validators fill in or clear values on purpose.
    return value is not None and raw is not None and type(raw) in _SCALARS and _json_type(value) != _json_type(raw)


def _json_type(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "boolean"
    return "string" if isinstance(value, str) else "number"


def body_models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a body annotation admits (through unions and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        return [model for argument in typing.get_args(annotation) for model in body_models(argument)]
    return []


def _is_ours(route: APIRoute) -> bool:
    return route.endpoint.__module__.split(".")[0] == "app"


def openai_body_routes(app: FastAPI, strict: bool, generating: bool) -> dict[str, OpenAIBodyRoute]:
    """vLLM's POST routes whose bodies the server reads first, by path: to validate
    them strictly (``strict``; ours validate strictly already) and, where they
    generate, to salt them and charge their tokens (``generating``: there is a salt
    or a token limit to apply)."""
    routes: dict[str, OpenAIBodyRoute] = {}
    annotations: dict[str, Any] = {}
    dispatching: list[str] = []
    for route in app.routes:
        if not isinstance(route, APIRoute) or "POST" not in route.methods or _is_ours(route):
            continue
        if route.path in DISPATCHING_GENERATE_PATHS:
            dispatching.append(route.path)
            continue
        params = route.dependant.body_params
        annotation: Any = params[0].field_info.annotation if len(params) == 1 else None
        if not (models := body_models(annotation)):
            continue
        annotations[route.path] = annotation
        generates = generating and any("cache_salt" in model.model_fields for model in models)
        validator = ((route.path, TypeAdapter(annotation)),) if strict else None
        if generates or validator is not None:
            routes[route.path] = OpenAIBodyRoute(
                strict_validator=validator, generates=generates, stateful=route.path in REPLACED_PATHS
            )
    for path in dispatching if generating or strict else []:
        # The first body model that takes it, in vLLM's order (a union would also run the
        # others' validators, which raise on a chat body).
        bodies = tuple(
            (getattr(annotations[target], "__name__", target), TypeAdapter(annotations[target]))
            for target in DISPATCHING_GENERATE_PATHS[path]
            if target in annotations
        )
        routes[path] = OpenAIBodyRoute(strict_validator=bodies if strict and bodies else None, generates=generating)
    if strict:
        _validate_as_vllm_does_later(routes, annotations)
    return routes


# Fields a body model takes as any value, which vLLM validates later as another model's
# (a batch's response format becomes each conversation's chat request's, in lax mode):
# validated strictly as that model's.
VALIDATED_LATER_AS = {("BatchChatCompletionRequest", "response_format"): ("ChatCompletionRequest", "response_format")}


def _validate_as_vllm_does_later(routes: dict[str, OpenAIBodyRoute], annotations: dict[str, Any]) -> None:
    models = {
        model.__name__: (path, model) for path, annotation in annotations.items() for model in body_models(annotation)
    }
    for (name, field), (source, source_field) in VALIDATED_LATER_AS.items():
        if name in models and source in models and routes[models[name][0]].strict_validator is not None:
            path, model = models[name]
            typed = models[source][1].model_fields[source_field]
            derived = create_model(name, __base__=model, **{field: (typed.annotation, None)})  # type: ignore[call-overload]
            routes[path] = replace(routes[path], strict_validator=((name, TypeAdapter(derived)),))


def metrics_read_only(app: FastAPI) -> None:
    """vLLM mounts Prometheus's app at ``/metrics``, which answers every method (a
    ``TRACE`` or ``DELETE`` got 200 with the metrics): other methods than GET and HEAD
    get 405, as on every other route."""
    for route in app.router.routes:
        if isinstance(route, Mount) and route.path == "/metrics":
            route.app = _read_only(route.app)


def rebuild_middleware_stack(app: FastAPI, prebuilt: ASGIApp | None) -> None:
    """Build the app's middleware stack again (ours added since vLLM's SageMaker loader
    built it), keeping vLLM's HTTP metrics (``http_requests_total``…) counting: the
    instrumentator's middleware registers its metrics when it is built, and built a
    second time it finds them registered and records nothing. The new one is given the
    first one's instrumentations."""
    app.middleware_stack = app.build_middleware_stack()
    first, second = _instrumentator_in(prebuilt), _instrumentator_in(app.middleware_stack)
    if first is not None and second is not None:
        for kept in ("instrumentations", "async_instrumentations", "inprogress"):
            setattr(second, kept, getattr(first, kept))


def _instrumentator_in(stack: ASGIApp | None) -> Any:
    node: Any = stack
    while node is not None and type(node).__name__ != "PrometheusInstrumentatorMiddleware":
        node = getattr(node, "app", None)
    return node


def _read_only(asgi: ASGIApp) -> ASGIApp:
    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD"):
            error = APIError(405, "Method Not Allowed", code="method_not_allowed", headers={"Allow": "GET, HEAD"})
            await send_http_error(send, error)
            return
        await asgi(scope, receive, send)

    return guarded


def drop_unserved_routes(app: FastAPI) -> None:
    _drop_routes(app, UNSERVED_PATHS)


def drop_routes_the_model_cannot_serve(app: FastAPI) -> None:
    """Once vLLM's state is set up (in the lifespan, before the first request and so
    before the schema is built)."""
    _drop_routes(
        app, {path for path, handler in MODEL_DEPENDENT_PATHS.items() if getattr(app.state, handler, None) is None}
    )


def drop_replaced_routes(app: FastAPI) -> None:
    app.router.routes[:] = [
        route
        for route in app.router.routes
        if not (isinstance(route, APIRoute) and route.path in REPLACED_PATHS and not _is_ours(route))
    ]


def _drop_routes(app: FastAPI, paths: set[str] | frozenset[str]) -> None:
    app.router.routes[:] = [route for route in app.router.routes if getattr(route, "path", None) not in paths]
