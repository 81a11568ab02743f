"""Readiness beside vLLM's liveness: ``/health`` says the engine lives (a restart
helps otherwise); ``/ready`` says "send me new work". A proxy's health check and a
Kubernetes readiness probe read ``/ready``: a draining replica, one whose engine died
or whose store cannot be reached, or one holding its maximum of sessions answers 503,
and the proxy sends its conversations to the next replica, which takes them up from
the store. Open without an API key, as ``/health`` is."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.api.deps import ServiceDep
from app.errors import APIError, OpenAIErrorBody

router = APIRouter(tags=["health"])

READY_PATH = "/ready"
# What each reason means to an operator, in the 503's message.
REASONS = {
    "draining": "the server is draining for a stop",
    "engine_dead": "the engine has died",
    "store_unavailable": "the session store cannot be reached",
    "at_session_capacity": "the server holds its maximum of open sessions",
}


@router.get(
    READY_PATH, responses={503: {"description": "Not ready: the error's code says why", "model": OpenAIErrorBody}}
)
async def ready(service: ServiceDep) -> JSONResponse:
    """200 when this server takes new work; otherwise 503, its code the first reason."""
    reasons = await service.not_ready()
    if reasons:
        raise APIError(
            503,
            "Not ready: " + "; ".join(REASONS[reason] for reason in reasons) + ".",
            code=reasons[0],
            headers={"Retry-After": "1"},
        )
    return JSONResponse({"status": "ready"})
