"""The start-up warning for imports compiled from source at every start (ocrq/core/startup.py
`uncached_bytecode`): on the H200 a worker without bytecode took 17.6 s to its first result
instead of 9.5. Each case runs a fresh interpreter, as a worker's engine process is."""

from __future__ import annotations

import compileall
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def note(pkg_root: Path, dont_write: bool) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    env["PYTHONPATH"] = os.pathsep.join([str(pkg_root), str(REPO)])
    if dont_write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    code = ("import heavy; from ocrq.core.startup import uncached_bytecode; "
            "print(uncached_bytecode(heavy))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_warns_only_when_the_package_is_compiled_at_every_start(tmp_path: Path) -> None:
    (tmp_path / "heavy").mkdir()
    (tmp_path / "heavy" / "__init__.py").write_text("X = 1\n")
    said = note(tmp_path, dont_write=True)
    assert "heavy has no bytecode cache" in said and "compileall" in said, said
    assert not (tmp_path / "heavy" / "__pycache__").exists()
    # Python writing bytecode: the first import writes it, no warning either way.
    assert note(tmp_path, dont_write=False) == "None"
    assert (tmp_path / "heavy" / "__pycache__").exists()
    assert note(tmp_path, dont_write=True) == "None"  # compiled once, read since


def test_compiled_at_install_is_enough(tmp_path: Path) -> None:
    (tmp_path / "heavy").mkdir()
    (tmp_path / "heavy" / "__init__.py").write_text("X = 2\n")
    assert compileall.compile_dir(str(tmp_path), quiet=1)
    assert note(tmp_path, dont_write=True) == "None"
