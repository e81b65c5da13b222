"""launchd job for `lockstep serve`: the plist, the launchctl argument lists, reading it back.

Everything here except `run_launchctl` and `check_health` is a pure function of its
arguments, so the macOS behaviour can be checked on any host. Key choices (why):

- KeepAlive {"SuccessfulExit": false}: launchd restarts the server unless it exited with
  status 0. A crash (non-zero exit, or death by a signal) is restarted. uvicorn re-raises
  SIGTERM after its graceful shutdown, so a `kill` by hand also counts as a crash; the way
  to stop the service is `launchctl bootout` (`lockstep service uninstall`): launchd never
  restarts a job it removed itself.
- ThrottleInterval 30 s: launchd spaces launches at least this far apart, so a server that
  dies at startup (bad model path, port taken) reloads its model twice a minute instead
  of six times; a server that crashes after running longer than this restarts at once.
- ProcessType Interactive: "Adaptive" only raises a job while it handles XPC messages, and
  lockstep is reached over TCP, so it would sit in the Background class (throttled CPU and
  I/O, efficiency cores) while serving requests. A latency-bound model server wants
  app-like scheduling, which is what Interactive gives.
- Secrets never go into the plist (LaunchAgents are world-readable, and `launchctl print`
  shows EnvironmentVariables): API keys come from an env file of mode 600 that a /bin/sh
  wrapper sources right before `exec`-ing the very same `lockstep serve ...` argv.
"""
from __future__ import annotations

import json
import plistlib
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from lockstep.server.options import DEFAULT_HOST, DEFAULT_PORT  # what `serve` listens on unless told

DEFAULT_LABEL = "dev.lockstep.server"
THROTTLE_INTERVAL_S = 30
PROCESS_TYPE = "Interactive"
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
# `set -a` exports whatever the env file assigns; "$0" is the file, "$@" the real argv.
ENV_FILE_WRAPPER = 'set -a && . "$0" && set +a && exec "$@"'
LABEL_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# launchctl's answers when the job is not loaded: "Boot-out failed: 3: No such process",
# "Could not find specified service" (113).
NOT_LOADED_CODES = frozenset({3, 113})
NOT_LOADED_TEXT = ("No such process", "Could not find")


def validate_label(label: str) -> str:
    """A label becomes a file name, so it may not contain '/' or start with '.'."""
    if not LABEL_PATTERN.match(label):
        raise ValueError(f"invalid launchd label {label!r}: use letters, digits, '.', '_', '-'")
    return label


def domain(system: bool, uid: int) -> str:
    """launchd domain: the per-user GUI session for agents, `system` for daemons."""
    return "system" if system else f"gui/{uid}"


def plist_path(label: str, system: bool, home: Path, root: Path = Path("/")) -> Path:
    folder = root / "Library/LaunchDaemons" if system else home / "Library/LaunchAgents"
    return folder / f"{label}.plist"


def log_dir(system: bool, home: Path, root: Path = Path("/")) -> Path:
    return root / "Library/Logs/lockstep" if system else home / "Library/Logs/lockstep"


def log_paths(label: str, system: bool, home: Path, root: Path = Path("/")) -> tuple[Path, Path]:
    folder = log_dir(system, home, root)
    return folder / f"{label}.out.log", folder / f"{label}.err.log"


def serve_arguments(
    host: str, port: int, model: str | None = None, weights: str | None = None
) -> list[str]:
    """The `lockstep serve` flags; host and port are always explicit so `status` can read them."""
    args = ["serve"]
    if model is not None:
        args += ["--model", model]
    if weights is not None:
        args += ["--weights", weights]
    return args + ["--host", host, "--port", str(port)]


def program_arguments(executable: Path, serve_args: list[str], env_file: Path | None) -> list[str]:
    command = [str(executable), *serve_args]
    if env_file is None:
        return command
    return ["/bin/sh", "-c", ENV_FILE_WRAPPER, str(env_file), *command]


def environment(
    executable: Path, batch_invariant_limit: int | None = None, home: Path | None = None
) -> dict[str, str]:
    """launchd starts jobs with a bare PATH; the venv's bin goes first so it wins."""
    env = {
        "PATH": f"{executable.parent}:{SYSTEM_PATH}",
        # Without this, Python block-buffers stdout into the log file and lines show late.
        "PYTHONUNBUFFERED": "1",
    }
    if batch_invariant_limit is not None:
        env["LOCKSTEP_BATCH_INVARIANT_LIMIT"] = str(batch_invariant_limit)
    if home is not None:  # daemons get no HOME; the model cache lives under it
        env["HOME"] = str(home)
    return env


def build_plist(
    *,
    label: str,
    program: list[str],
    env: dict[str, str],
    working_directory: Path,
    stdout_path: Path,
    stderr_path: Path,
    user_name: str | None = None,
) -> dict:
    plist = {
        "Label": validate_label(label),
        "ProgramArguments": list(program),
        "EnvironmentVariables": dict(env),
        "WorkingDirectory": str(working_directory),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": THROTTLE_INTERVAL_S,
        "ProcessType": PROCESS_TYPE,
        "StandardOutPath": str(stdout_path),
        "StandardErrorPath": str(stderr_path),
    }
    if user_name is not None:  # a LaunchDaemon would otherwise run as root
        plist["UserName"] = user_name
    return plist


def render_plist(plist: dict) -> bytes:
    return plistlib.dumps(plist, fmt=plistlib.FMT_XML, sort_keys=False)


def bootstrap_command(domain_name: str, path: Path) -> list[str]:
    return ["launchctl", "bootstrap", domain_name, str(path)]


def bootout_command(domain_name: str, label: str) -> list[str]:
    return ["launchctl", "bootout", f"{domain_name}/{label}"]


def print_command(domain_name: str, label: str) -> list[str]:
    return ["launchctl", "print", f"{domain_name}/{label}"]


def is_not_loaded(result: subprocess.CompletedProcess) -> bool:
    """True when a failed bootout/print only means "that job is not loaded"."""
    text = f"{result.stdout or ''}{result.stderr or ''}"
    return result.returncode in NOT_LOADED_CODES or any(t in text for t in NOT_LOADED_TEXT)


def run_launchctl(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def served_address(plist: dict) -> tuple[str, int]:
    """(host, port) of the `lockstep serve` argv inside an installed plist."""
    args = plist.get("ProgramArguments", [])
    host, port = DEFAULT_HOST, DEFAULT_PORT
    if "serve" not in args:
        raise ValueError("plist has no `lockstep serve` in ProgramArguments")
    flags = args[args.index("serve") + 1 :]
    for flag, value in zip(flags, flags[1:]):
        if flag == "--host":
            host = value
        elif flag == "--port":
            port = int(value)
    return host, port


def health_url(host: str, port: int) -> str:
    """A wildcard bind is reached on loopback; IPv6 literals need brackets in a URL."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/health"


def check_health(url: str, timeout: float = 3.0) -> tuple[bool, str, dict]:
    """(answered 200, "status reason", the JSON body or {})."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            try:
                body = json.loads(response.read() or b"{}")
            except ValueError:
                body = {}
            return response.status == 200, f"{response.status} {response.reason}", body if isinstance(body, dict) else {}
    except urllib.error.HTTPError as exc:
        return False, f"{exc.code} {exc.reason}", {}
    except (urllib.error.URLError, OSError) as exc:
        return False, f"unreachable ({getattr(exc, 'reason', exc)})", {}


# What `lockstep service status --wait-for` waits for: the server answering (plain requests are
# served), or its determinism guarantee settled too (deterministic requests are served).
WAIT_FOR = ("ready", "guarantee")
GUARANTEE_SETTLED_OK = ("in_force", "off")


def reached(wanted: str, healthy: bool, body: dict) -> bool | None:
    """True once the server is in the state `wanted` names, False while it may still get there,
    None when it never will (its guarantee was refused)."""
    if not healthy:
        return False
    if wanted == "ready":
        return True
    state = body.get("guarantee", "in_force")  # a server from before background proofs: proven at start
    if state in GUARANTEE_SETTLED_OK:
        return True
    return None if state == "refused" else False


def parse_print_state(text: str) -> dict[str, str]:
    """The few fields of `launchctl print` worth showing: state, pid, last exit code."""
    fields = {}
    for key in ("state", "pid", "last exit code"):
        match = re.search(rf"^\s*{key} = (.+)$", text, re.MULTILINE)
        if match:
            fields[key] = match.group(1).strip()
    return fields
