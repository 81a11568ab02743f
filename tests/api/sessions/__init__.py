"""The sessions API: REST, SSE, the session websocket, the clients."""
