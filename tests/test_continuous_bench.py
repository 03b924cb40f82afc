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
        [sys.executable, "bench/continuous_batching.py", "--smoke", "--out", str(tmp_path),
         "--packed-chunks", "1024", "--packed-error-rows", "3", "--kv-error-steps", "6"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "continuous_batching_smoke.json").read_text())
    assert not data["errors"], data["errors"]
    modes = [r["mode"] for r in data["runs"]]
    assert modes == ["running chunked packed 1024", "running alternate", "running chunked",
                     "static b=4"]
    assert all(r["images_per_s"] > 0 and r["jobs"] == 12 for r in data["runs"])
    running = [r for r in data["runs"] if r["mode"].startswith("running")]
    assert all(r["prefills"] >= 2 and 0 < r["live_share_of_slot_steps"] <= 1 for r in running)
    assert "| running chunked |" in (tmp_path / "continuous_batching_smoke.md").read_text()
    # Packed and padded prefills of rows of three lengths: the same tokens, logits within
    # float32 rounding (a wrong row bound moves them by far more: tests/test_running_loop.py).
    err = data["packed_error"]
    assert err["variant"] == {"packed": True} and err["rows"] == 3
    assert err["tokens_equal_before_first_difference"] == 1.0
    assert err["max_abs_logit_diff"] < 1e-4 * err["logit_std"]


def test_gap_summary_counts_idle_once_across_overlapping_streams() -> None:
    """bench/service_gpu.py's reading of a CUPTI window: overlapping kernels are busy once,
    gaps are binned by length and charged to the kernel that ended them."""
    from bench.service_gpu import gap_summary

    spans = [(0, 10, "a"), (5, 20, "b"), (50, 60, "c"), (60.5, 70, "d"), (2070, 2080, "memset")]
    out = gap_summary(spans)
    assert out["busy_share"] == round(49.5 / 2080, 4)
    assert out["gaps"] == 3
    assert out["idle_ms_by_gap_length"][">1ms"] == 2.0
    assert out["idle_ms_before_kernel"] == {"memset": 2.0, "c": 0.0}
    assert out["idle_ms_after_kernel"]["d"] == 2.0


def test_gap_summary_sums_kernels_by_the_loop_profiles_groups() -> None:
    """A service window's kernel time by group (bench/loop_profile.py's), so the decode
    attention's share of a saturated window reads without a separate profile."""
    from bench.service_gpu import gap_summary

    spans = [(0, 1000, "split_kernel"), (1000, 1500, "nvjet_sm90_tst"),
             (1500, 3500, "split_kernel"), (3500, 3600, "merge_kernel"),
             (3600, 3700, "rope_rms_norm_kernel")]  # fmt: skip
    out = gap_summary(spans)
    assert out["kernel_ms_by_group"] == {"attention": 3.1, "gemm": 0.5, "norm/rope": 0.1}
    assert out["top_kernels"][0] == {"name": "split_kernel", "ms": 3.0, "calls": 2}


def test_stack_sampler_names_the_line_a_thread_sits_on(tmp_path: Path) -> None:
    """bench/stack_sample.py: a thread that spends its time in one function is found there."""
    import threading

    from bench.stack_sample import sample

    stop = threading.Event()

    def spin_here() -> None:
        while not stop.is_set():
            sum(range(2000))

    def idle_elsewhere() -> None:
        stop.wait()

    workers = [threading.Thread(target=spin_here, name="busy-one"),
               threading.Thread(target=idle_elsewhere, name="idle-one")]
    for w in workers:
        w.start()
    try:
        sample("busy-one", 0.0, 0.3, tmp_path / "stacks.json", every_s=0.002)
        sample("no-such-thread", 0.0, 0.1, tmp_path / "none.json")
    finally:
        stop.set()
        for w in workers:
            w.join()
    out = json.loads((tmp_path / "stacks.json").read_text())
    assert out["samples"] > 10
    functions = dict(out["functions_pct"])
    spin = [pct for name, pct in functions.items() if name.endswith(":spin_here")]
    assert spin and spin[0] > 90
    assert not any(name.endswith(":idle_elsewhere") for name in functions)
    assert "error" in json.loads((tmp_path / "none.json").read_text())


def test_busy_series_bins_by_five_seconds_and_marks_empty_bins() -> None:
    """bench/service_gpu.py's NVML series: samples averaged per 5 s from the part's start, a
    bin without samples is null (the report must stay JSON), samples outside are left out."""
    from bench.service_gpu import GpuSampler

    sampler = GpuSampler([])
    sampler.samples = [(99.0, [7]), (100.0, [10]), (102.0, [30]), (111.0, [90]), (130.0, [5])]
    assert sampler.series(100.0, 112.0) == [20.0, None, 90.0]
    assert sampler.busy(100.0, 112.0) == [round((10 + 30 + 90) / 3, 1)]
