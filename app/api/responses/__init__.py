"""OpenAI's Responses API on sessions: a ``previous_response_id`` chain or a conversation
is a session, and each response a chunk that sends only what is new."""
