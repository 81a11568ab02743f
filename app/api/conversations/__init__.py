"""OpenAI's Conversations API: a conversation is a session, its items a log beside it."""
