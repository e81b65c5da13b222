"""bench/decode_ahead.py: its header says L is guaranteed only where the self-test proved it."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import decode_ahead  # noqa: E402

from lockstep.server.engine.guarantee.guarantee import Guarantee  # noqa: E402


def test_an_unproven_l_is_not_called_guaranteed_rows():
    words = decode_ahead.guarantee_words(Guarantee(call_rows=8, proven=False))
    assert "guaranteed" not in words and "L = 8 not proven" in words


def test_a_proven_l_is_the_guaranteed_rows():
    words = decode_ahead.guarantee_words(Guarantee(call_rows=8, proven=True, shared_passes=True))
    assert words.startswith("guaranteed rows 8, shared passes True")
