"""vLLM's own OpenAI routes as this server hosts them."""
