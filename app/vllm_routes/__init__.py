"""vLLM's own OpenAI routes as this server hosts and hardens them."""
