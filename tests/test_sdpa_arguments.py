"""The attention wrapper's argument binding (kernels/invariance/layers._sdpa_arguments): the
same names and values as inspect's bind for every way mlx-lm calls it, and inspect's errors
for calls it would refuse."""
import pytest

from lockstep.kernels.invariance.layers import _SDPA_SIGNATURE, _sdpa_arguments

CALLS = [
    (("q", "k", "v"), dict(cache="c", scale=0.5, mask=None)),          # mlx-lm's models
    (("q", "k", "v", "c", 0.5, "m"), {}),
    (("q", "k", "v", "c"), dict(scale=0.5, mask="causal", sinks="s")),
    ((), dict(queries="q", keys="k", values="v", cache=None, scale=1.0, mask=None)),
]


@pytest.mark.parametrize("args,kwargs", CALLS)
def test_binding_matches_inspect(args, kwargs):
    want = dict(_SDPA_SIGNATURE.bind(*args, **kwargs).arguments)
    got = _sdpa_arguments(args, kwargs)
    assert got == want


@pytest.mark.parametrize("args,kwargs", [
    (("q", "k", "v"), dict(scale=0.5, mask=None)),                    # no cache
    (("q", "k", "v", "c", 0.5, "m"), dict(mask="again")),              # twice
    (("q", "k", "v"), dict(cache=None, scale=1, mask=None, window=3)),  # unknown name
    (("q", "k", "v", "c", 1, None, None, "extra"), {}),                # too many
])
def test_calls_inspect_refuses_are_refused_the_same_way(args, kwargs):
    with pytest.raises(TypeError):
        _SDPA_SIGNATURE.bind(*args, **kwargs)
    with pytest.raises(TypeError):
        _sdpa_arguments(args, kwargs)
