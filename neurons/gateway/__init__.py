"""The organic OpenAI-compatible gateway."""
