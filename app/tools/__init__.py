"""Tool calling: vLLM's parsers on our sessions."""
