"""Serving: the engine (scheduler, admission), sampling, metrics, engine builders, remote engines, the OpenAI-compatible server."""
