"""`lockstep serve` flags for the HTTP service: API keys, request limits, logging, draining, connections."""
from __future__ import annotations

import argparse

from lockstep.server.api.auth import KEYS_ENV, api_keys, warn_if_exposed
from lockstep.server.api.limits import (DEFAULT_GRAMMAR_QUEUE, DEFAULT_GRAMMAR_WORKERS,
                           DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PREDICTION_TOKENS, DEFAULT_MAX_QUEUE,
                           DEFAULT_MAX_TOKENS, Limits)
from lockstep.server.api.connections import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                             DEFAULT_KEEP_ALIVE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, ConnectionLimits)
from lockstep.server.api.file_limit import RESERVED_FDS, max_connections
from lockstep.server.api.shutdown import DEFAULT_DRAIN_TIMEOUT


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return value


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on /v1 and /metrics (repeatable; "
                             f"also {KEYS_ENV}, comma-separated)")
    parser.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest request body; larger gets 413 (default {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--max-tokens-limit", type=_positive_int, default=DEFAULT_MAX_TOKENS,
                        help=f"largest max_tokens a request may ask for; larger gets 400, and it is the "
                             f"default when a request sets none (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--max-prompt-tokens", type=_positive_int, default=None,
                        help="longest prompt in tokens; longer gets 400 (default: the model's context "
                             "length, as far as the KV budget holds the prompt)")
    parser.add_argument("--max-prediction-tokens", type=_positive_int, default=DEFAULT_MAX_PREDICTION_TOKENS,
                        help=f"longest `prediction` (Predicted Outputs) in tokens; longer gets 400 "
                             f"(default {DEFAULT_MAX_PREDICTION_TOKENS})")
    parser.add_argument("--max-queue", type=_non_negative_int, default=DEFAULT_MAX_QUEUE,
                        help=f"requests waiting for a slot before new ones get 429 (default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--grammar-workers", type=_positive_int, default=DEFAULT_GRAMMAR_WORKERS,
                        help="threads that check and compile requests' output grammars (response_format "
                             "schemas, forced tool calls), apart from the threads that tokenize "
                             f"(default {DEFAULT_GRAMMAR_WORKERS})")
    parser.add_argument("--grammar-queue", type=_non_negative_int, default=DEFAULT_GRAMMAR_QUEUE,
                        help="grammar checks waiting for a thread before new ones get 429 "
                             f"(default {DEFAULT_GRAMMAR_QUEUE})")
    parser.add_argument("--log-prompts", action="store_true",
                        help="include prompts in the JSON access log (off: prompts are user data)")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT,
                        help=f"seconds SIGTERM/SIGINT/SIGHUP waits for requests in flight before stopping "
                             f"(default {DEFAULT_DRAIN_TIMEOUT:.0f})")
    parser.add_argument("--max-connections", type=_positive_int, default=None,
                        help=f"open connections at most; one more closes the least recently active idle one, or "
                             f"gets 503 when none is idle (default {DEFAULT_MAX_CONNECTIONS}, or the open-file "
                             f"limit less {RESERVED_FDS} where that is lower)")
    parser.add_argument("--header-timeout", type=_positive_seconds, default=DEFAULT_HEADER_TIMEOUT_S,
                        metavar="SECONDS", help=f"a connection that has not sent a request's whole headers this "
                                                f"long is closed (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    parser.add_argument("--body-timeout", type=_positive_seconds, default=DEFAULT_BODY_TIMEOUT_S,
                        metavar="SECONDS", help=f"a request whose whole body has not arrived this long after its "
                                                f"headers gets 408 (default {DEFAULT_BODY_TIMEOUT_S:g})")
    parser.add_argument("--keep-alive-timeout", type=_positive_seconds, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                        metavar="SECONDS", help=f"an idle keep-alive connection is closed after this long "
                                                f"(default {DEFAULT_KEEP_ALIVE_TIMEOUT_S:g})")


def http_settings_from_args(args: argparse.Namespace) -> dict:
    """`create_app` keyword arguments; warns when exposed beyond loopback without a key."""
    keys = api_keys(args.api_key)
    warn_if_exposed(args.host, keys)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens_limit,
                    max_prompt_tokens=args.max_prompt_tokens, max_queue=args.max_queue,
                    grammar_workers=args.grammar_workers, grammar_queue=args.grammar_queue,
                    max_prediction_tokens=args.max_prediction_tokens)
    return {"api_keys": keys, "limits": limits, "log_prompts": args.log_prompts}


def connection_limits_from_args(args: argparse.Namespace, file_limit: int) -> ConnectionLimits:
    """The serve's `ConnectionLimits` under the open-file limit (ValueError when it has no room)."""
    return ConnectionLimits(max_connections=max_connections(args.max_connections, file_limit),
                            header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                            keep_alive_timeout=args.keep_alive_timeout)
