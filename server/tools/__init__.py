"""What the commands other than `serve` drive: the measurements and the launchd job; the CLI reference.

| module | job | command |
|---|---|---|
| `divergence.py` | the divergence matrix: speculative and concurrent vs plain decoding, bitwise | `lockstep verify` |
| `speed_ratios.py` | deterministic ÷ native, speculative ÷ plain, per task and per exit layer | `lockstep bench` |
| `http_load.py` | N streaming clients over HTTP (stdlib only): tok/s, TTFT/ITL, changed answers | `bench --concurrency` |
| `replay.py` | recorded requests sent again and compared token for token with their recorded answers | `lockstep replay` |
| `launchd_job.py` | the launchd plist and launchctl argument lists for `lockstep serve` | `lockstep service` |
| `cli_doc.py` | docs/CLI.md, every subcommand's flags rendered from the parsers | `python -m lockstep.server.tools.cli_doc` |
"""
