"""Every choice list and default the `lockstep` commands offer, in one place.

A list that kernels/ or models/ defines (they may not import server/), or the engine checks
against, is re-exported or derived here, never copied; the rest is defined here, the
distributed layer's lists among them (server/distributed/ imports this module). Commands,
the runtime and the launchd job take them from here. The HTTP service's limits stay beside
their checks in server/api/ (commands/http_args.py shows them): this module is imported
where fastapi is not installed.
"""
from __future__ import annotations

from lockstep.kernels.batching.pool_mode import POOL_MODES
from lockstep.kernels.cpu_blas import CHOICES as _BLAS_LIBRARIES
from lockstep.kernels.invariance.ops import STRATEGIES
from lockstep.models.gguf_import import WEIGHT_FORMATS
from lockstep.models.quantize import Q_MODES
from lockstep.server.engine.guarantee.decode_plan import METHODS
from lockstep.server.engine.guarantee.deployment import MAX_DRAFT_TOKENS
# serve --max-active / --max-batch-rows, defined beside the rule they bound; re-exported
from lockstep.server.engine.scheduling.passes import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_BATCH_ROWS  # noqa: F401

# --- choice lists ---
WEIGHT_CHOICES = ("auto", *WEIGHT_FORMATS)  # auto: the fastest format on this backend (models/resolve.py)
QUANT_MODES = Q_MODES  # --quantize
INVARIANT_STRATEGIES = ("auto", *STRATEGIES)  # auto: the fastest one the self-test proves
SPECULATIVE_METHODS = METHODS
KV_POOL_MODES = POOL_MODES
CPU_BLAS_CHOICES = ("auto", *_BLAS_LIBRARIES)  # auto: OpenBLAS where MLX computes on a Linux CPU
# Startup verdicts: "cached" re-uses this machine's audit verdicts and self-test proofs,
# "fresh" redoes and re-stores them, "off" skips the audit (self-test still cached).
AUDIT_MODES = ("cached", "fresh", "off")
# mlx.distributed's backends and the ways a model is split across ranks (server/distributed/
# world.py checks against them; defined here since options sit below the distributed layer)
BACKENDS = ("ring", "jaccl", "nccl", "mpi")
PARALLEL_MODES = ("tensor", "pipeline")
PARALLEL_CHOICES = PARALLEL_MODES  # serve --parallel
DISTRIBUTED_BACKENDS = ("any", *BACKENDS)  # any: the one mlx.launch prepared

# --- defaults ---
DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct
DEFAULT_WEIGHTS = "auto"
DEFAULT_STRATEGY = "auto"
DEFAULT_AUDIT = "cached"
DEFAULT_KV_POOL = "auto"
DEFAULT_CPU_BLAS = "auto"
DEFAULT_SPECULATIVE = "none"
DEFAULT_NUM_DRAFT_TOKENS = 4
DEFAULT_MAX_DRAFT_TOKENS = MAX_DRAFT_TOKENS
DEFAULT_PREFILL_CHUNK = None  # the backend's: runtime.default_prefill_chunk()
DEFAULT_PREFIX_CACHE_ENTRIES = 4
DEFAULT_PROMPT_CACHE_BYTES = 2 << 30  # memory tier
DEFAULT_PROMPT_CACHE_DISK_BYTES = 8 << 30  # disk tier, when --prompt-cache-dir is on
DEFAULT_PROMPT_CACHE_DIR = "off"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
# verify and bench: L, and tokens decoded per prompt
DEFAULT_MEASURE_LIMIT = 8
DEFAULT_MEASURE_TOKENS = 64
# serve --parallel (docs/DISTRIBUTED.md)
DEFAULT_RANK_TIMEOUT_S = 20.0
DEFAULT_STARTUP_TIMEOUT_S = 900.0
DEFAULT_CONNECT_TIMEOUT_S = 120.0
