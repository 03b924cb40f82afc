"""bench/continuous_batching.py in its --smoke mode: the H200 measurement's script still runs.

The GPU run is one call in a short lease; this runs the same parts (static batches, the running
loop under both prefill schedules) on the tiny model on the CPU and checks the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.hunyuan

REPO = Path(__file__).resolve().parents[1]


def test_continuous_bench_smoke_run(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "bench/continuous_batching.py", "--smoke", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "continuous_batching_smoke.json").read_text())
    assert not data["errors"], data["errors"]
    modes = [r["mode"] for r in data["runs"]]
    assert modes == ["running alternate", "running chunked", "static b=4"]
    assert all(r["images_per_s"] > 0 and r["jobs"] == 12 for r in data["runs"])
    running = [r for r in data["runs"] if r["mode"].startswith("running")]
    assert all(r["prefills"] >= 2 and 0 < r["live_share_of_slot_steps"] <= 1 for r in running)
    assert "| running chunked |" in (tmp_path / "continuous_batching_smoke.md").read_text()
