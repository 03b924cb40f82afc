"""bench/floors.py: the committed floors table is what the script makes from the committed H200
results (a replaced measurement must be re-run into the table, not edited by hand), and its
arithmetic agrees with a count made another way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_committed_table_is_the_scripts_output(tmp_path: Path) -> None:
    out = tmp_path / "floors"
    subprocess.run([sys.executable, "bench/floors.py", "--out", str(out)], cwd=REPO,
                   check=True, capture_output=True, timeout=60)
    made = (out / "floors_h200.md").read_text().splitlines()
    committed = (REPO / "bench/results/floors/floors_h200.md").read_text().splitlines()
    assert made[3:] == committed[3:]  # line 3 names the --out it was given


def test_the_vision_floor_counts_each_matrix_product() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from floors import Shape, vision_flops

    s, n = Shape(), 100
    per_layer = (
        3 * 2 * n * s.vision_hidden**2  # Q, K, V
        + 2 * n * s.vision_hidden**2  # out
        + 2 * 2 * n * s.vision_hidden * s.vision_mlp  # MLP up and down
        + 2 * 2 * n * n * s.vision_hidden  # QK^T and PV
    )
    assert vision_flops(s, n) == s.vision_layers * per_layer
