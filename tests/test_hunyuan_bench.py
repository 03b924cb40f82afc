"""bench/hunyuan15_presets.py in its --smoke mode: the GPU measurement's script still runs.

Why a test: the H200 run is one call in a short lease; a script broken by a later change would
waste it. The smoke run builds both tiny versions, measures every preset and runs the forced-loop
guard batch on the CPU in ~15 s, writing the same JSON and markdown the GPU run writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.hunyuan

REPO = Path(__file__).resolve().parents[1]


def test_presets_bench_smoke_run(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "bench/hunyuan15_presets.py", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "hunyuan15_presets_smoke.json").read_text())
    assert not data["errors"], data["errors"]
    runs = data["runs"]
    assert {(r["version"], r["page"], r["preset"]) for r in runs} == {
        (v, p, s)
        for v in ("1.0", "1.5")
        for p in ("a4-150dpi", "a4-300dpi")
        for s in ("document", "scene", "full")
    }
    measured = [r for r in runs if "same_as" not in r]
    assert {r["version"] for r in measured} == {"1.0", "1.5"}
    assert all(r["pages_per_s"] > 0 and r["prefill_s_per_page"] > 0 for r in measured)
    guard = {(g["looping"], g["guard"]): g for g in data["guard"]}
    assert guard["all", "on"]["stopped"] == guard["all", "on"]["batch"]
    assert guard["all", "on"]["mean_tokens"] < guard["all", "off"]["mean_tokens"]
    assert guard["all", "on"]["steps"] < guard["all", "off"]["steps"]
    assert guard["half", "on"]["stopped"] == guard["half", "on"]["batch"] // 2
    table = (tmp_path / "hunyuan15_presets_smoke.md").read_text()
    assert "| 1.5 | a4-300dpi | full |" in table and "Repetition guard" in table
