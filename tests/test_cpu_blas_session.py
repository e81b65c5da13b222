"""tests/cpu_blas_session.py: a plain session that leaves the reference_blas tests out says so,
and names the one command that runs them."""
from pathlib import Path

import pytest

from lockstep.kernels import cpu_blas
from tests.cpu_blas_session import REFERENCE_SESSION

ROOT = Path(__file__).resolve().parents[1]

pytest_plugins = ["pytester"]

MARKED = """
import pytest

@pytest.mark.reference_blas
def test_needs_the_reference_blas():
    pass

def test_runs_anywhere():
    pass
"""


@pytest.mark.parametrize("workers", [None, "1"])  # `make test` runs the suite on xdist workers
def test_a_session_that_leaves_reference_blas_tests_out_names_the_command_that_runs_them(pytester, monkeypatch, workers):
    pytester.makepyfile(MARKED)
    spread = ("-n", workers, "--dist", "loadfile") if workers else ()
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # `tests.cpu_blas_session` from this tree
    run = pytester.runpytest_subprocess if workers else pytester.runpytest_inprocess
    result = run("-p", "tests.cpu_blas_session", "-q", *spread)
    out = result.stdout.str()
    if cpu_blas.active() != "openblas":  # this session is the reference one: nothing is left out
        result.assert_outcomes(passed=2)
        assert REFERENCE_SESSION not in out
        return
    # xdist's controller collects nothing itself, so its summary counts no deselection
    result.assert_outcomes(passed=1, deselected=0 if workers else 1)
    assert "1 reference_blas test(s) need the reference BLAS" in out and REFERENCE_SESSION in out, out
