"""Wire models of the Responses and Conversations APIs.

The create body is vLLM's ``ResponsesRequest`` (its validators and sampling fields),
plus what vLLM drops: ``conversation``. Output objects are vLLM's ``ResponsesResponse``
(the openai SDK's shape) and the SDK's own conversation types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

from app.sessions.protocol import Metadata

# OpenAI's limit on the items one request may add to a conversation.
MAX_ITEMS_PER_REQUEST = 20


class ConversationRef(BaseModel):
    id: str


class ResponsesCreateRequest(ResponsesRequest):
    conversation: str | ConversationRef | None = Field(
        default=None, description="The conversation this response continues and is added to.")

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation


class ConversationCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_ITEMS_PER_REQUEST)
    metadata: Metadata | None = None


class ConversationUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: Metadata


class ConversationItemsCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_ITEMS_PER_REQUEST)


class ListOrder(BaseModel):
    after: str | None = None
    limit: int = Field(default=20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"
