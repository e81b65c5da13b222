"""The generation engine: scheduling and batching requests into forward passes, request
state, token sources, speculative decoding, sampling, stop strings, the prefix cache and
decode plans. `Engine` (scheduler.py) is its entry point; nothing here knows about HTTP."""
from server.engine.handle import GenerationError, QueueFull, RequestHandle, ShuttingDown, TooLargeForMemory
from server.engine.scheduler import Engine, EngineObserver

__all__ = ["Engine", "EngineObserver", "GenerationError", "QueueFull", "RequestHandle", "ShuttingDown",
           "TooLargeForMemory"]
