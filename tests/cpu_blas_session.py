"""A pytest plugin (`-p tests.cpu_blas_session`, pyproject's addopts): the BLAS the suite runs on.

By default the suite runs the way `lockstep serve` runs on this CPU (`--cpu-blas auto`):
MLX's float32 matmuls on OpenBLAS through lockstep's shim, so the embedded model loads as
float32 and prompts prefill far faster than on the reference BLAS (README: the CPU default).
pytest re-executes itself once with the shim preloaded. That happens here, while plugins
load and before pytest captures output (a conftest would be too late: the new process would
inherit the capture's files).

OpenBLAS's rows depend on how many rows a call has; the reference BLAS's do not. Tests whose
premise is that native invariance (marked `reference_blas`) are left out of an OpenBLAS
session and run in a second session under the reference BLAS
(`LOCKSTEP_TEST_CPU_BLAS=reference pytest -m reference_blas`, which `make test` runs too); a
session that left them out ends by naming that command.
"""
import os

import pytest

REFERENCE = os.environ.get("LOCKSTEP_TEST_CPU_BLAS", "openblas") == "reference"

from lockstep.kernels import cpu_blas  # noqa: E402

cpu_blas.ensure_preloaded(choice="reference" if REFERENCE else "openblas")

REFERENCE_SESSION = "LOCKSTEP_TEST_CPU_BLAS=reference pytest -m reference_blas"
_LEFT_OUT = pytest.StashKey[int]()


def pytest_configure(config):
    config.addinivalue_line("markers", "reference_blas: needs the reference BLAS's native batch "
                                       "invariance (runs in the reference-BLAS session of `make test`)")


def pytest_collection_modifyitems(config, items):
    if REFERENCE or cpu_blas.active() != "openblas":
        return  # the shim could not be built: this session is the reference one
    deselected = [item for item in items if item.get_closest_marker("reference_blas")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("reference_blas")]
        config.stash[_LEFT_OUT] = len(deselected)


def pytest_sessionfinish(session):
    # an xdist worker collects on its own: it hands its count to the controller, which reports
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:
        worker_output["reference_blas_left_out"] = session.config.stash.get(_LEFT_OUT, 0)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    left_out = getattr(node, "workeroutput", {}).get("reference_blas_left_out", 0)
    node.config.stash[_LEFT_OUT] = max(node.config.stash.get(_LEFT_OUT, 0), left_out)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} reference_blas test(s) need the reference BLAS and did not run in this OpenBLAS "
            f"session; run them with: {REFERENCE_SESSION}", yellow=True)
