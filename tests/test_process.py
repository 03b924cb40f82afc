"""The process set-up and the process state (ocrq/core/process.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ocrq.core import process
from ocrq.core.settings import Settings


def test_setup_process_sets_the_allocator_default_and_keeps_the_user_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    before = sys.getswitchinterval()
    try:
        process.setup_process(Settings(switch_interval_ms=1))
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert sys.getswitchinterval() == pytest.approx(0.001)
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
        process.setup_process(Settings())
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
        assert sys.getswitchinterval() == pytest.approx(0.001)  # unset: left as it was
    finally:
        sys.setswitchinterval(before)


def test_the_entry_points_set_the_process_up() -> None:
    """Every entry point that may run an engine calls setup_process: found in their source, so
    a new entry point that forgets it is caught by adding it here."""
    import inspect

    from ocrq import cli
    from ocrq.engine_process import host
    from ocrq.worker import main

    for fn in (main.run, host.main, cli.run, cli.tune):
        assert "setup_process(settings)" in inspect.getsource(fn), fn.__qualname__
    # No other module sets the allocator's variable.
    assert "PYTORCH_CUDA_ALLOC_CONF" not in inspect.getsource(main)


def test_a_worker_process_state_is_one_object() -> None:
    """`configure` fixes the worker name in STATE, where the broker's QoS reads the holder of
    each message it takes; a fresh interpreter, so this process's state is left alone."""
    code = textwrap.dedent(
        """
        from ocrq.core.process import STATE
        from ocrq.core.settings import Settings
        from ocrq.worker import runtime

        assert STATE.worker_name is None and STATE.runtime is None
        runtime.configure(Settings(engine="rapid"), node="w1@host")
        assert STATE.node == "w1@host" and STATE.settings.engine == "rapid"
        print(STATE.worker_name)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "w1@host" in out.stdout.strip()
