"""The sharded runtime: the model split over several processes by a placement plan (driver, worker, messages).

Callers import from here. It uses the model (inference.model) and the plan (inference.planning), never the
serving engine above it: inference.serving.builders wraps a ShardedModel in the engine.
"""
from inference.sharding.driver import STORE_ENV, ShardCache, ShardedModel, ShardFailure, ShardSetHealth
from inference.sharding.messages import LinkEmulation, ShardTimeouts

__all__ = ["STORE_ENV", "LinkEmulation", "ShardCache", "ShardFailure", "ShardSetHealth", "ShardTimeouts", "ShardedModel"]
