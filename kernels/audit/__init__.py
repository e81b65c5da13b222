"""Load-time audit of a model's quantized kernels and the workarounds that route around
faults: patch.py runs it (see its docstring), probes.py probes each path against
reference.py's dequantization, slicing.py keeps the probes O(K), workarounds.py holds the
stand-in layers, report.py the results and widths.py which call widths each stage covers. Verdicts are kept per machine by
kernels/verdict_cache.py.

    from lockstep.kernels.audit import audit_and_patch, audit_verdict_cache
    report = audit_and_patch(model, cache=audit_verdict_cache())
"""
from .patch import (AuditReport, apply_workarounds, audit_and_patch, audit_model,
                    audit_verdict_cache, format_table, merge_reports, patch_config, raise_if_refused, summary)

__all__ = ["AuditReport", "apply_workarounds", "audit_and_patch", "audit_model",
           "audit_verdict_cache", "format_table", "merge_reports", "patch_config", "raise_if_refused", "summary"]
