"""Python clients for the streaming-sessions server: async and sync, REST or websocket."""

from clients._common import ChunkReply, ChunkUsage, Delta, SessionObject, TranscriptResponse
from clients.async_client import AsyncSession, AsyncSessionsClient
from clients.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    RateLimitError,
    StreamsessError,
)
from clients.sync_client import Session, SessionsClient

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncSession",
    "AsyncSessionsClient",
    "AuthenticationError",
    "BadRequestError",
    "ChunkReply",
    "ChunkUsage",
    "ConflictError",
    "Delta",
    "NotFoundError",
    "RateLimitError",
    "Session",
    "SessionObject",
    "SessionsClient",
    "StreamsessError",
    "TranscriptResponse",
]
