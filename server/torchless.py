"""Keep PyTorch out of lockstep's process.

lockstep runs on MLX alone, but transformers (loaded for the tokenizer) imports torch
whenever it is installed, and that was most of a model load's time at every start where
torch is present (the restart figures:
bench/results/history/2026-11-30-h200-attention-fix-skinny-speculation-restart.md).
Marking torch absent
(`sys.modules["torch"] = None`) makes transformers' availability check answer no and any
`import torch` fail at once. LOCKSTEP_ALLOW_TORCH=1 leaves it importable.
"""
from __future__ import annotations

import os
import sys

ALLOW_ENV = "LOCKSTEP_ALLOW_TORCH"


def keep_torch_out() -> bool:
    """Mark torch absent for this process unless allowed or already imported; True if marked."""
    if os.environ.get(ALLOW_ENV) == "1" or "torch" in sys.modules:
        return False
    sys.modules["torch"] = None
    return True
