"""`lockstep replay FILE... [--url URL]`: send requests recorded by `lockstep serve --record DIR`
again and compare each answer with the recorded one, token for token (server/tools/replay.py).
Without `--url` it starts the recorded deployment itself (`DIR/deployment.json`, written by
`serve --record`; server/tools/replay_server.py) on a free loopback port and stops it after.

Prints a summary table (or, with `--json`, every verdict); exits 0 when every comparable answer
is identical. `--without-speculation` drops the recorded speculation fields: by the guarantee a
deterministic answer is the same with and without it.
"""
from __future__ import annotations

import argparse
import os
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser("replay", help="re-send recorded requests and compare the answers bitwise")
    parser.add_argument("files", nargs="+", metavar="FILE", help="requests.jsonl files written by serve --record")
    parser.add_argument("--url", default=None,
                        help="the server to replay against, e.g. http://127.0.0.1:8080 (default: start the "
                             "recorded deployment, from deployment.json beside the first FILE)")
    parser.add_argument("--start-timeout", type=float, default=900.0,
                        help="without --url: seconds to wait for the started deployment's guarantee (default 900)")
    parser.add_argument("--api-key", default=os.environ.get("LOCKSTEP_API_KEY"),
                        help="a key for a server that requires one (default: env LOCKSTEP_API_KEY)")
    parser.add_argument("--without-speculation", action="store_true",
                        help="send each request without its speculative / num_draft_tokens / prediction fields")
    parser.add_argument("--json", action="store_true", help="print every verdict as JSON")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lockstep.server.tools import replay

    try:
        total = replay.count_choices(args.files)
    except (OSError, ValueError, KeyError) as exc:
        print(f"lockstep replay: cannot read the recording: {exc}", file=sys.stderr)
        return 2
    progress = replay.print_progress(total) if sys.stderr.isatty() else None
    if args.url is None:
        from lockstep.server.tools import replay_server

        try:
            serve_args = replay_server.recorded_args(args.files[0])
            with replay_server.started(serve_args, timeout=args.start_timeout,
                                       log=lambda line: print(line, file=sys.stderr)) as url:
                verdicts = replay.replay(args.files, url, speculation=not args.without_speculation,
                                         timeout=args.timeout, progress=progress)
        except replay_server.ReplayServerError as exc:
            print(f"lockstep replay: {exc}", file=sys.stderr)
            return 2
    else:
        verdicts = replay.replay(args.files, args.url, api_key=args.api_key,
                                 speculation=not args.without_speculation, timeout=args.timeout, progress=progress)
    print(replay.as_json(verdicts) if args.json else replay.summary(verdicts))
    return replay.exit_status(verdicts)
