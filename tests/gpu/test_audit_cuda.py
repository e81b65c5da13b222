"""The kernel audit on the GPU (kernels/audit/): a plain deployment (L = 0) gives an 8B-shaped
nvfp4 model's large layers lockstep's class before its deferred audit stages run; the narrow
stage then probes MLX's calls, on slices of the layers' rows too, with no device error, and the model
still runs after it (an H100 once hit an illegal memory access in the narrow stage, which ended
the server's engine)."""
import mlx.core as mx
import pytest

from lockstep.kernels.audit import audit_model
from lockstep.kernels.audit.widths import FIRST, NARROW
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.layers import uninstall
from tests.gpu.test_guarantee_cuda import eight_b_layers

pytestmark = pytest.mark.gpu


def test_the_narrow_stage_of_a_plain_deployments_audit_probes_mlxs_calls():
    model = eight_b_layers("nvfp4", layers=1)
    invariance = set_batch_invariant_limit(model, 0)
    try:
        assert invariance.layers.get("split_rows"), invariance.layers  # the large layers are swapped
        # the one-row stage and the narrow one (2..32 rows: the widths lockstep's plain kernels take)
        report = audit_model(model, fresh=True, stages=(FIRST, NARROW))
        mx.synchronize()  # a device error would surface here, or in the next call
        assert report.ok, [(c.config.label(), c.verdict) for c in report.configs]
        logits = model(mx.array([[1, 2, 3, 4, 5]]))
        mx.eval(logits)
        assert logits.shape[:2] == (1, 5)
    finally:
        uninstall(model)
