"""Transport helpers that know nothing of sessions: websocket event channels."""
