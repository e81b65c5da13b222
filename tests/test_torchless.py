"""lockstep's CLI keeps torch out of its process (transformers would import it when installed)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.util, sys
from lockstep.server import cli
try:
    cli.main(["--help"])
except SystemExit:
    pass
marked = "torch" in sys.modules and sys.modules["torch"] is None
try:
    import torch  # noqa: F401
    importable = True
except ImportError:
    importable = False
print(marked, importlib.util.find_spec("torch") is None, importable)
"""


def _probe(**env):
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120, check=True)
    return out.stdout.split()[-3:]


def test_cli_marks_torch_absent_before_anything_imports_it():
    marked, spec_none, importable = _probe()
    assert marked == "True" and spec_none == "True" and importable == "False"


def test_allow_env_leaves_torch_alone():
    marked, _, _ = _probe(LOCKSTEP_ALLOW_TORCH="1")
    assert marked == "False"


def test_transformers_then_reports_no_torch():
    code = ("from server.torchless import keep_torch_out; keep_torch_out()\n"
            "from transformers.utils import is_torch_available\n"
            "print(is_torch_available())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split()[-1] == "False"
