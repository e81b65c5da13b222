"""tests/cpu_blas_session.py: a plain session that leaves the reference_blas tests out says so,
and names the one command that runs them."""
from lockstep.kernels import cpu_blas
from tests.cpu_blas_session import REFERENCE_SESSION

pytest_plugins = ["pytester"]

MARKED = """
import pytest

@pytest.mark.reference_blas
def test_needs_the_reference_blas():
    pass

def test_runs_anywhere():
    pass
"""


def test_a_session_that_leaves_reference_blas_tests_out_names_the_command_that_runs_them(pytester):
    pytester.makepyfile(MARKED)
    result = pytester.runpytest_inprocess("-p", "tests.cpu_blas_session", "-q")
    out = result.stdout.str()
    if cpu_blas.active() != "openblas":  # this session is the reference one: nothing is left out
        result.assert_outcomes(passed=2)
        assert REFERENCE_SESSION not in out
        return
    result.assert_outcomes(passed=1, deselected=1)
    assert "1 reference_blas test(s) need the reference BLAS" in out and REFERENCE_SESSION in out, out
