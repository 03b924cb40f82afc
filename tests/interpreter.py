"""A check run under Triton's CPU interpreter, in a fresh process.

Why a process: Triton picks the interpreter when it is first imported (TRITON_INTERPRET=1), and
the test process has imported it already; a script run apart prints its figures, one line each,
and the tests read them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def interpret(script: str, *args: str, timeout_s: float = 240, **env: str) -> list[str]:
    """Run `script` (with `args`) under the interpreter, `env` added; its stdout lines."""
    pytest.importorskip("triton")
    full = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), **env}
    run = subprocess.run([sys.executable, "-c", script, *args], env=full, capture_output=True,
                         text=True, timeout=timeout_s, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split("\n")
