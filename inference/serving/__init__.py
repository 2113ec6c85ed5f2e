"""Serving: the engine interface (engine.py), the in-process engine (local_engine.py) and its step scheduler
(scheduler.py), metrics, the engine builders, remote engines (vLLM/SGLang) and the OpenAI-compatible server.

Callers import from here. Serving sits on top of the model (inference.model) and of the sharded runtime
(inference.sharding, loaded by the builders only when a sharded engine is asked for); nothing below imports it.
"""
from inference.decoding.sampling import MAX_LOGPROBS, SampledToken, SamplingParams, TokenSampler
from inference.serving.builders import (ENGINE_KINDS, EngineSpec, EngineSpecError, build_engine, build_sharded_engine,
                                        load_reference_model)
from inference.serving.engine import (Engine, EngineCapabilities, EngineError, EngineHealth, EngineSettings,
                                      EventStream, FinalEvent, GenerationRequest, ScoredPosition, TokenEvent,
                                      WrappedEngine)
from inference.serving.local_engine import LocalEngine
from inference.serving.metrics import EngineMetrics
from inference.serving.openai_server import OpenAICompatibleServer
from inference.serving.remote import RemoteEngine, RemoteSettings

__all__ = [
    "ENGINE_KINDS", "Engine", "EngineCapabilities", "EngineError", "EngineHealth", "EngineMetrics",
    "EngineSettings", "EngineSpec", "EngineSpecError", "EventStream", "FinalEvent", "GenerationRequest",
    "LocalEngine", "MAX_LOGPROBS", "OpenAICompatibleServer", "RemoteEngine", "RemoteSettings", "SampledToken",
    "SamplingParams", "ScoredPosition", "TokenEvent", "TokenSampler", "WrappedEngine", "build_engine",
    "build_sharded_engine", "load_reference_model",
]
