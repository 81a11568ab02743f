"""The OpenAI Realtime API."""
