"""Test double: the grammar checker's child (server/engine/structured/grammar_sandbox.py `_child_main`, run
unchanged) whose check, instead of compiling, reports the stack of the thread it runs on: the
stack the child really gives a grammar compile, not the constant it is configured with.

    python -P stack_reporting_checker.py PATH/TO/grammar_sandbox.py FD

The checker answers every grammar with a "compile" refusal whose text is that report (JSON).
"""
import ctypes
import importlib.util
import json
import sys
import threading


def thread_stack_bytes() -> int:
    """The calling thread's stack size, from the thread library (what the thread was created
    with, not what `threading.stack_size()` says new threads will get)."""
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_void_p
    if sys.platform == "darwin":
        libc.pthread_get_stacksize_np.restype = ctypes.c_size_t
        libc.pthread_get_stacksize_np.argtypes = [ctypes.c_void_p]
        return libc.pthread_get_stacksize_np(libc.pthread_self())
    attr = ctypes.create_string_buffer(256)  # pthread_attr_t, 56 bytes on glibc x86-64
    if libc.pthread_getattr_np(ctypes.c_void_p(libc.pthread_self()), attr) != 0:
        raise OSError("pthread_getattr_np failed")
    size = ctypes.c_size_t()
    try:
        libc.pthread_attr_getstacksize(attr, ctypes.byref(size))
    finally:
        libc.pthread_attr_destroy(attr)
    return size.value


def _report(llguidance, tokenizer, source, settings) -> dict:
    return {"stage": "compile", "error": json.dumps({"stack_bytes": thread_stack_bytes(),
                                                     "configured": settings["stack"]})}


if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location("grammar_sandbox_child", sys.argv[1])
    sandbox = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sandbox)
    sandbox._check = _report
    sandbox._child_main(int(sys.argv[2]))
