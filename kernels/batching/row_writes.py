"""The KV pool's row write as one call on a tiny array, which makes MLX compile its kernel.

MLX's CUDA backend compiles `put_along_axis`'s kernel per dtype on first use (seconds, cached
on disk after). The pool runs this once per KV dtype when it is built (kv_pool.py), and a
starting server's children run it ahead (server/warm_ahead.py), importing nothing but MLX.
"""
import mlx.core as mx


def write_rows_once(dtype) -> None:
    """One `put_along_axis` of `dtype` rows by int32 slots, along the pool's token axis."""
    into = mx.zeros((1, 2, 1), dtype)
    mx.eval(mx.put_along_axis(into, mx.zeros((1, 1, 1), mx.int32), mx.ones((1, 1, 1), dtype), axis=1))
