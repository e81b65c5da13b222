"""The generation engine: scheduling and batching requests into forward passes, request
state, token sources, speculative decoding, sampling, stop strings, the prefix cache and
decode plans. `Engine` (scheduler.py) is its entry point; nothing here knows about HTTP."""
from lockstep.server.engine.handle import GenerationError, QueueFull, RequestHandle, ShuttingDown, TooLargeForMemory
from lockstep.server.engine.scheduler import Engine, EngineObserver

__all__ = ["Engine", "EngineObserver", "GenerationError", "QueueFull", "RequestHandle", "ShuttingDown",
           "TooLargeForMemory"]
