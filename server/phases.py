"""`Phases`: the seconds each startup phase took, in the order they ran."""
from __future__ import annotations

import time
from contextlib import contextmanager


class Phases(dict):
    """Seconds per startup phase (import, load, quantize, audit, fingerprint, self_test,
    warm_up), in the order they ran; a phase met twice (the draft model's load) adds up.
    `compile`: the custom kernels' NVRTC seconds per phase where there were any (added up over
    the threads that compile them concurrently, so it may exceed the phase's own time)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.compile: dict[str, float] = {}

    @contextmanager
    def timed(self, phase: str):
        from lockstep.kernels.custom.compiled import compile_seconds

        start, compiled = time.perf_counter(), compile_seconds()
        try:
            yield
        finally:
            self[phase] = self.get(phase, 0.0) + time.perf_counter() - start
            spent = compile_seconds() - compiled
            if spent > 0:
                self.compile[phase] = self.compile.get(phase, 0.0) + spent

    def line(self) -> str:
        return ", ".join(f"{k.replace('_', '-')} {v:.1f}s" + (f" (compile {self.compile[k]:.1f}s)" if k in self.compile else "")
                         for k, v in self.items())
