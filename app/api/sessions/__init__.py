"""The sessions API: REST, SSE and the session websocket."""
