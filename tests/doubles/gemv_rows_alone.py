"""Test double: gemv_rows as if proven here, its launch (`gemv_rows.one_launch`) a stand-in
kernel of (M, K) rows, taking x and giving the output in the layer's shapes as the real launch
does. The default stand-in gives every row the plain single-row call, as a correct kernel does."""
import mlx.core as mx

from lockstep.kernels.custom import gemv_rows


def rows_alone(x, w):
    """Every row of x @ w.T as the plain single-row call."""
    return mx.concatenate([x[i : i + 1] @ w.T for i in range(x.shape[0])], axis=0)


def emulate(monkeypatch, kernel=rows_alone) -> None:
    """From now on (this test) gemv_rows' launches run `kernel(rows, w)`."""
    monkeypatch.setattr(gemv_rows, "unavailable_reason", lambda: None)
    monkeypatch.setattr(gemv_rows, "one_launch",
                        lambda lead, n, k, dtype: lambda x, w: [kernel(x.reshape(-1, k), w).reshape(*lead, n)])
