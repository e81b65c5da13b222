"""The generation engine: scheduling and batching requests into forward passes, request
state, token sources, speculative decoding, sampling, stop strings, the prefix cache and
decode plans. `Engine` (engine.py) is its entry point; nothing here knows about HTTP."""
from lockstep.server.engine.scheduling.errors import GenerationError, QueueFull, ShuttingDown, TooLargeForMemory
from lockstep.server.engine.scheduling.handle import RequestHandle
from lockstep.server.engine.engine import Engine, EngineObserver

__all__ = ["Engine", "EngineObserver", "GenerationError", "QueueFull", "RequestHandle", "ShuttingDown",
           "TooLargeForMemory"]
