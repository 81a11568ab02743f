"""Operator routes. Resetting the device prefix cache while keeping the CPU tier is
how an operator (or a test) proves that a prefix is served from the tier."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request

from app.api.deps import EngineDep, ServiceDep
from app.api.sessions.protocol import ResetCacheResponse
from app.errors import APIError, OpenAIErrorBody
from app.http.auth import bearer_token

router = APIRouter(prefix="/v1/admin", tags=["admin"])


def _require_admin(request: Request) -> None:
    admin_keys = request.app.state.settings.admin_api_keys
    if not admin_keys:
        return  # any caller the API-key middleware let in
    token = (bearer_token(request.scope) or "").encode()
    if not any(hmac.compare_digest(token, key.get_secret_value().encode()) for key in admin_keys):
        raise APIError(403, "This route needs an admin API key.", code="admin_key_required")


@router.post(
    "/reset_device_cache",
    response_model=ResetCacheResponse,
    responses={
        403: {"description": "Admin API keys are set, and this is not one", "model": OpenAIErrorBody},
        409: {"description": "Requests or open sessions hold device blocks", "model": OpenAIErrorBody},
    },
)
async def reset_device_cache(request: Request, engine: EngineDep, service: ServiceDep) -> ResetCacheResponse:
    """Drop the device prefix cache; the CPU tier keeps everything it holds.

    vLLM refuses while any request holds device blocks (an open session does),
    and so does this route, with 409.
    """
    _require_admin(request)
    # Sessions parked a moment ago are whole in the tier before their device copy goes.
    await service.tier_barrier()
    if not await engine.reset_prefix_cache(reset_running_requests=False, reset_connector=False):
        raise APIError(
            409,
            "The device cache is in use (open sessions or running requests hold blocks); close them and retry.",
            code="device_cache_in_use",
        )
    return ResetCacheResponse(device_cache_reset=True)
