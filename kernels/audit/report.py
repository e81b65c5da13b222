"""What the kernel audit found: per configuration, per path; as a table and a summary."""
from __future__ import annotations

from dataclasses import dataclass, field

from .widths import STAGES, row_ranges

OK = "ok"
REFUSED = "refused"


@dataclass(frozen=True)
class LayerConfig:
    """One distinct quantized-layer configuration; every layer sharing it runs the same kernels."""
    kind: str                 # "linear" | "embedding" | "switch"
    shape: tuple[int, ...]    # dense weight shape: (out, in) or (experts, out, in)
    mode: str
    bits: int
    group_size: int
    dtype: str                # activation dtype the kernels see
    transpose: bool = True
    has_bias: bool = False

    def label(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        return f"{self.kind} {dims} {self.mode} {self.bits}b g{self.group_size} {self.dtype}"


@dataclass(frozen=True)
class PathResult:
    """One kernel path (e.g. decode matmul M=1) of one configuration."""
    path: str
    rows: int
    error: float | None       # max |out - ref| / max |ref|; None when it raised
    tolerance: float
    exception: str | None = None
    out_rows: int = 0         # output rows (N) the probe ran on: a slice or the whole layer
    compared_rows: int | None = None  # of those, how many were compared (row_sample); None: all

    @property
    def ok(self) -> bool:
        return self.exception is None and self.error is not None and self.error <= self.tolerance


@dataclass
class ConfigResult:
    config: LayerConfig
    layers: list[str]
    paths: list[PathResult]
    # Attempts made after a failure, in order: (workaround name, its path results).
    attempts: list[tuple[str, list[PathResult]]] = field(default_factory=list)
    verdict: str = OK         # OK, a workaround name, or REFUSED

    @property
    def failing(self) -> list[PathResult]:
        return [p for p in self.paths if not p.ok]

    @property
    def accepted(self) -> list[PathResult]:
        """The path results of what will actually run (kernel or chosen workaround)."""
        if self.verdict == OK:
            return self.paths
        return next((r for name, r in self.attempts if name == self.verdict), [])


@dataclass
class AuditReport:
    backend: str
    configs: list[ConfigResult]
    seconds: float = 0.0
    cached: int = 0           # configurations whose verdict came from the audit cache
    # stages (kernels/audit/widths.py) some configuration still needs, or refused after
    # serving started: calls of their widths are not audited
    deferred: tuple[str, ...] = ()

    @property
    def refused(self) -> list[ConfigResult]:
        return [c for c in self.configs if c.verdict == REFUSED]

    @property
    def patched(self) -> list[ConfigResult]:
        return [c for c in self.configs if c.verdict not in (OK, REFUSED)]

    @property
    def ok(self) -> bool:
        return not self.refused


def _error_cell(p: PathResult) -> str:
    if p.exception is not None:
        return "raised: " + p.exception.splitlines()[0][:40]
    return f"{p.error:.2e}"


def _n_cell(p: PathResult) -> str:
    if p.compared_rows is None:
        return str(p.out_rows or "")
    return f"{p.out_rows} ({p.compared_rows} compared)"


def format_table(report: AuditReport) -> str:
    """A plain-text table: configuration, path, error vs tolerance, verdict."""
    header = ("configuration", "layers", "path", "rows", "N", "error", "tol", "result")
    rows = []
    for c in report.configs:
        first = True
        for label, results in [("kernel", c.paths), *c.attempts]:
            for p in results:
                name = p.path if label == "kernel" else f"{label}: {p.path}"
                rows.append((c.config.label() if first else "", str(len(c.layers)) if first else "",
                             name, str(p.rows), _n_cell(p), _error_cell(p),
                             f"{p.tolerance:.0e}", "pass" if p.ok else "FAIL"))
                first = False
        rows.append(("", "", "=> verdict", "", "", "", "", c.verdict))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
    out = [line(header), line(tuple("-" * w for w in widths)), *map(line, rows)]
    cached = f" ({report.cached} from the audit cache)" if report.cached else ""
    out.append(f"backend {report.backend}; {len(report.configs)} configurations audited{cached} in "
               f"{report.seconds:.1f}s; {len(report.patched)} patched, {len(report.refused)} refused")
    return "\n".join(out)


def summary(report: AuditReport) -> dict:
    """Short JSON-able dict for `GET /v1/models`."""
    # Error of what runs: the kernel where it passed, else the chosen workaround.
    worst = max((p.error for c in report.configs for p in c.accepted if p.error is not None),
                default=None)
    return {
        "backend": report.backend,
        "configurations": len(report.configs),
        "passed": sum(c.verdict == OK for c in report.configs),
        "workarounds": {c.config.label(): c.verdict for c in report.patched},
        "refused": [c.config.label() for c in report.refused],
        "max_error": worst,
        "seconds": round(report.seconds, 2),
        "cached": report.cached,
        "audited_rows": row_ranges(s for s in STAGES if s not in report.deferred),
        **({"deferred": list(report.deferred)} if report.deferred else {}),
    }
