"""server/api/shutdown.py's signal handlers: a stop signal the process was started ignoring
(`nohup` ignores SIGHUP) stays ignored; the others stop it (see tests/test_serve.py)."""
import signal
import subprocess
import sys

CHECK = ("import signal; from lockstep.server.api import shutdown; shutdown.stop_during_startup(); "
         "print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)")


def test_a_stop_signal_ignored_at_start_stays_ignored():
    def nohup():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    ignoring = subprocess.run([sys.executable, "-c", CHECK], preexec_fn=nohup, capture_output=True, text=True,
                              check=True)
    plain = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True)
    assert ignoring.stdout.split() == ["True", "False"] and plain.stdout.split() == ["False", "False"]
