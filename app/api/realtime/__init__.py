"""The OpenAI Realtime API (GA, text) on our sessions: router, connection, serving,
protocol kept apart as in vLLM's own ``realtime/``."""
