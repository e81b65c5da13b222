"""Which backend MLX computes on, by name: what the audit's probes and every stored verdict
(verdict_cache.py) are keyed by. Imports nothing of lockstep, so every kernels package may use it.
"""
import mlx.core as mx


def backend_kind() -> str:
    """'cpu', 'metal', 'cuda' or 'gpu' (a GPU backend this module does not know)."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "gpu"
