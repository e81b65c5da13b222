"""Worker threads (server/engine/worker_thread.py): a thread that ran compiled MLX work never
exits, so its compile cache is never torn down while the interpreter finalizes; the engine's
loop runs on one."""
import subprocess
import sys
import textwrap

from lockstep.server.engine import Engine
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.worker_thread import idle_threads
from tests.deterministic_fixtures import TinyLoaded
from tests.tiny_models import tiny_llama

# Compiled work on another thread, then the process exits at once: the case of a server whose
# engine stops at shutdown.
SCRIPT = textwrap.dedent("""
    import sys, threading
    import mlx.core as mx
    from lockstep.server.engine import worker_thread

    f = mx.compile(lambda x: {"y": [mx.exp(x) * 2 + 1]})

    def work():
        for i in range(50):
            mx.eval(f(mx.ones((i + 1,)))["y"])

    if sys.argv[1] == "worker":
        worker_thread.start(work, name="work").join()
    else:
        t = threading.Thread(target=work, daemon=True)
        t.start()
        t.join()
""")


def _exit_code(mode: str) -> int:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, timeout=120).returncode


def test_compiled_work_on_a_worker_thread_never_aborts_the_exit():
    assert [_exit_code("worker") for _ in range(4)] == [0, 0, 0, 0]
    # Negative control: the same work on a thread that exits aborts the process (a race the
    # exiting thread loses most of the time on this kind of machine).
    assert any(_exit_code("thread") != 0 for _ in range(12))


def test_the_engine_loop_runs_on_a_worker_thread_that_outlives_it():
    engine = Engine(TinyLoaded(tiny_llama()), max_active=2, deployment=Deployment())
    before = idle_threads()
    engine.start()
    running = idle_threads()
    engine.stop()
    assert (running, idle_threads()) == (max(before - 1, 0), max(before, 1))
    engine.start()  # a stopped engine's thread takes the next loop
    assert idle_threads() == max(before, 1) - 1
    engine.stop()
    assert idle_threads() == max(before, 1)
