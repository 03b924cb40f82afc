"""The decode kernel as the H200 runs it, compiled here: the fp8 pool's layout keeps its values
out of one-byte shared-memory loads (bench/kv_sass.py; bench/results/kv_attention/README.md)."""

from __future__ import annotations

from pathlib import Path

from bench.kv_sass import TWO_WARPS, Case, measure
from ocrq.models.hunyuan.attention import FP8_CONFIG


def test_the_loops_fp8_pool_reads_its_values_in_vectors(tmp_path: Path) -> None:
    now = measure(Case("fp8e4nv", "transposed", True, FP8_CONFIG), tmp_path)
    before = measure(Case("fp8e4nv", "rows", False, TWO_WARPS), tmp_path)
    assert now["opcodes"].get("LDS.U8", 0) == 0 and now["opcodes"].get("LDG.E.U8", 0) == 0
    assert before["opcodes"]["LDS.U8"] == 128  # what the transposed pool removed
    assert now["warp_instructions_per_key"] < 0.75 * before["warp_instructions_per_key"]
