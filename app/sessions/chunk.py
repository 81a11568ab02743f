"""What a chunk yields (its deltas, then its result), and the reasons it ends with."""

from __future__ import annotations

from dataclasses import dataclass

from app.protocol import ChunkUsage

# The close reason of a session whose engine request failed.
ENGINE_ERROR = "engine_error"
# The finish reason of an answer stopped early on request (the session goes on).
CANCELLED = "cancelled"


@dataclass
class ChunkDelta:
    token_ids: list[int]
    text: str


@dataclass
class ChunkResult:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: ChunkUsage
    time_to_first_token: float | None
    # For the first chunk after a park: where its prefix came from.
    resumed_from: str | None = None
    # Where the chunk began when it cut the context (a re-rendered chat turn); None: at its end.
    start: int | None = None
