"""The open-file limit and the connection cap under it.

Every connection holds a descriptor; the process holds others (model files while loading,
the grammar checker's pipes, logs, the listening socket). The cap keeps `RESERVED_FDS` of the
limit for those, so accept() never fails for lack of descriptors. `raise_soft_limit` lifts
the soft limit to the hard one first (mlx-lm sets (2048, 4096) when imported, so it runs
after that import).
"""
from __future__ import annotations

import resource

from lockstep.server.api.connections import DEFAULT_MAX_CONNECTIONS

RESERVED_FDS = 128
# Where the hard limit is unlimited, the soft one is raised this far.
UNLIMITED_TARGET = 65536


def raise_soft_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (where allowed); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # e.g. a platform cap below the hard limit (macOS's OPEN_MAX)
            pass
    return UNLIMITED_TARGET if soft == resource.RLIM_INFINITY else soft


def max_connections(requested: int | None, soft_limit: int) -> int:
    """The connection cap: `requested` (ValueError when the limit has no room for it), else
    the default or what the limit leaves room for, whichever is lower."""
    room = soft_limit - RESERVED_FDS
    if requested is None:
        if room < 1:
            raise ValueError(f"the open-file limit ({soft_limit}) leaves no room for connections: it must be "
                             f"above {RESERVED_FDS} (ulimit -n)")
        return min(DEFAULT_MAX_CONNECTIONS, room)
    if requested > room:
        raise ValueError(f"--max-connections {requested} needs an open-file limit of at least "
                         f"{requested + RESERVED_FDS}; it is {soft_limit} (ulimit -n, or launchd's "
                         f"SoftResourceLimits NumberOfFiles)")
    return requested
