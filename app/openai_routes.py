"""Which of vLLM's routes this server serves, and what it checks in their bodies.

vLLM's ``build_app`` mounts far more than ``/v1/completions`` and
``/v1/chat/completions``: the Responses and Anthropic Messages APIs, chat batches,
SageMaker's ``/invocations``, structured decisions, generative scoring. Each of those
generates on the shared prefix cache, so each must carry the caller's cache salt, or
one key reads another's prompts through its usage (``cached_tokens``). The table is
built from the app's own routes: a route whose body model declares ``cache_salt``
generates, so routes a newer vLLM adds are salted by construction.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter

# SageMaker's route reads its body itself and hands it to the chat or completion
# handler, whichever model validates it: it generates, with no body model to check.
DISPATCHING_GENERATE_PATHS = frozenset({"/invocations"})
# Data-parallel rescaling: this server runs one engine per replica, so a rescale
# can only fail (vLLM answers 500), and any key could ask for it. Not served.
UNSERVED_PATHS = frozenset({"/scale_elastic_ep", "/is_scaling_elastic_ep"})
# Routes vLLM mounts for every model but answers 501 on models without their serving
# handler (set in app.state by vLLM's init_app_state): served only where they work.
MODEL_DEPENDENT_PATHS = {"/v1/systemone": "serving_structured_decisions"}


@dataclass(frozen=True)
class OpenAIBodyRoute:
    """What the server does with a vLLM route's JSON body before vLLM reads it."""

    strict_validator: TypeAdapter[Any] | None  # validate in strict mode (None: leave it to vLLM)
    generates: bool  # it reaches the prefix cache: salt it, charge its tokens


def body_models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a body annotation admits (through unions and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        return [model for argument in typing.get_args(annotation) for model in body_models(argument)]
    return []


def _is_ours(route: APIRoute) -> bool:
    return route.endpoint.__module__.split(".")[0] == "app"


def openai_body_routes(app: FastAPI, strict: bool) -> dict[str, OpenAIBodyRoute]:
    """vLLM's POST routes with a JSON body, by path (ours validate strictly already)."""
    routes: dict[str, OpenAIBodyRoute] = {}
    for route in app.routes:
        if not isinstance(route, APIRoute) or "POST" not in route.methods or _is_ours(route):
            continue
        if route.path in DISPATCHING_GENERATE_PATHS:
            routes[route.path] = OpenAIBodyRoute(strict_validator=None, generates=True)
            continue
        params = route.dependant.body_params
        annotation: Any = params[0].field_info.annotation if len(params) == 1 else None
        if not (models := body_models(annotation)):
            continue
        generates = any("cache_salt" in model.model_fields for model in models)
        validator = TypeAdapter(annotation) if strict else None
        if generates or validator is not None:
            routes[route.path] = OpenAIBodyRoute(strict_validator=validator, generates=generates)
    return routes


def drop_unserved_routes(app: FastAPI) -> None:
    _drop_routes(app, UNSERVED_PATHS)


def drop_routes_the_model_cannot_serve(app: FastAPI) -> None:
    """Once vLLM's state is set up (in the lifespan, before the first request and so
    before the schema is built)."""
    _drop_routes(app, {path for path, handler in MODEL_DEPENDENT_PATHS.items()
                       if getattr(app.state, handler, None) is None})


def _drop_routes(app: FastAPI, paths: set[str] | frozenset[str]) -> None:
    app.router.routes[:] = [route for route in app.router.routes if getattr(route, "path", None) not in paths]
