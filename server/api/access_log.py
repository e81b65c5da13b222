"""Structured access log: one JSON line per request on the `lockstep.access` logger.

Prompts are user data: they are left out unless the server runs with `--log-prompts`.
"""
from __future__ import annotations

import json
import logging
import sys

from lockstep.server.api.request_record import RequestRecord

logger = logging.getLogger("lockstep.access")


def access_line(record: RequestRecord, log_prompts: bool = False) -> str:
    entry = {
        "request_id": record.request_id,
        "method": record.method,
        "path": record.path,
        "status": record.status,
        "duration_s": round(record.duration, 6),
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
    }
    if record.first_token_at is not None:
        entry["time_to_first_token_s"] = round(record.first_token_at - record.started, 6)
    if record.finish_reason is not None or record.cancelled:
        entry["finish_reason"] = record.finish_reason or "cancelled"
    if log_prompts and record.prompt is not None:
        entry["prompt"] = record.prompt
    return json.dumps(entry, ensure_ascii=False, default=str)


class AccessLog:
    """A request sink that writes the access line."""

    def __init__(self, log_prompts: bool = False):
        self.log_prompts = log_prompts

    def __call__(self, record: RequestRecord) -> None:
        logger.info("%s", access_line(record, self.log_prompts))


def send_to_stderr() -> None:
    """Make access lines bare JSON on stderr (not wrapped in the CLI's log prefix)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
