"""`lockstep service install|uninstall|status|logs`: run `lockstep serve` under launchd (macOS).

The plist and launchctl argument lists come from `server/tools/launchd_job.py`; this module turns
CLI arguments into them and talks to the user. Everything host-specific (platform, HOME,
uid, the `lockstep` executable, how launchctl is run) sits in `Host`, so tests drive the
macOS code path on Linux with a temporary HOME and a fake `launchctl` on PATH.
"""
from __future__ import annotations

import argparse
import getpass
import os
import plistlib
import pwd
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lockstep.server.options import WEIGHT_CHOICES
from lockstep.server.tools import launchd_job

LOOPBACK_HOSTS = ("localhost", "::1")
BOOTSTRAP_TRIES = 3  # right after a bootout, bootstrap can fail with "5: Input/output error"


class ServiceError(Exception):
    """A problem the user must fix; printed as `error: ...`, exit code 1."""


def default_executable() -> Path:
    # Not resolved: the venv's python is a symlink out of the venv, the script is not.
    return Path(sys.executable).absolute().parent / "lockstep"


@dataclass
class Host:
    platform: str = sys.platform
    home: Path = field(default_factory=Path.home)
    root: Path = Path("/")
    uid: int = field(default_factory=os.getuid)
    euid: int = field(default_factory=os.geteuid)
    executable: Path = field(default_factory=default_executable)
    launchctl: Callable[[list[str]], subprocess.CompletedProcess] = launchd_job.run_launchctl
    sleep: Callable[[float], None] = time.sleep
    exec_tail: Callable[[list[str]], None] = lambda argv: os.execvp(argv[0], argv)

    @property
    def is_macos(self) -> bool:
        return self.platform == "darwin"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "service", help="run lockstep as a macOS launchd service",
        description="Install, remove and inspect a launchd job that runs `lockstep serve`.",
    )
    actions = parser.add_subparsers(dest="action", required=True)

    install = actions.add_parser("install", help="write the plist and load it with launchctl")
    _add_target_flags(install)
    install.add_argument("--model", help="passed to `lockstep serve --model` (default: embedded)")
    install.add_argument("--weights", choices=WEIGHT_CHOICES,
                         help="passed to `lockstep serve --weights` (weight format)")
    install.add_argument("--host", default=launchd_job.DEFAULT_HOST, help="passed to `lockstep serve --host`")
    install.add_argument("--port", type=int, default=launchd_job.DEFAULT_PORT,
                         help="passed to `lockstep serve --port`")
    install.add_argument("--batch-invariant-limit", type=int, metavar="L",
                         help="set LOCKSTEP_BATCH_INVARIANT_LIMIT for the service")
    install.add_argument("--env-file", type=Path, metavar="PATH",
                         help="mode-600 file of KEY=VALUE lines (e.g. LOCKSTEP_API_KEYS=...) "
                              "sourced at start; secrets never go into the plist")
    install.add_argument("--user", help="with --system: account the daemon runs as "
                                        "(default: $SUDO_USER, else the current user)")
    install.add_argument("--dry-run", action="store_true",
                         help="print the plist (stdout) and launchctl commands (stderr) only")

    uninstall = actions.add_parser("uninstall", help="unload the job and delete its plist")
    _add_target_flags(uninstall)
    uninstall.add_argument("--dry-run", action="store_true", help="print the commands only")

    status = actions.add_parser("status", help="launchctl state and GET /health")
    _add_target_flags(status)
    status.add_argument("--wait-for", choices=launchd_job.WAIT_FOR,
                        help="poll /health until the server serves (ready) or its determinism guarantee "
                             "is in force too (guarantee; a refused guarantee fails at once)")
    status.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="with --wait-for: give up (exit 1) after this long (default 300)")

    logs = actions.add_parser("logs", help="show the service's stdout/stderr logs")
    _add_target_flags(logs)
    logs.add_argument("-n", "--lines", type=int, default=50, help="lines per file (default 50)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")

    parser.set_defaults(func=run)


def _add_target_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--label", default=launchd_job.DEFAULT_LABEL,
                        help=f"launchd label (default {launchd_job.DEFAULT_LABEL})")
    parser.add_argument("--system", action="store_true",
                        help="a LaunchDaemon in /Library/LaunchDaemons (needs sudo) "
                             "instead of a LaunchAgent in ~/Library/LaunchAgents")


def run(args: argparse.Namespace, host: Host | None = None) -> int:
    host = host or Host()
    actions = {"install": install, "uninstall": uninstall, "status": status, "logs": logs}
    try:
        launchd_job.validate_label(args.label)
        dry_run = getattr(args, "dry_run", False)
        if not host.is_macos and not dry_run:
            preview = "use `--dry-run` to see what it would do, " if hasattr(args, "dry_run") else ""
            raise ServiceError(
                f"launchd services are macOS-only and this host is {host.platform}: {preview}"
                "run `lockstep serve` directly, or use Dockerfile.macos (see docs/SERVICE.md)"
            )
        return actions[args.action](args, host)
    except (ServiceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _domain(args, host: Host) -> str:
    return launchd_job.domain(args.system, host.uid)


def _plist_path(args, host: Host) -> Path:
    return launchd_job.plist_path(args.label, args.system, host.home, host.root)


def _absolute_if_local(value: str | None) -> str | None:
    """launchd runs from WorkingDirectory, so a relative model path must be fixed now."""
    if value is None:
        return None
    path = Path(value).expanduser()
    return str(path.absolute()) if path.exists() else value


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in LOOPBACK_HOSTS


def _check_env_file(path: Path, host: Host) -> list[str]:
    """Problems that make an env file unsafe or unusable (empty list: fine)."""
    if not path.is_file():
        return [f"env file {path} does not exist"]
    info = path.stat()
    problems = []
    if info.st_mode & 0o077:
        problems.append(f"env file {path} is readable by others (mode {info.st_mode & 0o777:o}); "
                        f"run: chmod 600 {path}")
    if info.st_uid not in (host.euid, 0):
        problems.append(f"env file {path} is owned by uid {info.st_uid}, not by you")
    return problems


def _daemon_account(args) -> tuple[str, Path]:
    user = args.user or os.environ.get("SUDO_USER") or getpass.getuser()
    try:
        return user, Path(pwd.getpwnam(user).pw_dir)
    except KeyError:
        raise ServiceError(f"no such user {user!r} for --user") from None


def build_install_plist(args, host: Host) -> dict:
    env_file = args.env_file.expanduser().absolute() if args.env_file else None
    user_name, run_home = _daemon_account(args) if args.system else (None, host.home)
    stdout_path, stderr_path = launchd_job.log_paths(args.label, args.system, host.home, host.root)
    serve = launchd_job.serve_arguments(
        args.host, args.port, _absolute_if_local(args.model), args.weights
    )
    return launchd_job.build_plist(
        label=args.label,
        program=launchd_job.program_arguments(host.executable, serve, env_file),
        env=launchd_job.environment(
            host.executable, args.batch_invariant_limit, run_home if args.system else None
        ),
        working_directory=run_home,
        stdout_path=stdout_path,
        stderr_path=stderr_path,
        user_name=user_name,
    )


def install(args, host: Host) -> int:
    plist = build_install_plist(args, host)
    path = _plist_path(args, host)
    domain = _domain(args, host)
    problems = _check_env_file(args.env_file.expanduser(), host) if args.env_file else []
    if not host.executable.is_file():
        problems.append(f"lockstep executable {host.executable} not found; "
                        "install the package into this venv first (`make setup`)")
    if args.system and host.euid != 0:
        problems.append("--system installs a LaunchDaemon and needs root: re-run with sudo")
    if not _is_loopback(args.host) and args.env_file is None:
        print(f"warning: --host {args.host} makes lockstep reachable from other machines "
              "without an API key; pass --env-file with LOCKSTEP_API_KEYS=...", file=sys.stderr)

    if args.dry_run:
        sys.stdout.buffer.write(launchd_job.render_plist(plist) + b"\n")
        sys.stdout.flush()
        if not host.is_macos:
            print(f"# note: launchd is macOS-only; this host is {host.platform}, so this only "
                  "shows what install would do on a Mac", file=sys.stderr)
        for problem in problems:
            print(f"# warning: {problem}", file=sys.stderr)
        print(f"# would write {path}", file=sys.stderr)
        print(f"# would run: {' '.join(launchd_job.bootout_command(domain, args.label))} "
              "(ignoring 'not loaded')", file=sys.stderr)
        print(f"# would run: {' '.join(launchd_job.bootstrap_command(domain, path))}", file=sys.stderr)
        return 0

    if problems:
        raise ServiceError("; ".join(problems))
    was_loaded = _bootout(domain, args.label, host)
    _write_plist(path, plist, args, host)
    _bootstrap(domain, path, host, retry=was_loaded)
    print(f"installed {args.label} ({domain}): {path}")
    print(f"logs: {plist['StandardOutPath']} and {plist['StandardErrorPath']}")
    print(f"check it with: lockstep service status{' --system' if args.system else ''}"
          f"{'' if args.label == launchd_job.DEFAULT_LABEL else ' --label ' + args.label}")
    return 0


def _bootout(domain: str, label: str, host: Host) -> bool:
    """Unload the job; True if it was loaded. 'Not loaded' is fine, other failures are not."""
    result = host.launchctl(launchd_job.bootout_command(domain, label))
    if result.returncode == 0:
        return True
    if launchd_job.is_not_loaded(result):
        return False
    raise ServiceError(f"launchctl bootout {domain}/{label} failed ({result.returncode}): "
                       f"{(result.stderr or result.stdout).strip()}")


def _bootstrap(domain: str, path: Path, host: Host, retry: bool) -> None:
    tries = BOOTSTRAP_TRIES if retry else 1
    for attempt in range(1, tries + 1):
        result = host.launchctl(launchd_job.bootstrap_command(domain, path))
        if result.returncode == 0:
            return
        if attempt < tries:
            host.sleep(1.0)  # the old instance may still be shutting down
    raise ServiceError(f"launchctl bootstrap {domain} {path} failed ({result.returncode}): "
                       f"{(result.stderr or result.stdout).strip()}")


def _write_plist(path: Path, plist: dict, args, host: Host) -> None:
    log_folder = Path(plist["StandardOutPath"]).parent
    log_folder.mkdir(parents=True, exist_ok=True)
    if args.system and "UserName" in plist:
        shutil.chown(log_folder, user=plist["UserName"])  # the daemon's user writes its logs
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(launchd_job.render_plist(plist))
    # launchd refuses group/world-writable plists.
    partial.chmod(0o644)
    os.replace(partial, path)


def uninstall(args, host: Host) -> int:
    path = _plist_path(args, host)
    domain = _domain(args, host)
    if args.dry_run:
        print(f"would run: {' '.join(launchd_job.bootout_command(domain, args.label))} "
              "(ignoring 'not loaded')")
        print(f"would delete {path}")
        return 0
    was_loaded = _bootout(domain, args.label, host)
    existed = path.exists()
    path.unlink(missing_ok=True)
    if not was_loaded and not existed:
        print(f"{args.label} is not installed ({path} absent, not loaded)")
        return 0
    print(f"uninstalled {args.label} ({domain}); logs kept in "
          f"{launchd_job.log_dir(args.system, host.home, host.root)}")
    return 0


def _read_installed(args, host: Host) -> dict:
    path = _plist_path(args, host)
    if not path.is_file():
        raise ServiceError(f"{args.label} is not installed ({path} not found); "
                           "run `lockstep service install`")
    with path.open("rb") as handle:
        return plistlib.load(handle)


def status(args, host: Host) -> int:
    plist = _read_installed(args, host)
    domain = _domain(args, host)
    print(f"label:  {args.label} ({domain})")
    print(f"plist:  {_plist_path(args, host)}")
    result = host.launchctl(launchd_job.print_command(domain, args.label))
    loaded = result.returncode == 0
    if loaded:
        fields = launchd_job.parse_print_state(result.stdout or "")
        detail = ", ".join(f"{key} = {value}" for key, value in fields.items())
        print(f"launchd: loaded{': ' + detail if detail else ''}")
    else:
        print(f"launchd: not loaded ({(result.stderr or result.stdout).strip()})")
    url = launchd_job.health_url(*launchd_job.served_address(plist))
    healthy, detail, body = _health(url, getattr(args, "wait_for", None), getattr(args, "timeout", 0.0))
    print(f"health: {url} -> {detail}")
    if "guarantee" in body:
        print(f"guarantee: {body['guarantee']}")
    print(f"logs:   {plist.get('StandardOutPath')} {plist.get('StandardErrorPath')}")
    wanted = getattr(args, "wait_for", None)
    return 0 if loaded and healthy and (wanted is None or launchd_job.reached(wanted, healthy, body)) else 1


def _health(url: str, wanted: str | None, timeout: float) -> tuple[bool, str, dict]:
    """GET /health once, or (`wanted`) until the server is in that state, refused it, or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while True:
        healthy, detail, body = launchd_job.check_health(url)
        if wanted is None or launchd_job.reached(wanted, healthy, body) is not False:
            return healthy, detail, body
        if time.monotonic() >= deadline:
            return healthy, detail + f" (still not {wanted} after {timeout:g} s)", body
        time.sleep(0.5)


def tail_lines(path: Path, count: int) -> list[str]:
    with path.open("r", errors="replace") as handle:
        return list(deque(handle, maxlen=count)) if count > 0 else []


def logs(args, host: Host) -> int:
    path = _plist_path(args, host)
    if path.is_file():
        with path.open("rb") as handle:
            plist = plistlib.load(handle)
        files = [Path(plist["StandardOutPath"]), Path(plist["StandardErrorPath"])]
    else:
        files = list(launchd_job.log_paths(args.label, args.system, host.home, host.root))
    present = [f for f in files if f.is_file()]
    if not present:
        raise ServiceError(f"no log files yet: {' '.join(map(str, files))}")
    if args.follow:
        host.exec_tail(["tail", "-n", str(args.lines), "-F", *map(str, present)])
        return 0
    for log_file in present:
        print(f"==> {log_file} <==")
        sys.stdout.write("".join(tail_lines(log_file, args.lines)))
    return 0
