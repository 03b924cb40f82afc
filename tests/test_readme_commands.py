"""The README's commands name extras, scripts, subcommands and options that exist.

The quick start and the service walk-through are run top to bottom by hand on a fresh machine;
this keeps their spelling from drifting from pyproject.toml, scripts/ and `ocrq --help` in CI.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from typer.testing import CliRunner

from ocrq.cli import app

REPO = Path(__file__).resolve().parents[1]


def _bash_lines() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        lines += [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]
    return lines


def test_quick_start_commands_are_kept() -> None:
    """CI runs the second; both must stay exactly as written."""
    lines = _bash_lines()
    assert "bash scripts/demo.sh" in lines and "bash scripts/test.sh" in lines


def test_scripts_and_extras_exist() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for line in _bash_lines():
        words = shlex.split(line.rstrip("&").strip())
        if words[:1] == ["bash"]:
            assert (REPO / words[1]).is_file(), line
        if words[1:2] == ["scripts/venv.sh"]:
            for extra in words[2].split(","):
                assert extra in extras, f"{line}: no extra {extra!r} in pyproject.toml"


def test_ocrq_subcommands_and_options_exist() -> None:
    seen = 0
    for line in _bash_lines():
        words = shlex.split(line.rstrip("&").strip())
        words = [w for w in words if "=" not in w or w.startswith("-")]  # VAR=value prefixes
        if not words or not words[0].endswith("bin/ocrq"):
            continue
        command, *rest = words[1:]
        result = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
        assert result.exit_code == 0, f"{line}: `ocrq {command}` is no command"
        for option in (w.split("=")[0] for w in rest if w.startswith("--")):
            assert option in result.output, f"{line}: `ocrq {command}` has no {option}"
        seen += 1
    assert seen >= 3  # migrate, worker, submit
