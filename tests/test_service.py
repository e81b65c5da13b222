"""`lockstep service`: plist contents, launchctl call sequences, status, logs, restart policy.

The macOS code path runs on any host: `Host(platform="darwin")` with a temporary HOME and
a fake `launchctl` on PATH that records its argv and keeps a loaded/not-loaded state the
way launchctl reports it (bootout of an unloaded job: exit 3 "No such process"; print of
an unloaded job: exit 113). launchd itself is not exercised; the restart test applies
launchd's documented KeepAlive rule to the plist this code writes and runs its argv.
"""
from __future__ import annotations

import argparse
import json
import os
import plistlib
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lockstep.server import cli
from lockstep.server.commands import service
from lockstep.server.tools import launchd_job as launchd
from tests.http_server import wait_until

REPO = Path(__file__).resolve().parents[1]
LABEL = launchd.DEFAULT_LABEL

FAKE_LAUNCHCTL = """\
#!{python}
import json, os, plistlib, sys
state_dir = os.environ["FAKE_LAUNCHCTL_DIR"]
state_file = os.path.join(state_dir, "loaded.json")
loaded = json.load(open(state_file)) if os.path.exists(state_file) else []
with open(os.path.join(state_dir, "calls.jsonl"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
verb, target = sys.argv[1], sys.argv[-1]
label = target.rsplit("/", 1)[-1]
if verb == "bootout":
    if os.environ.get("FAKE_BOOTOUT_ERROR"):
        sys.exit("Boot-out failed: 1: Operation not permitted")
    if label not in loaded:
        sys.exit(print("Boot-out failed: 3: No such process", file=sys.stderr) or 3)
    loaded.remove(label)
elif verb == "bootstrap":
    failures = os.path.join(state_dir, "bootstrap_failures")
    left = int(open(failures).read()) if os.path.exists(failures) else 0
    if left:
        open(failures, "w").write(str(left - 1))
        sys.exit(print("Bootstrap failed: 5: Input/output error", file=sys.stderr) or 5)
    loaded.append(plistlib.load(open(target, "rb"))["Label"])
elif verb == "print":
    if label not in loaded:
        sys.exit(print(f"Could not find service \\"{{label}}\\" in domain", file=sys.stderr) or 113)
    print(f"{{target}} = {{{{\\n\\tstate = running\\n\\tpid = 4242\\n\\tlast exit code = 1\\n}}}}")
json.dump(loaded, open(state_file, "w"))
"""


@pytest.fixture
def fake_launchctl(tmp_path, monkeypatch):
    """Directory of the fake's state: calls.jsonl (one argv per line), loaded.json."""
    bin_dir, state = tmp_path / "fakebin", tmp_path / "launchctl-state"
    bin_dir.mkdir()
    state.mkdir()
    script = bin_dir / "launchctl"
    script.write_text(FAKE_LAUNCHCTL.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LAUNCHCTL_DIR", str(state))
    return state


def calls(state: Path) -> list[list[str]]:
    path = state / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def loaded(state: Path) -> list[str]:
    path = state / "loaded.json"
    return json.loads(path.read_text()) if path.exists() else []


@pytest.fixture
def mac(tmp_path):
    """A macOS host in a temp dir; `mac.slept` records bootstrap retry waits."""
    executable = tmp_path / "venv" / "bin" / "lockstep"
    executable.parent.mkdir(parents=True)
    executable.write_text("#!/bin/sh\nexit 0\n")
    executable.chmod(0o755)
    slept: list[float] = []
    host = service.Host(
        platform="darwin", home=tmp_path / "home", root=tmp_path / "root", uid=501,
        euid=os.geteuid(), executable=executable, sleep=slept.append,
    )
    host.home.mkdir()
    host.slept = slept
    return host


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lockstep")
    service.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["service", *argv])


def run(host: service.Host, *argv: str) -> int:
    return service.run(parse(*argv), host)


def agent_plist(host: service.Host, label: str = LABEL) -> Path:
    return host.home / "Library/LaunchAgents" / f"{label}.plist"


def read_plist(path: Path) -> dict:
    return plistlib.loads(path.read_bytes())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_lists_the_service_command():
    assert "lockstep.server.commands.service" in cli.COMMAND_MODULES


def test_dry_run_prints_a_plist_on_stdout_and_touches_nothing(tmp_path):
    # A real process on this (Linux) host: stdout alone must be a valid plist.
    harness = textwrap.dedent("""
        import argparse, sys
        from lockstep.server.commands import service
        parser = argparse.ArgumentParser(prog="lockstep")
        service.register(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(sys.argv[1:])
        sys.exit(args.func(args))
    """)
    env = {**os.environ, "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", harness, "service", "install", "--dry-run", "--port", "9123",
         "--batch-invariant-limit", "8"],
        cwd=REPO, env=env, capture_output=True, check=False,
    )
    assert done.returncode == 0, done.stderr
    plist = plistlib.loads(done.stdout)
    assert plist["Label"] == LABEL
    assert plist["ProgramArguments"][1:] == ["serve", "--host", "127.0.0.1", "--port", "9123"]
    assert plist["EnvironmentVariables"]["LOCKSTEP_BATCH_INVARIANT_LIMIT"] == "8"
    err = done.stderr.decode()
    if sys.platform != "darwin":
        assert "macOS-only" in err
    assert f"launchctl bootstrap gui/{os.getuid()} {tmp_path}/Library/LaunchAgents/{LABEL}.plist" in err
    assert f"launchctl bootout gui/{os.getuid()}/{LABEL}" in err
    assert list(tmp_path.iterdir()) == []


def test_real_install_off_macos_is_refused_with_an_explanation(mac, fake_launchctl, capsys):
    mac.platform = "linux"
    assert run(mac, "install") == 1
    assert "macOS-only" in capsys.readouterr().err
    assert not agent_plist(mac).exists()
    assert calls(fake_launchctl) == []


def test_install_writes_the_agent_plist_and_bootstraps_it(mac, fake_launchctl):
    assert run(mac, "install", "--model", "default", "--batch-invariant-limit", "4") == 0
    path = agent_plist(mac)
    plist = read_plist(path)
    assert plist["ProgramArguments"] == [
        str(mac.executable), "serve", "--model", "default", "--host", "127.0.0.1",
        "--port", "8080",
    ]
    env = plist["EnvironmentVariables"]
    assert env["PATH"].split(":")[0] == str(mac.executable.parent)
    assert env["LOCKSTEP_BATCH_INVARIANT_LIMIT"] == "4"
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] == launchd.THROTTLE_INTERVAL_S
    assert plist["ProcessType"] == "Interactive"
    logs = mac.home / "Library/Logs/lockstep"
    assert plist["StandardOutPath"] == str(logs / f"{LABEL}.out.log")
    assert plist["StandardErrorPath"] == str(logs / f"{LABEL}.err.log")
    assert logs.is_dir()
    assert plist["WorkingDirectory"] == str(mac.home)
    assert "UserName" not in plist
    assert path.stat().st_mode & 0o777 == 0o644
    assert calls(fake_launchctl) == [
        ["bootout", f"gui/501/{LABEL}"],
        ["bootstrap", "gui/501", str(path)],
    ]
    assert loaded(fake_launchctl) == [LABEL]


def test_reinstall_boots_out_the_old_job_then_loads_the_new_plist(mac, fake_launchctl):
    assert run(mac, "install", "--port", "8080") == 0
    assert run(mac, "install", "--port", "9090", "--label", "dev.lockstep.other") == 0
    assert run(mac, "install", "--port", "9091") == 0
    path = agent_plist(mac)
    assert read_plist(path)["ProgramArguments"][-2:] == ["--port", "9091"]
    assert calls(fake_launchctl)[-2:] == [
        ["bootout", f"gui/501/{LABEL}"],
        ["bootstrap", "gui/501", str(path)],
    ]
    assert sorted(loaded(fake_launchctl)) == sorted([LABEL, "dev.lockstep.other"])
    assert not list(path.parent.glob("*.partial"))


def test_reinstall_retries_bootstrap_while_the_old_job_shuts_down(mac, fake_launchctl):
    assert run(mac, "install") == 0
    (fake_launchctl / "bootstrap_failures").write_text("1")
    assert run(mac, "install") == 0
    bootstraps = [c for c in calls(fake_launchctl) if c[0] == "bootstrap"]
    assert len(bootstraps) == 3
    assert mac.slept == [1.0]
    assert loaded(fake_launchctl) == [LABEL]


def test_a_failed_bootstrap_is_reported(mac, fake_launchctl, capsys):
    (fake_launchctl / "bootstrap_failures").write_text("1")
    assert run(mac, "install") == 1  # nothing was loaded before, so no retry
    assert "Input/output error" in capsys.readouterr().err
    assert mac.slept == []


def test_a_bootout_error_other_than_not_loaded_aborts_before_writing(
    mac, fake_launchctl, monkeypatch, capsys
):
    monkeypatch.setenv("FAKE_BOOTOUT_ERROR", "1")
    assert run(mac, "install") == 1
    assert "Operation not permitted" in capsys.readouterr().err
    assert not agent_plist(mac).exists()
    assert [c[0] for c in calls(fake_launchctl)] == ["bootout"]


def test_install_refuses_without_an_installed_lockstep_executable(mac, fake_launchctl, capsys):
    mac.executable = mac.executable.with_name("missing")
    assert run(mac, "install") == 1
    assert "make setup" in capsys.readouterr().err
    assert calls(fake_launchctl) == []


def test_uninstall_unloads_and_deletes_and_is_idempotent(mac, fake_launchctl, capsys):
    assert run(mac, "install") == 0
    assert run(mac, "uninstall") == 0
    assert not agent_plist(mac).exists()
    assert calls(fake_launchctl)[-1] == ["bootout", f"gui/501/{LABEL}"]
    assert loaded(fake_launchctl) == []
    capsys.readouterr()
    assert run(mac, "uninstall") == 0
    assert "not installed" in capsys.readouterr().out


def test_uninstall_dry_run_changes_nothing(mac, fake_launchctl, capsys):
    assert run(mac, "install") == 0
    before = calls(fake_launchctl)
    assert run(mac, "uninstall", "--dry-run") == 0
    assert f"launchctl bootout gui/501/{LABEL}" in capsys.readouterr().out
    assert agent_plist(mac).exists()
    assert calls(fake_launchctl) == before


def test_system_install_is_a_daemon_run_as_a_named_user(mac, fake_launchctl, capsys):
    import pwd

    account = pwd.getpwuid(os.getuid())
    mac.euid = 0
    assert run(mac, "install", "--system", "--user", account.pw_name) == 0
    path = mac.root / "Library/LaunchDaemons" / f"{LABEL}.plist"
    plist = read_plist(path)
    assert plist["UserName"] == account.pw_name
    assert plist["EnvironmentVariables"]["HOME"] == account.pw_dir
    assert plist["WorkingDirectory"] == account.pw_dir
    assert plist["StandardOutPath"].startswith(str(mac.root / "Library/Logs/lockstep"))
    assert calls(fake_launchctl) == [["bootout", f"system/{LABEL}"], ["bootstrap", "system", str(path)]]

    mac.euid = 1000
    assert run(mac, "install", "--system", "--user", account.pw_name) == 1
    assert "sudo" in capsys.readouterr().err


def test_api_keys_come_from_a_private_env_file_never_the_plist(mac, fake_launchctl, tmp_path, capsys):
    secret = "sk-test-do-not-leak"
    env_file = tmp_path / "lockstep.env"
    env_file.write_text(f"LOCKSTEP_API_KEYS={secret}\n")
    env_file.chmod(0o644)
    assert run(mac, "install", "--env-file", str(env_file)) == 1
    assert "chmod 600" in capsys.readouterr().err
    assert not agent_plist(mac).exists()

    env_file.chmod(0o600)
    assert run(mac, "install", "--host", "0.0.0.0", "--env-file", str(env_file)) == 0
    assert "warning" not in capsys.readouterr().err
    raw = agent_plist(mac).read_bytes()
    assert secret.encode() not in raw
    program = plistlib.loads(raw)["ProgramArguments"]
    assert program[:4] == ["/bin/sh", "-c", launchd.ENV_FILE_WRAPPER, str(env_file)]
    assert program[4:6] == [str(mac.executable), "serve"]


def test_a_non_loopback_host_without_api_keys_warns(mac, fake_launchctl, capsys):
    assert run(mac, "install", "--host", "0.0.0.0") == 0
    assert "without an API key" in capsys.readouterr().err


class HealthHandler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}')

    def log_message(self, *args):
        pass


def test_status_reads_the_port_from_the_plist_and_checks_health(mac, fake_launchctl, capsys):
    port = free_port()
    assert run(mac, "install", "--port", str(port)) == 0
    capsys.readouterr()
    server = ThreadingHTTPServer(("127.0.0.1", port), HealthHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert run(mac, "status") == 0
        out = capsys.readouterr().out
        assert "state = running" in out and "pid = 4242" in out
        assert f"http://127.0.0.1:{port}/health -> 200" in out
        assert calls(fake_launchctl)[-1] == ["print", f"gui/501/{LABEL}"]
    finally:
        server.shutdown()
        server.server_close()
    assert run(mac, "status") == 1
    assert "unreachable" in capsys.readouterr().out


def test_status_of_a_job_that_is_not_loaded_fails(mac, fake_launchctl, capsys):
    assert run(mac, "status") == 1
    assert "not installed" in capsys.readouterr().err
    assert run(mac, "install") == 0
    (fake_launchctl / "loaded.json").write_text("[]")  # e.g. booted out by hand
    assert run(mac, "status") == 1
    assert "not loaded" in capsys.readouterr().out


def test_logs_tails_both_files_and_follow_execs_tail(mac, fake_launchctl, capsys):
    assert run(mac, "install") == 0
    plist = read_plist(agent_plist(mac))
    Path(plist["StandardOutPath"]).write_text("".join(f"out {i}\n" for i in range(10)))
    Path(plist["StandardErrorPath"]).write_text("err 0\nerr 1\n")
    capsys.readouterr()
    assert run(mac, "logs", "-n", "2") == 0
    out = capsys.readouterr().out
    assert "out 8\nout 9\n" in out and "out 7" not in out
    assert "err 0\nerr 1\n" in out

    executed = []
    mac.exec_tail = executed.append
    assert run(mac, "logs", "-n", "5", "-f") == 0
    assert executed == [["tail", "-n", "5", "-F", plist["StandardOutPath"], plist["StandardErrorPath"]]]


def test_health_url_reaches_wildcard_binds_on_loopback():
    assert launchd.health_url("0.0.0.0", 8080) == "http://127.0.0.1:8080/health"
    assert launchd.health_url("::", 81) == "http://[::1]:81/health"
    assert launchd.health_url("10.0.0.5", 82) == "http://10.0.0.5:82/health"


def test_served_address_reads_the_serve_flags_through_the_env_file_wrapper():
    plist = {"ProgramArguments": ["/bin/sh", "-c", launchd.ENV_FILE_WRAPPER, "/e",
                                  "/v/lockstep", "serve", "--port", "9", "--host", "::1"]}
    assert launchd.served_address(plist) == ("::1", 9)


# --- crash then restart --------------------------------------------------------------

FAKE_SERVER = """\
#!{python}
# Stands in for `lockstep serve`: crashes on launch 1, serves /health on launch 2 and ends
# on SIGTERM like uvicorn (shut down, then re-raise the signal), exits 0 on launch 3.
import http.server, os, signal, sys
launches = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launches")
count = int(open(launches).read()) + 1 if os.path.exists(launches) else 1
open(launches, "w").write(str(count))
args = sys.argv[sys.argv.index("serve") + 1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
print(f"launch {{count}} cwd={{os.getcwd()}} keys={{os.environ.get('LOCKSTEP_API_KEYS')}} "
      f"limit={{os.environ.get('LOCKSTEP_BATCH_INVARIANT_LIMIT')}}", flush=True)
if count == 1:
    print("simulated crash", file=sys.stderr, flush=True)
    sys.exit(1)
if count == 3:
    sys.exit(0)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
def shutdown(signum, frame):
    print("graceful shutdown", flush=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
signal.signal(signal.SIGTERM, shutdown)
http.server.HTTPServer((host, port), Health).serve_forever()
"""


def launchd_restarts(plist: dict, returncode: int) -> bool:
    """launchd.plist(5): KeepAlive {SuccessfulExit: false} restarts unless the exit was 0."""
    keep_alive = plist.get("KeepAlive", False)
    if isinstance(keep_alive, bool):
        return keep_alive
    successful = keep_alive.get("SuccessfulExit")
    return successful is not None and (returncode == 0) == successful


def launch_like_launchd(plist: dict) -> subprocess.Popen:
    """Start the job from the plist alone: its argv, environment, directory and log files."""
    stdout = open(plist["StandardOutPath"], "a")
    stderr = open(plist["StandardErrorPath"], "a")
    with stdout, stderr:
        return subprocess.Popen(
            plist["ProgramArguments"], env=plist["EnvironmentVariables"],
            cwd=plist["WorkingDirectory"], stdout=stdout, stderr=stderr,
        )


def wait_healthy(url: str, seconds: float = 15.0) -> None:
    def answers() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return True
        except OSError:
            return False

    wait_until(answers, timeout=seconds, what=f"{url} to answer")


def test_crash_then_restart_follows_the_installed_keepalive_policy(mac, fake_launchctl, tmp_path, capsys):
    mac.executable.write_text(FAKE_SERVER.format(python=sys.executable))
    env_file = tmp_path / "keys.env"
    env_file.write_text("LOCKSTEP_API_KEYS=sk-one\n")
    env_file.chmod(0o600)
    port = free_port()
    assert run(mac, "install", "--port", str(port), "--env-file", str(env_file),
               "--batch-invariant-limit", "3") == 0
    plist = read_plist(agent_plist(mac))

    first = launch_like_launchd(plist)
    assert first.wait(timeout=30) == 1
    assert launchd_restarts(plist, 1)

    second = launch_like_launchd(plist)
    try:
        wait_healthy(launchd.health_url("127.0.0.1", port))
        capsys.readouterr()
        assert run(mac, "status") == 0
        assert "-> 200" in capsys.readouterr().out
    finally:
        second.send_signal(signal.SIGTERM)
        code = second.wait(timeout=30)
    assert code == -signal.SIGTERM  # died by the re-raised signal: a crash to launchd
    assert launchd_restarts(plist, code)

    third = launch_like_launchd(plist)
    assert third.wait(timeout=30) == 0
    assert not launchd_restarts(plist, 0)

    assert run(mac, "logs", "-n", "10") == 0
    out = capsys.readouterr().out
    for count in (1, 2, 3):
        assert f"launch {count} cwd={mac.home} keys=sk-one limit=3" in out
    assert "simulated crash" in out and "graceful shutdown" in out


def test_the_installed_argv_is_accepted_by_the_real_serve_parser(mac, fake_launchctl, tmp_path, monkeypatch):
    model_dir = tmp_path / "work" / "my-model"
    model_dir.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    assert run(mac, "install", "--model", "my-model", "--weights", "float16", "--port", "9001") == 0
    program = read_plist(agent_plist(mac))["ProgramArguments"]
    args = cli.build_parser().parse_args(program[1:])
    assert (args.command, args.model, args.weights, args.host, args.port) == (
        "serve", str(model_dir), "float16", "127.0.0.1", 9001)


class ProvingHealthHandler(BaseHTTPRequestHandler):
    """/health of a server proving its guarantee: "proving" for the first `proving_for` GETs."""

    answers: list = []

    def do_GET(self):
        state = self.answers.pop(0) if self.answers else "in_force"
        self.send_response(200)
        self.end_headers()
        self.wfile.write(('{"status":"ok","guarantee":"%s"}' % state).encode())

    def log_message(self, *args):
        pass


def test_status_waits_for_the_guarantee_and_fails_on_a_refused_one(mac, fake_launchctl, capsys):
    port = free_port()
    assert run(mac, "install", "--port", str(port)) == 0
    server = ThreadingHTTPServer(("127.0.0.1", port), ProvingHealthHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        ProvingHealthHandler.answers = ["proving"] * 3
        capsys.readouterr()
        assert run(mac, "status", "--wait-for", "ready") == 0  # plain requests are served already
        assert "guarantee: proving" in capsys.readouterr().out and len(ProvingHealthHandler.answers) == 2
        assert run(mac, "status", "--wait-for", "guarantee", "--timeout", "30") == 0
        assert "guarantee: in_force" in capsys.readouterr().out and not ProvingHealthHandler.answers

        ProvingHealthHandler.answers = ["proving"] * 1000
        assert run(mac, "status", "--wait-for", "guarantee", "--timeout", "1") == 1
        assert "still not guarantee" in capsys.readouterr().out
        ProvingHealthHandler.answers = ["refused"]
        assert run(mac, "status", "--wait-for", "guarantee", "--timeout", "30") == 1  # at once, not after 30 s
        assert "guarantee: refused" in capsys.readouterr().out
    finally:
        server.shutdown()
        server.server_close()
