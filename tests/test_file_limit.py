"""server/api/file_limit.py: the soft open-file limit is raised to the hard one, and the
connection cap stays below it (a cap it has no room for is refused, naming the limit)."""
import resource
import subprocess
import sys

import pytest

from lockstep.server.api.file_limit import RESERVED_FDS, max_connections


def test_the_soft_limit_is_raised_to_the_hard_one():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = RESERVED_FDS + 10

    def lower():  # in the child only: a soft limit far below its hard one
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))

    code = ("import resource; from lockstep.server.api.file_limit import raise_soft_limit; "
            "print(raise_soft_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], preexec_fn=lower, capture_output=True, text=True, check=True)
    raised, soft, child_hard = (int(x) for x in out.stdout.split())
    assert child_hard == hard and soft == raised and (soft == hard or hard == resource.RLIM_INFINITY) and soft > low


def test_the_cap_stays_below_the_limit():
    assert max_connections(None, 100_000) == 1024
    assert max_connections(None, RESERVED_FDS + 50) == 50
    assert max_connections(50, RESERVED_FDS + 50) == 50
    with pytest.raises(ValueError, match=f"open-file limit of at least {RESERVED_FDS + 51}; it is {RESERVED_FDS + 50}"):
        max_connections(51, RESERVED_FDS + 50)
    with pytest.raises(ValueError, match="leaves no room"):
        max_connections(None, RESERVED_FDS)
