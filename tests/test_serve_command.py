"""`lockstep serve`'s process settings (server/commands/serve.py)."""
import argparse
import sys

import pytest

from lockstep.server.commands.serve import add_arguments, set_thread_switch
from lockstep.server.options import DEFAULT_THREAD_SWITCH_MS


def test_the_thread_switch_interval_is_set_in_milliseconds_and_must_be_positive():
    before = sys.getswitchinterval()
    try:
        set_thread_switch(20)
        assert sys.getswitchinterval() == pytest.approx(0.020)
        set_thread_switch(5)
        assert sys.getswitchinterval() == pytest.approx(0.005)
        for bad in (0, -1, float("nan")):
            with pytest.raises(ValueError, match="--thread-switch-ms"):
                set_thread_switch(bad)
        assert sys.getswitchinterval() == pytest.approx(0.005)  # a refused value changes nothing
    finally:
        sys.setswitchinterval(before)


def test_serve_defaults_to_a_switch_interval_longer_than_pythons():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert args.thread_switch_ms == DEFAULT_THREAD_SWITCH_MS > 5
    assert parser.parse_args(["--thread-switch-ms", "7.5"]).thread_switch_ms == 7.5
