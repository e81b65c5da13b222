"""Batch invariance: the canonical forms (strategies and their row-wise ops), the layers that
put them into a loaded mlx-lm model, the cache check, chunk-aligned prefill, and the
bitwise self-test that proves a form on this model and backend before it is claimed.

    from lockstep.kernels.invariance import set_batch_invariant_limit
    invariance = set_batch_invariant_limit(model, 8)

limit.py is the entry point (see its docstring); ops.py the strategies and ops; layers.py
the model hooks; cache_check.py the per-request cache check; selftest.py the proof;
prefill.py, prefill_attention.py and composed_attention.py the prefill and attention forms.
"""
from .cache_check import cache_invariance_problem
from .limit import InstalledInvariance, set_batch_invariant_limit
from .ops import STRATEGIES, Strategy

__all__ = ["InstalledInvariance", "STRATEGIES", "Strategy", "cache_invariance_problem",
           "set_batch_invariant_limit"]
