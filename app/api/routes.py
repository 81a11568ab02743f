"""Every route of ours, collected in one place (vLLM's OpenAI routes come from vLLM)."""

from fastapi import APIRouter

from app.api import admin, probes
from app.api.conversations import api_router as conversations
from app.api.realtime import api_router as realtime
from app.api.responses import api_router as responses
from app.api.sessions import rest, websocket

api_router = APIRouter()
api_router.include_router(rest.router)
api_router.include_router(websocket.router)
api_router.include_router(realtime.router)
api_router.include_router(responses.router)
api_router.include_router(conversations.router)
api_router.include_router(admin.router)
api_router.include_router(probes.router)
