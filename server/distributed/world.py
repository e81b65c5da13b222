"""Joining the deployment's ranks: which backend, `mx.distributed.init` under a connect
timeout, and the startup check that every rank runs the same software on the same settings."""
from __future__ import annotations

import faulthandler
import hashlib
import json
import logging
import os
from dataclasses import dataclass

import mlx.core as mx

from lockstep.server.options import BACKENDS, PARALLEL_MODES  # noqa: F401 (checked here)

log = logging.getLogger("lockstep.distributed")


class DistributedStartupError(RuntimeError):
    """The deployment cannot start; the message says why and what to change."""


@dataclass(frozen=True)
class World:
    group: object  # mx.distributed.Group
    rank: int
    size: int
    backend: str
    parallel: str  # "tensor" | "pipeline"

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return f"{self.parallel} parallel over {self.size} ranks ({self.backend})"


def backend_from_environment(environ=os.environ) -> str | None:
    """The backend `mlx.launch` prepared this process for, from the variables it sets."""
    if environ.get("MLX_JACCL_COORDINATOR") or environ.get("MLX_IBV_DEVICES"):
        return "jaccl"
    if environ.get("NCCL_HOST_IP") or environ.get("NCCL_PORT"):
        return "nccl"
    if environ.get("MLX_HOSTFILE") or environ.get("MLX_RANK"):
        return "ring"
    if environ.get("OMPI_COMM_WORLD_RANK") or environ.get("PMI_RANK"):
        return "mpi"
    return None


def _hint(backend: str) -> str:
    if backend == "ring":
        return ("check that MLX_HOSTFILE lists reachable IP:port pairs (mlx.distributed_config "
                "writes one), that every rank was started (mlx.launch --backend ring -n N or "
                "--hostfile) and that no other deployment uses the same ports (--starting-port)")
    if backend == "jaccl":
        return "check the jaccl hostfile (RDMA devices, coordinator) and that every rank started"
    if backend == "nccl":
        return "check NCCL_HOST_IP/NCCL_PORT, MLX_WORLD_SIZE and that every rank started"
    return "start every rank with mlx.launch"


def join(parallel: str, backend: str = "any", connect_timeout: float = 120.0) -> World:
    """Initialise mlx.distributed (strict: a world of one is an error here).

    A ring rank whose peers never come blocks inside MLX without a timeout: after
    `connect_timeout` the process exits 1 instead (never a hang)."""
    if parallel not in PARALLEL_MODES:
        raise DistributedStartupError(f"--parallel must be one of {PARALLEL_MODES}")
    chosen = backend_from_environment() if backend == "any" else backend
    if chosen is None:
        raise DistributedStartupError(
            "--parallel needs a distributed launch: start it under mlx.launch (e.g. "
            "`mlx.launch --backend ring -n 2 -- lockstep serve --parallel pipeline`); no MLX "
            "launcher variables (MLX_RANK/MLX_HOSTFILE, NCCL_HOST_IP, MLX_JACCL_COORDINATOR) are set")
    if not mx.distributed.is_available(chosen):
        raise DistributedStartupError(f"the {chosen} backend is not available in this MLX build "
                                      f"(mlx {mx.__version__})")

    # MLX's ring init waits for its peers without a timeout, holding the GIL, so no Python
    # thread or signal handler can end it: faulthandler's C watchdog dumps the stack and
    # exits 1 instead. The reason is logged first, so the log says why.
    log.info("rank %s: joining the other ranks over %s; if they have not all joined within "
             "%.0f s this rank exits 1: %s", os.environ.get("MLX_RANK", "?"), chosen,
             connect_timeout, _hint(chosen))
    faulthandler.dump_traceback_later(connect_timeout, exit=True)
    try:
        group = mx.distributed.init(strict=True, backend=chosen)
    except RuntimeError as exc:
        raise DistributedStartupError(f"mx.distributed.init({chosen!r}) failed: {_explain(exc)}; "
                                      f"{_hint(chosen)}") from None
    finally:
        faulthandler.cancel_dump_traceback_later()
    if group.size() < 2:
        raise DistributedStartupError(f"--parallel {parallel} needs at least 2 ranks; this launch has 1")
    return World(group, group.rank(), group.size(), chosen, parallel)


def _explain(exc: Exception) -> str:
    text = str(exc)
    if "error: 98" in text or "error: 48" in text:  # EADDRINUSE on Linux / macOS
        text += " (the address is in use: another deployment on these ports?)"
    elif "parse_error" in text:
        text += " (MLX_HOSTFILE is not a valid hostfile: a JSON list of each rank's addresses)"
    return text


def software_identity(settings: dict) -> dict:
    """What must be equal on every rank: versions and the deployment's own settings."""
    import mlx_lm
    from importlib.metadata import PackageNotFoundError, version

    try:
        lockstep = version("lockstep")
    except PackageNotFoundError:
        lockstep = "unknown"
    from lockstep.kernels.invariance.selftest import kernels_code_version

    return {
        "lockstep": lockstep,
        "kernels_code": kernels_code_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "settings": hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16],
    }


def require_same_everywhere(world: World, what: str, mine: dict) -> None:
    """Exchange `mine` with every rank; raise naming the first field and ranks that differ."""
    from lockstep.server.distributed.collectives import gather_bytes

    blobs = gather_bytes(world.group, json.dumps(mine, sort_keys=True, default=str).encode())
    everyone = [json.loads(b) for b in blobs]
    for key in sorted(set().union(*everyone)):
        values = [e.get(key) for e in everyone]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise DistributedStartupError(f"ranks disagree on {what} `{key}` ({listing}); every rank "
                                          f"must run the same lockstep, MLX and settings")
