"""Test double: skinny's dense kernel as if it ran here, its launch (`custom.dense_one_launch`)
a stand-in kernel of (M, K) rows, taken where the real launch takes the call (1..64 rows, a
float dtype), x and the output in the layer's shapes as the real launch has them."""
import math

from lockstep.kernels import custom
from lockstep.kernels.custom.skinny import FLOAT_DTYPES, MAX_ROWS


def emulate(monkeypatch, kernel) -> None:
    """From now on (this test) skinny's dense launches run `kernel(rows, w)`."""
    def one_launch(lead, n, k, dtype):
        if not (1 <= math.prod(lead) <= MAX_ROWS and dtype in FLOAT_DTYPES):
            return None
        return lambda x, w: [kernel(x.reshape(-1, k), w).reshape(*lead, n)]

    monkeypatch.setattr(custom, "dense_one_launch", one_launch)
