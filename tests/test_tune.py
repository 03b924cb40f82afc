"""Cost-model calibration: the fit, `ocrq tune` end to end, workers loading profiles, OOM recovery.

Real parts throughout: `ocrq tune` runs as a subprocess on the real CPU engine and on the tiny
random HunyuanOCR (CPU), measuring host memory; the worker's runtime is built from the profile
it wrote. The one fake is the engine that raises torch's OutOfMemoryError above N images, since a
CUDA OOM cannot happen here; it is the real tiny HunyuanEngine otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from ocrq.core.db import get_engine
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from ocrq.models.base import OcrResult, PreparedImage
from ocrq.models.costs import CostModel, GiB, ItemCost
from ocrq.scheduling.batcher import StaticBatcher as Batcher
from ocrq.scheduling.vocabulary import BatchConfig
from ocrq.tuning.calibration import Sample, fit, relative_error
from ocrq.tuning.profiles import KEY_FIELDS, engine_key, load_profile, profile_path
from ocrq.tuning.sweep import SweepPoint, SweepProblem, recommend, run_sweep
from ocrq.worker.runtime import build_runtime

OCRQ = Path(sys.executable).parent / "ocrq"
MiB = 1024**2
TRUE = CostModel(
    fixed_bytes=2 * GiB, per_item_bytes=1.5 * MiB, per_token_bytes=148 * 1024.0,
    per_patch_bytes=3 * 1024.0,
)
CROP = ItemCost(tokens=320, patches=1024, pixels=512 * 512)
PAGE = ItemCost(tokens=1090, patches=4096, pixels=1024 * 1024)
A4 = ItemCost(tokens=2250, patches=8580, pixels=1248 * 1760)


def measured(model: CostModel, costs: Sequence[ItemCost], noise: float = 0.0) -> Sample:
    return Sample(tuple(costs), round(model.peak_bytes(list(costs)) * (1.0 + noise)))


def probe_like(model: CostModel) -> list[Sample]:
    """What tune measures: series of one image each, and a padded mix of a long and short ones."""
    samples = [measured(model, [c] * n) for c in (CROP, PAGE, A4) for n in (1, 4, 16, 64)]
    samples.append(measured(model, [A4] + [CROP] * 31))
    return samples


# -- the fit -------------------------------------------------------------------------------------


def test_fit_recovers_known_coefficients() -> None:
    got = fit(probe_like(TRUE), cover=False).model
    assert got.fixed_bytes == pytest.approx(TRUE.fixed_bytes, rel=1e-6)
    assert got.per_item_bytes == pytest.approx(TRUE.per_item_bytes, rel=1e-4)
    assert got.per_token_bytes == pytest.approx(TRUE.per_token_bytes, rel=1e-6)
    assert got.per_patch_bytes == pytest.approx(TRUE.per_patch_bytes, rel=1e-4)
    # Exact data needs no cover, and predicts an unseen batch exactly.
    covered = fit(probe_like(TRUE))
    assert covered.cover_factor == 1.0 and covered.max_rel_error < 1e-6
    unseen = [PAGE] * 7 + [CROP] * 50
    assert covered.model.peak_bytes(unseen) == pytest.approx(TRUE.peak_bytes(unseen), rel=1e-6)


def test_prefill_and_decode_phases() -> None:
    """The prefill is charged for prompt tokens only; the new tokens count once their KV cache
    outgrows the prefill, and then at the cache's rate, padded to the longest sequence."""
    model = CostModel(fixed_bytes=GiB, per_token_bytes=160 * 1024.0,
                      per_cache_token_bytes=100 * 1024.0)
    short = ItemCost(tokens=1071 + 256, patches=4096, pixels=0, new_tokens=256)
    assert short.prompt_tokens == 1071
    assert model.batch_bytes([short] * 8) == (8 * 1071 * 160 * 1024)
    long = ItemCost(tokens=1071 + 1024, patches=4096, pixels=0, new_tokens=1024)
    assert model.batch_bytes([long] * 8) == (8 * 2095 * 100 * 1024)
    # Mixed: the longest prompt drives the prefill, the longest sequence the cache.
    mixed = [ItemCost(tokens=330 + 1024, patches=1200, pixels=0, new_tokens=1024), short]
    assert model.batch_bytes(mixed) == int(max(2 * 1071 * 160, 2 * 1354 * 100) * 1024)
    # A model without the decode term (engines that generate nothing) is unchanged.
    assert CostModel(0, per_token_bytes=1.0).batch_bytes([long]) == 1071


def test_fit_uses_prompt_tokens_and_keeps_the_cache_rate() -> None:
    """Probes generate a few tokens: the per-token coefficient is fitted on the prompt part,
    and the decode coefficient is the engine's, passed through."""
    truth = CostModel(fixed_bytes=2 * GiB, per_token_bytes=160 * 1024.0,
                      per_cache_token_bytes=100 * 1024.0)
    probes = [ItemCost(t + 64, 4 * t, 0, new_tokens=64) for t in (330, 1071, 2215)]
    samples = [measured(truth, [c] * n) for c in probes for n in (1, 4, 16)]
    got = fit(samples, cover=False, cache_token_bytes=100 * 1024.0).model
    assert got.per_token_bytes + 4 * got.per_patch_bytes == pytest.approx(160 * 1024.0, rel=1e-6)
    assert got.per_cache_token_bytes == 100 * 1024.0
    # Small probes of short prompts peak in the decode: left out of the prefill fit, they
    # leave the coefficients as they are.
    small = ItemCost(330 + 64, 4 * 330, 0, new_tokens=64)
    truth_d = replace(truth, decode_fixed_bytes=40 * MiB)
    assert truth_d.batch_bytes([small]) > 160 * 1024 * 330  # the decode part is the peak
    mixed = [measured(truth_d, [c] * n) for c in (*probes, small) for n in (1, 4, 16)]
    refit = fit(mixed, cover=False, cache_token_bytes=100 * 1024.0,
                decode_fixed_bytes=40 * MiB).model
    assert refit.per_token_bytes + 4 * refit.per_patch_bytes == pytest.approx(160 * 1024.0,
                                                                              rel=1e-6)
    assert refit.fixed_bytes == pytest.approx(2 * GiB, rel=1e-6)
    serving = ItemCost(1071 + 1024, 4 * 1071, 0, new_tokens=1024)
    assert got.peak_bytes([serving] * 32) == pytest.approx(truth.peak_bytes([serving] * 32),
                                                           rel=1e-6)


def test_without_the_padded_probe_tokens_and_patches_cannot_be_told_apart() -> None:
    """Why tune runs the mixed batch: series of one image each leave the split undetermined,
    and a wrong split under-predicts padded batches (what happened on the H200, see
    bench/results/planner_vs_fixed/planner_vs_fixed_h200.md)."""
    # Patches proportional to tokens in every series: any split fits them equally well.
    images = [ItemCost(t, 4 * t, 0) for t in (320, 1090, 2250)]
    series = [measured(TRUE, [c] * n) for c in images for n in (1, 4, 16)]
    wrong = CostModel(TRUE.fixed_bytes, TRUE.per_item_bytes, 0.0,
                      TRUE.per_patch_bytes + TRUE.per_token_bytes / 4)
    assert all(abs(relative_error(wrong, s)) < 1e-6 for s in series)
    padded = [images[2]] + [images[0]] * 31
    assert wrong.peak_bytes(padded) < 0.5 * TRUE.peak_bytes(padded)
    with_mix = fit([*series, measured(TRUE, padded)], cover=False).model
    assert with_mix.per_token_bytes == pytest.approx(TRUE.per_token_bytes, rel=1e-3)


@settings(max_examples=60, deadline=None)
@given(
    fixed=st.integers(100 * MiB, 40 * GiB),
    per_item=st.floats(0.0, 50 * MiB),
    per_token=st.floats(1.0, 512 * 1024.0),
    per_patch=st.floats(0.0, 64 * 1024.0),
    noise=st.lists(st.floats(-0.03, 0.03), min_size=13, max_size=13),
)
def test_fit_property_recovers_and_covers(
    fixed: int, per_item: float, per_token: float, per_patch: float, noise: list[float]
) -> None:
    true = CostModel(fixed, per_item, per_token, per_patch)
    exact = fit(probe_like(true), cover=False).model
    for batch in ([CROP] * 100, [A4] * 9 + [PAGE], [PAGE] * 3):
        assert exact.peak_bytes(batch) == pytest.approx(true.peak_bytes(batch), rel=1e-6)
    # Measured peaks are noisy: the covered model predicts at least every one of them, and
    # stays close to them (the noise spans 6%, the fit may lean on it a little more).
    noisy = [
        Sample(s.costs, round(s.peak_bytes * (1 + e)))
        for s, e in zip(probe_like(true), noise, strict=True)
    ]
    covered = fit(noisy)
    for s in noisy:
        assert covered.model.peak_bytes(list(s.costs)) >= s.peak_bytes
    assert covered.max_rel_error <= 0.10
    for field in ("per_item_bytes", "per_token_bytes", "per_patch_bytes"):
        assert getattr(covered.model, field) >= 0.0


def test_fit_keeps_coefficients_nonnegative_and_fixed_above_the_baseline() -> None:
    """Peaks that do not grow with the batch (the CPU engine reads images one at a time) would
    want a negative per-image term; the fit drops it, and never goes below the baseline."""
    samples = [
        Sample((PAGE,) * n, 600 * MiB + (80 * MiB if n == 1 else 40 * MiB)) for n in (1, 2, 4)
    ]
    result = fit(samples, min_fixed_bytes=700 * MiB)
    m = result.model
    assert m.fixed_bytes >= 700 * MiB
    assert min(m.per_item_bytes, m.per_token_bytes, m.per_patch_bytes) >= 0.0
    assert all(relative_error(m, s) >= 0 for s in samples)


# -- host memory measurement ---------------------------------------------------------------------


def test_host_peak_memory_follows_allocations() -> None:
    from ocrq.models.memory import HostMemory, memory_of
    from ocrq.models.rapid import RapidEngine

    engine = memory_of(RapidEngine())  # the CPU engine's memory is the host's
    assert isinstance(engine, HostMemory)
    engine.reset_peak_memory()
    before = engine.peak_memory_bytes()
    block = np.ones(300 * MiB, dtype=np.uint8)  # touched, so resident
    grown = engine.peak_memory_bytes()
    del block
    engine.reset_peak_memory()
    after = engine.peak_memory_bytes()
    assert grown - before >= 280 * MiB
    assert after < grown - 200 * MiB  # the reset starts a new window
    assert engine.memory_capacity_bytes() > after


# -- `ocrq tune` on the CPU engine, and workers loading its profile --------------------------


def run_tune(env: dict[str, str], *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(OCRQ), "tune", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def rapid_tune(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    profiles = tmp_path_factory.mktemp("profiles")
    env = {**os.environ, "OCRQ_PROFILE_DIR": str(profiles), "COLUMNS": "160"}
    proc = run_tune(env, "--engine", "rapid", "--budget", "2", "--max-seconds", "40")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return profiles, proc


def only_profile(folder: Path) -> Path:
    found = sorted(folder.glob("rapid-*.json"))
    assert len(found) == 1, found
    return found[0]


def test_tune_rapid_prints_table_and_writes_plot_and_profile(rapid_tune: tuple[Path, Any]) -> None:
    profiles, proc = rapid_tune
    for column in ("batch", "seconds", "peak GiB", "images/s", "status"):
        assert column in proc.stdout
    assert "a4-1240x1754" in proc.stdout and "ok" in proc.stdout
    path = only_profile(profiles)
    assert f"profile: {path}" in proc.stdout
    body = json.loads(path.read_text())
    assert set(body["key"]) == set(KEY_FIELDS)  # the CPU engine adds no fields of its own
    assert body["key"]["engine"] == "rapid" and body["key"]["device"]
    assert body["budget_bytes"] == 2 * GiB
    model = body["model"]
    assert model["fixed_bytes"] >= body["baseline_bytes"] > 0
    ran = [p for p in body["probes"] if p["status"] == "ok"]
    assert len(ran) >= 3
    assert max(p["batch"] for p in ran) >= 2
    # Every probe that ran is covered by the fitted model, and none passed the budget.
    for p in ran:
        assert p["fit_bytes"] >= p["peak_bytes"]
        assert p["peak_bytes"] < 2 * GiB
    png = Path(body["plot"])
    assert png == path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def sqlite_store(tmp_path: Path) -> JobStore:
    return JobStore(get_engine(f"sqlite:///{tmp_path / 'jobs.sqlite'}"))


def test_worker_uses_the_tuned_profile(
    rapid_tune: tuple[Path, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    profiles, _ = rapid_tune
    path = only_profile(profiles)
    caplog.set_level(logging.INFO, logger="ocrq.scheduling.engine_side")
    runtime = build_runtime(
        Settings(engine="rapid", profile_dir=profiles, memory_budget_gib=2.0),
        store=sqlite_store(tmp_path),
    )
    try:
        model = runtime.batcher.cost_model
        assert model.source == str(path)
        stored = json.loads(path.read_text())["model"]
        assert model.fixed_bytes == stored["fixed_bytes"]
        assert model.per_patch_bytes == pytest.approx(stored["per_patch_bytes"])
        # The budget is measured from the profile's fixed part, not the engine default's, and
        # planned to the utilisation share of the 2 GiB (the rest is allocator slack).
        usable = int(2 * runtime.settings.memory_utilization * GiB)
        assert runtime.batcher.config.budget_bytes == usable - stored["fixed_bytes"]
        assert f"cost model: profile {path}" in caplog.text
    finally:
        runtime.close()


def test_worker_without_profile_uses_the_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ocrq.scheduling.engine_side")
    runtime = build_runtime(
        Settings(engine="rapid", profile_dir=tmp_path / "empty"), store=sqlite_store(tmp_path)
    )
    try:
        assert runtime.batcher.cost_model == runtime.engine.cost_model()
        assert runtime.batcher.cost_model.source == "default"
        assert "cost model: default (no profile for" in caplog.text
        assert '"engine": "rapid"' in caplog.text
    finally:
        runtime.close()


def test_profile_of_another_key_is_ignored(rapid_tune: tuple[Path, Any], tmp_path: Path) -> None:
    profiles, _ = rapid_tune
    body = json.loads(only_profile(profiles).read_text())
    key = dict(body["key"])
    assert load_profile(profiles, key) is not None
    other = {**key, "max_new_tokens": "2048"}
    assert load_profile(profiles, other) is None  # no file under that key's name
    # A file under the right name but written for another key (copied by hand, say).
    forged = tmp_path / "forged"
    target = profile_path(forged, key)
    forged.mkdir()
    target.write_text(json.dumps({**body, "key": other}))
    assert load_profile(forged, key) is None


# -- the tiny HunyuanOCR on the CPU --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny checkpoint in a fake HF cache as tencent/HunyuanOCR (see test_hunyuan_engine)."""
    pytest.importorskip("transformers")
    from tests.tiny_hunyuan import offline_tiny_cache

    with offline_tiny_cache(tmp_path_factory.mktemp("hf")) as root:
        yield root


def tiny_settings(**extra: Any) -> Settings:
    return Settings(engine="hunyuan", model="tencent/HunyuanOCR", model_subfolder=None,
                    dtype="float32", device="cpu", max_new_tokens=4, **extra)


@pytest.mark.hunyuan
def test_tune_tiny_hunyuan_writes_a_profile_the_worker_loads(
    tiny_cache: Path, tmp_path: Path
) -> None:
    profiles = tmp_path / "profiles"
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tiny_cache),
        "OCRQ_PROFILE_DIR": str(profiles), "OCRQ_DEVICE": "cpu", "OCRQ_DTYPE": "float32",
        "OCRQ_MAX_NEW_TOKENS": "4", "COLUMNS": "160",
        # Workers that run the loop (on a CPU only when asked) get its sizing in the profile.
        "OCRQ_SCHEDULER": "continuous",
    }
    proc = run_tune(env, "--engine", "hunyuan", "--budget-fraction", "0.5",
                    "--max-seconds", "20", "--max-batch", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = sorted(profiles.glob("hunyuan-*.json"))
    body = json.loads(path.read_text())
    key = body["key"]
    from tests.tiny_hunyuan import COMMIT

    # The loaded snapshot, not the branch name: a newer snapshot of main is another model.
    assert (key["engine"], key["model"], key["revision"]) == ("hunyuan", "tencent/HunyuanOCR",
                                                              COMMIT)
    assert (key["dtype"], key["attention"], key["max_new_tokens"]) == ("float32", "sdpa", "4")
    from ocrq.models.hunyuan import HunyuanEngine

    assert list(key) == [*KEY_FIELDS, *HunyuanEngine.profile_fields]  # the engine names its own
    statuses = [p["status"] for p in body["probes"]]
    assert statuses.count("ok") >= 4
    assert any(p["label"].startswith("mixed") and p["status"] == "ok" for p in body["probes"])
    assert Path(body["plot"]).is_file()
    # What the running loop gets at the tuned budget, from the fitted model.
    loop = body["running_loop"]
    assert loop["pool_tokens"] > 0 and loop["slots"] == 8
    assert loop["pool_bytes"] + loop["prefill_bytes"] <= body["budget_bytes"]
    assert f"a KV pool of {loop['pool_tokens']} tokens" in proc.stdout

    # The same key from an engine loaded in this process: the worker finds the profile.
    runtime = build_runtime(tiny_settings(profile_dir=profiles), store=sqlite_store(tmp_path))
    try:
        assert engine_key(runtime.engine) == key
        assert runtime.batcher.cost_model.source == str(path)
    finally:
        runtime.close()


class OomAboveN:
    """Mixin: `run` raises torch's OutOfMemoryError for batches over `limit` images, as a device
    of that size would, after allocating a tensor in its frame as a failing forward does."""

    limit = 3

    def setup_oom(self) -> None:
        self.sizes: list[int] = []
        self.failed_tensors: list[weakref.ref] = []
        self.alive_at_retry: list[bool] = []

    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        import torch

        self.sizes.append(len(batch))
        self.alive_at_retry.append(any(ref() is not None for ref in self.failed_tensors))
        if len(batch) > self.limit:
            activations = torch.ones(1024)
            self.failed_tensors.append(weakref.ref(activations))
            raise torch.OutOfMemoryError(f"CUDA out of memory: {len(batch)} > {self.limit}")
        return super().run(batch)  # type: ignore[misc]


def noise_item(key: str, w: int, h: int, seed: int) -> PreparedImage:
    rng = np.random.default_rng(seed)
    image = Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))
    return PreparedImage(key, image, (w, h))


@pytest.mark.hunyuan
def test_oom_recovery_end_to_end_on_the_tiny_model(tiny_cache: Path) -> None:
    from ocrq.models.hunyuan import HunyuanEngine

    class OomHunyuan(OomAboveN, HunyuanEngine):
        pass

    engine = OomHunyuan(tiny_settings())
    engine.setup_oom()
    engine.load()
    sizes = [(64, 64), (100, 150), (160, 90), (120, 120), (70, 140), (150, 60), (90, 90),
             (140, 100)]
    items = [noise_item(f"k{i}", w, h, i) for i, (w, h) in enumerate(sizes)]
    # Unconstrained: the whole batch at once through the plain engine.
    plain = HunyuanEngine(tiny_settings())
    plain.load()
    expected = plain.run([noise_item(f"k{i}", w, h, i) for i, (w, h) in enumerate(sizes)])

    config = BatchConfig(max_items=8, wait_s=0.5, budget_bytes=64 * GiB)
    batcher = Batcher(engine, config).start()
    futures = [batcher.submit(it) for it in items]
    outcomes = [f.result(timeout=120) for f in futures]
    batcher.stop()
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    assert [o.result for o in outcomes] == expected
    # 8 and both halves of 4 ran out of memory; the quarters of 2 ran.
    assert engine.sizes == [8, 4, 2, 2, 4, 2, 2]
    assert batcher.oom_events == 3
    # The failed batch's tensors were freed before any retry ran (the traceback is dropped
    # before recovering): otherwise a retry on a GPU would run short of the memory they hold.
    assert engine.failed_tensors and not any(engine.alive_at_retry)
    assert all(ref() is None for ref in engine.failed_tensors)
    assert [p.image.size for p in items] == sizes  # no image had to be shrunk


# -- `ocrq tune --images`: the sweep, the knee, the recommendation ------------------------------

def point(setting: int, rate: float, peak_gib: float, status: str = "ok") -> SweepPoint:
    if status != "ok":
        return SweepPoint(setting, status)
    return SweepPoint(setting, "ok", images=8, seconds=8 / rate, peak_bytes=int(peak_gib * GiB))


def test_knee_is_the_small_batch_when_throughput_falls() -> None:
    """The issue's CPU figures: receipts/s fell from 2.56 to 0.61 as the batch grew."""
    falling = [point(1, 2.56, 0.5), point(2, 1.9, 0.6), point(4, 1.2, 0.7), point(8, 0.61, 0.9)]
    rec = recommend(falling, 4 * GiB)
    assert (rec.setting, rec.best_setting, rec.limited_by) == (1, 1, "throughput")
    assert rec.headroom_kept == pytest.approx(1 - 0.5 / 4)


def test_knee_is_the_smallest_setting_within_the_fraction_of_the_best() -> None:
    rising = [point(1, 1.0, 1), point(2, 1.8, 2), point(4, 3.0, 3), point(8, 3.1, 5),
              point(16, 3.12, 9)]
    assert recommend(rising, 20 * GiB).setting == 4  # 3.0 >= 0.95 x 3.12
    assert recommend(rising, 20 * GiB, fraction=0.99).setting == 8
    # Batch 16 keeps less than 15% of a 10 GiB budget free: the best is taken without it.
    assert recommend(rising, 10 * GiB).best_setting == 8


def test_knee_limited_by_memory_and_the_oom_point() -> None:
    climbing = [point(1, 1.0, 1), point(2, 2.0, 2), point(4, 4.0, 3.8), point(8, 0, 0, "oom")]
    rec = recommend(climbing, 4 * GiB)  # batch 4 leaves 5% free, 15% is asked
    assert (rec.setting, rec.limited_by) == (2, "memory")
    with pytest.raises(SweepProblem, match="too little to name a knee"):
        recommend([point(1, 1.0, 1), point(2, 0, 0, "skipped: time")], 4 * GiB)
    with pytest.raises(SweepProblem, match="raise --budget"):
        recommend([point(1, 1.0, 3.9), point(2, 2.0, 3.95)], 4 * GiB)


def test_a_running_loops_pool_is_not_taken_for_what_its_rows_need() -> None:
    """The H200 sweep of the evaluation images (bench/results/tune_gpu/tune_eval.md): from 64
    slots on, the loop's pool filled 96% of the budget. Read as the rows' need, that left no
    headroom and the knee fell to 32 slots at 0.45x the best rate; the loop's peak is its pool,
    so every setting that ran within the budget counts."""
    h200 = [point(1, 3.41, 4.2), point(2, 3.43, 5.9), point(4, 6.77, 9.7), point(8, 5.52, 16.0),
            point(16, 9.56, 30.5), point(32, 16.10, 58.1), point(64, 23.27, 106.9),
            point(128, 30.87, 107.0), point(256, 35.55, 107.0)]
    budget = int(111.84 * GiB)
    assert recommend(h200, budget).setting == 32  # the rule for static batches
    rec = recommend(h200, budget, pooled=True)
    assert (rec.setting, rec.best_setting, rec.limited_by) == (256, 256, "throughput")
    assert "sizes its KV pool to the budget" in rec.describe("max batch")
    over = [*h200[:-1], point(256, 0, 0, "oom")]  # a loop that did not open is still refused
    assert recommend(over, budget, pooled=True).setting == 128


def test_a_sweep_cut_while_still_rising_names_no_knee_below_it() -> None:
    """The H200 sweep of A4 pages (bench/results/tune_gpu/tune_a4.md): 256 slots did not fit in
    --max-seconds and 128 was the best measured; advised, 128 ran the service at 0.66x the
    default's 256. A rate still rising where the time ran out is no knee."""
    a4 = [point(16, 3.60, 31.1), point(32, 5.28, 58.1), point(64, 6.64, 106.9),
          point(128, 7.89, 106.9), point(256, 0, 0, "skipped: needs ~73 s, past --max-seconds")]
    rec = recommend(a4, int(111.84 * GiB), pooled=True)
    assert (rec.setting, rec.limited_by) == (128, "time")
    # Flat at the end: a knee, whatever the time did.
    flat = [*a4[:3], point(128, 6.70, 106.9), a4[-1]]
    assert recommend(flat, int(111.84 * GiB), pooled=True).limited_by == "throughput"


def receipt_tops(folder: Path, count: int = 4, height: int = 300) -> Path:
    """The top of real receipts (their header lines), 360 px wide and at most `height` tall:
    receipts-like and quick (the CPU engine reads a 360x120 top in ~0.4 s here, a 360x300 one
    in ~4 s)."""
    from tests.conftest import EVAL_DATA

    paths = sorted((EVAL_DATA / "sroie" / "img").glob("*.jpg"))[:count]
    if len(paths) < count:
        pytest.fail(f"receipts not found under {EVAL_DATA}: set OCRQ_EVAL_DATA to the ocr-eval "
                    "folder")
    folder.mkdir(parents=True, exist_ok=True)
    for path in paths:
        with Image.open(path) as raw:
            image = raw.convert("RGB")
        image = image.resize((360, round(image.height * 360 / image.width)))
        image.crop((0, 0, 360, min(height, image.height))).save(folder / f"{path.stem}.png")
    return folder


@pytest.fixture(scope="module")
def images_tune(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, float]:
    """`ocrq tune --images DIR` on the CPU engine, as a user runs it."""
    import time

    root = tmp_path_factory.mktemp("images-tune")
    # Their header lines only: the sweep runs the sample 3 rounds x 3 settings, and what is
    # asserted (the knee's rule over what was measured, the anatomy, the lines to paste) does
    # not depend on how long an image takes (360x300 tops took the fixture ~100 s here).
    folder = receipt_tops(root / "receipts", height=120)
    profiles = root / "profiles"
    env = {**os.environ, "OCRQ_PROFILE_DIR": str(profiles), "COLUMNS": "160"}
    env.pop("OCRQ_MAX_BATCH", None)
    t0 = time.monotonic()
    proc = run_tune(env, "--engine", "rapid", "--images", str(folder), "--max-batch", "4",
                    "--budget", "4", "--max-seconds", "120", timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return profiles, proc, time.monotonic() - t0


def test_tune_images_prints_the_anatomy_the_knee_and_the_lines_to_paste(
    images_tune: tuple[Path, Any, float],
) -> None:
    profiles, proc, _ = images_tune
    out = proc.stdout
    for column in ("max batch", "images/s", "peak GiB", "budget", "<- knee"):
        assert column in out
    assert "images/s: steady state: the whole sample once per setting" in out
    for term in ("weights", "framework / fixed", "activations (prefill)", "KV cache",
                 "input / output buffers", "prefill pass reserve"):
        assert term in out
    assert "n/a: this engine generates no tokens" in out  # the CPU engine keeps no KV cache
    body = json.loads(only_profile(profiles).read_text())
    rec = body["recommended"]
    assert f"OCRQ_MAX_BATCH={rec['max_batch']}" in out
    assert "OCRQ_MEMORY_BUDGET_GIB=4.00" in out
    assert f"knee: max batch {rec['max_batch']} makes" in out
    assert "for vllm serve" not in out  # the CPU engine has no vLLM equivalent
    assert "the default max batch (4)" in out or "the default max batch 4 " in out  # rapid's
    # The sweep ran each setting on the whole sample; the knee follows the stated rule from what
    # was measured: the smallest setting within 95% of the best that keeps 15% of the budget.
    ran = [p for p in body["sweep"] if p["status"] == "ok"]
    assert [p["setting"] for p in ran][:2] == [1, 2] and all(p["images"] == 4 for p in ran)
    fits = [p for p in ran if p["peak_bytes"] <= 0.85 * body["budget_bytes"]]
    best = max(p["images_per_s"] for p in fits)
    assert rec["max_batch"] == min(p["setting"] for p in fits if p["images_per_s"] >= 0.95 * best)
    if ran[-1]["images_per_s"] < 0.95 * ran[0]["images_per_s"]:  # throughput fell: small batch
        assert rec["max_batch"] < ran[-1]["setting"]
    terms = {t["term"]: t for t in body["anatomy"]}
    assert terms["weights"]["bytes"] > 10 * MiB  # three ONNX models in host memory
    assert terms["KV cache"]["bytes"] is None and terms["prefill pass reserve"]["bytes"] is None
    assert body["seconds"] <= 1.5 * 120
    png = Path(body["plot"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_worker_started_after_tune_uses_the_recommended_max_batch(
    images_tune: tuple[Path, Any, float], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    profiles, _, _ = images_tune
    body = json.loads(only_profile(profiles).read_text())
    knee = body["recommended"]["max_batch"]
    if knee == 4:  # rapid's own preference: a copy of the profile names another knee
        knee = body["recommended"]["max_batch"] = 3
        copy = tmp_path / "profiles"
        copy.mkdir()
        (copy / only_profile(profiles).name).write_text(json.dumps(body))
        profiles = copy
    caplog.set_level(logging.INFO, logger="ocrq.scheduling.engine_side")
    runtime = build_runtime(Settings(engine="rapid", profile_dir=profiles),
                            store=sqlite_store(tmp_path))
    try:
        assert knee != runtime.engine.preferred_max_batch()  # so the profile is what decided
        assert runtime.batcher.config.max_items == knee
        assert f"recommended max batch {knee}" in caplog.text
    finally:
        runtime.close()
    # An explicit OCRQ_MAX_BATCH wins over the profile.
    runtime = build_runtime(Settings(engine="rapid", profile_dir=profiles, max_batch=7),
                            store=sqlite_store(tmp_path))
    try:
        assert runtime.batcher.config.max_items == 7
    finally:
        runtime.close()


def test_tune_images_refuses_a_sample_too_small_or_all_alike(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    env = {**os.environ, "OCRQ_PROFILE_DIR": str(profiles), "COLUMNS": "160"}
    folder = receipt_tops(tmp_path / "two", count=2)
    proc = run_tune(env, "--engine", "rapid", "--images", str(folder), timeout=60)
    assert proc.returncode == 2
    assert "too small a sample to tune on: 2 distinct images" in proc.stderr
    one = next(folder.glob("*.png"))
    alike = tmp_path / "alike"
    alike.mkdir()
    for i in range(5):
        (alike / f"copy{i}.png").write_bytes(one.read_bytes())
    proc = run_tune(env, "--engine", "rapid", "--images", str(alike), timeout=60)
    assert proc.returncode == 2
    assert "1 distinct images (5 image files, 4 of them copies of another)" in proc.stderr
    assert not profiles.exists()  # nothing written, and no engine was loaded for it


def test_tune_images_honours_max_seconds(tmp_path: Path) -> None:
    """One second cannot hold the sample even once: tune stops before the first setting, says
    so with what it measured, and writes no profile."""
    import time

    folder = receipt_tops(tmp_path / "receipts", count=3)
    profiles = tmp_path / "profiles"
    env = {**os.environ, "OCRQ_PROFILE_DIR": str(profiles), "COLUMNS": "160"}
    t0 = time.monotonic()
    proc = run_tune(env, "--engine", "rapid", "--images", str(folder), "--max-seconds", "1",
                    timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "past --max-seconds" in proc.stdout  # the setting it skipped, in the table
    assert "too little to name a knee" in proc.stderr
    assert not profiles.exists()
    assert elapsed < 100  # start-up, the engine's load and one image, not a sweep


class OomRapid:
    """The CPU engine, running out of memory above `limit` images as a device would (host
    memory cannot be made to run out here without starving the machine)."""

    limit = 2

    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        if len(batch) > self.limit:
            raise MemoryError(f"out of memory: {len(batch)} > {self.limit}")
        return super().run(batch)  # type: ignore[misc]


def test_sweep_stops_at_the_oom_point_and_recovers() -> None:
    import time

    from ocrq.models.rapid import RapidEngine
    from ocrq.tuning.probing import draw_page

    class Engine(OomRapid, RapidEngine):
        pass

    engine = Engine()
    engine.load()
    rows = [PreparedImage(f"r{i}", draw_page(240, 60, [f"TOTAL {i}.50"], 20), (240, 60))
            for i in range(3)]
    for row in rows:
        engine.prepare(row)
    sweep = run_sweep(engine, rows, 4 * GiB, max_batch=8, deadline=time.monotonic() + 100,
                      warm_each=False)
    assert [(p.setting, p.status) for p in sweep.points] == [(1, "ok"), (2, "ok"), (4, "oom")]
    assert sweep.oom_setting == 4
    rec = recommend(sweep.points, 4 * GiB)
    assert rec.setting in (1, 2)
    assert engine.run(rows[:1])[0].text  # the engine still reads after the OOM


def test_a_setting_running_past_the_deadline_is_cut_there() -> None:
    """The prediction passed (it comes from one warm image) but the sample took longer: the
    setting stops at the deadline, between batches, and says how far it got; nothing after it
    runs. On an H200 the cold first call's time once predicted 191 s for a setting that ran in
    ~20 s, and tune measured nothing."""
    from ocrq.models.rapid import RapidEngine
    from ocrq.tuning.probing import draw_page

    engine = RapidEngine()
    engine.load()
    rows = [PreparedImage(f"r{i}", draw_page(240, 60, [f"TOTAL {i}.50"], 20), (240, 60))
            for i in range(3)]
    for row in rows:
        engine.prepare(row)
    calls = iter(range(1000))
    # started, the warm call's check, the pre-check of setting 1, its first batch: in time;
    # its second: past it.
    sweep = run_sweep(engine, rows, 4 * GiB, max_batch=8, deadline=100.0, warm_each=False,
                      clock=lambda: 0.0 if next(calls) < 4 else 1e9)
    assert [(p.setting, p.status) for p in sweep.points] == [
        (1, "skipped: past --max-seconds after 1 of 3 images")
    ]
    with pytest.raises(SweepProblem, match="too little to name a knee"):
        recommend(sweep.points, 4 * GiB)


@pytest.mark.hunyuan
def test_tune_images_on_the_tiny_hunyuan(tiny_cache: Path, tmp_path: Path) -> None:
    """A generating engine: random weights get the bench's drawn output lengths, the anatomy
    has a KV cache and, with the running loop, a prefill reserve; vLLM flags are printed."""
    from ocrq.tuning.probing import draw_page

    folder = tmp_path / "pages"
    folder.mkdir()
    for i, (w, h) in enumerate([(240, 64), (200, 96), (160, 160), (96, 200)]):
        draw_page(w, h, [f"LINE {i}", "TOTAL 9.90"], 16).save(folder / f"p{i}.png")
    profiles = tmp_path / "profiles"
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tiny_cache),
        "OCRQ_PROFILE_DIR": str(profiles), "OCRQ_DEVICE": "cpu", "OCRQ_DTYPE": "float32",
        "OCRQ_MAX_NEW_TOKENS": "16", "COLUMNS": "160", "OCRQ_SCHEDULER": "continuous",
    }
    # One round (the first pass): what is asserted is the loop's sweep, lengths and anatomy,
    # not the rounds (checked in test_each_setting_runs_in_interleaved_rounds_...).
    proc = run_tune(env, "--engine", "hunyuan", "--images", str(folder), "--max-batch", "2",
                    "--budget-fraction", "0.5", "--max-seconds", "90", "--rounds", "1",
                    timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [path] = sorted(profiles.glob("hunyuan-*.json"))
    body = json.loads(path.read_text())
    assert body["sample"]["lengths"] == "random weights: the bench's drawn lengths"
    tokens = body["sample"]["output_tokens"]
    assert len(tokens) == 4 and all(1 <= n <= 16 for n in tokens)
    assert "output lengths (random weights" in proc.stderr
    # With the running loop (OCRQ_SCHEDULER=continuous) the knob is its slots, run through it.
    assert body["sweep_rate"].startswith("whole run of the timed rows")
    ran = [p for p in body["sweep"] if p["status"] == "ok"]
    assert len(ran) >= 2 and all(p["images"] >= max(4, 2 * p["setting"]) for p in ran)
    assert "the engine runs the running loop" in proc.stderr
    terms = {t["term"]: t for t in body["anatomy"]}
    assert terms["KV cache"]["bytes"] > 0 and "KiB per token" in terms["KV cache"]["how"]
    assert terms["prefill pass reserve"]["bytes"] > 0
    # The loop's peaks hold its pool: the activations come from its prefill passes.
    for name in ("per-batch workspace", "activations (prefill)"):
        assert terms[name]["bytes"] is not None and "open running loop" in terms[name]["how"]
    assert body["fit"] is None and "cost model kept" in proc.stdout
    knee = body["recommended"]["max_batch"]
    assert body["running_loop"]["slots"] == knee
    assert f"for vllm serve: --max-num-seqs {knee} --gpu-memory-utilization 0.50" in proc.stdout
    assert f"OCRQ_MAX_BATCH={knee}" in proc.stdout


def _trained_tiny_engine(tmp_path: Path, max_new_tokens: int) -> Any:
    """A tiny checkpoint without the random mark, loaded: taken for trained (a first pass)."""
    from ocrq.models.hunyuan import HunyuanEngine
    from ocrq.models.hunyuan.checkpoint import RANDOM_MARK
    from tests.tiny_hunyuan import cpu_settings, tiny_checkpoint

    folder = tiny_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config[RANDOM_MARK]
    (folder / "config.json").write_text(json.dumps(config))
    engine = HunyuanEngine(cpu_settings(str(folder), max_new_tokens=max_new_tokens))
    engine.load()
    return engine


@pytest.mark.hunyuan
def test_first_pass_counts_the_tokens_each_image_produces(tmp_path: Path) -> None:
    """A checkpoint without the random mark is taken for trained: a first pass over the sample,
    capped at OCRQ_MAX_NEW_TOKENS, counts each image's tokens (these weights never end a row,
    so every row reaches the cap and says so), and the rows then end there."""
    from ocrq.tuning.lengths import output_lengths
    from tests.tiny_hunyuan import item

    engine = _trained_tiny_engine(tmp_path, max_new_tokens=6)
    rows = [item(64, 48, 0), item(96, 64, 1), item(48, 80, 2)]
    for row in rows:
        engine.prepare(row)
    lengths = output_lengths(engine, rows)
    assert lengths.source == "first pass, capped at 6"
    assert lengths.tokens == (6, 6, 6)
    assert [row.max_new_tokens for row in rows] == [6, 6, 6]


@pytest.mark.hunyuan
def test_first_pass_stops_at_the_deadline_and_gives_the_rest_the_median(tmp_path: Path) -> None:
    """--max-seconds bounds the first pass too: past the deadline it stops after its first call
    (FIRST_PASS_ROWS images), and the images it did not reach take the median of the others."""
    import time

    from ocrq.tuning.lengths import FIRST_PASS_ROWS, output_lengths
    from tests.tiny_hunyuan import item

    engine = _trained_tiny_engine(tmp_path, max_new_tokens=5)
    rows = [item(48 + 8 * i, 48, i) for i in range(FIRST_PASS_ROWS + 2)]
    for row in rows:
        engine.prepare(row)
    calls: list[int] = []
    real_run = engine.run

    def counted(batch):  # type: ignore[no-untyped-def]
        calls.append(len(batch))
        return real_run(batch)

    engine.run = counted  # type: ignore[method-assign]
    lengths = output_lengths(engine, rows, deadline=time.monotonic())
    assert calls == [FIRST_PASS_ROWS]
    assert f"after {FIRST_PASS_ROWS} of {len(rows)} images" in lengths.source
    assert lengths.tokens == (5,) * len(rows)
    calls.clear()
    assert output_lengths(engine, rows).tokens == (5,) * len(rows)  # no deadline: every image
    assert calls == [FIRST_PASS_ROWS, 2]


def test_tune_tables_fit_the_terminal_they_are_shown_on(tmp_path: Path) -> None:
    """`ocrq tune` printed its tables 160 columns wide whatever the terminal: on an 80-column
    one every row wrapped. On a terminal the tables take its width (piped: 160, one line a row,
    as the other tune tests read them)."""
    from tests.terminal import ANSI, on_terminal

    env = {**os.environ, "OCRQ_PROFILE_DIR": str(tmp_path)}
    code, shown, errors = on_terminal(
        env, "tune", "--engine", "rapid", "--budget", "2", "--max-seconds", "20", columns=80
    )
    lines = [line.rstrip("\r") for line in ANSI.sub("", shown).splitlines()]
    assert code == 0, errors[-2000:]
    assert any("peak GiB" in line for line in lines), shown  # the table is there
    rows = [line for line in lines if line[:1] in "┏┃┡│└"]  # the table's lines, its frame
    assert len(rows) >= 5 and max(len(line) for line in rows) <= 80, "\n".join(lines)
    # Too little time for any probe: one line saying what to change, not a traceback.
    short = run_tune(env, "--engine", "rapid", "--budget", "2", "--max-seconds", "0.01")
    assert short.returncode == 2 and "Traceback" not in short.stderr, short.stderr[-2000:]
    assert "give more --max-seconds" in " ".join(short.stderr.split()), short.stderr


def test_tune_keeps_kernel_compilers_warnings_off_the_terminal() -> None:
    """FlashAttention-4's CuTe DSL compiler warned once per kernel shape, on the user's
    terminal mid-tune. Its modules' (and Triton's) warnings are dropped at the default log
    level; ocrq's own, and any other library's, still show."""
    import warnings

    from ocrq.cli import quiet_compilers

    def warn_from(module: str, message: str) -> None:
        code = compile(f"import warnings\nwarnings.warn({message!r}, UserWarning)", module, "exec")
        exec(code, {"__name__": module})

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_compilers()
        warn_from("cutlass.base_dsl.jit_executor", "compiling a kernel")
        warn_from("flash_attn.cute.interface", "a JIT note")
        warn_from("triton.runtime.jit", "autotuning")
        warn_from("ocrq.tuning.sweep", "ours")
        warn_from("cutlassy", "not a compiler")
    assert [str(w.message) for w in seen] == ["ours", "not a compiler"]


def test_each_setting_runs_in_interleaved_rounds_and_its_rate_is_their_median() -> None:
    """On a loaded host one run per setting moved the knee. Each setting that ran runs again in
    later rounds that take the settings in turn (so a slow spell falls on every setting, not
    one), while the deadline allows; its rate is the median round, and the spread is shown."""
    from ocrq.models.rapid import RapidEngine
    from ocrq.tuning.images import sweep_table
    from ocrq.tuning.probing import draw_page
    from ocrq.tuning.sweep import ROUNDS

    engine = RapidEngine()
    engine.load()
    rows = [PreparedImage(f"r{i}", draw_page(240, 60, [f"TOTAL {i}.50"], 20), (240, 60))
            for i in range(2)]
    for row in rows:
        engine.prepare(row)
    order: list[int] = []
    sweep = run_sweep(engine, rows, 4 * GiB, max_batch=2, deadline=time.monotonic() + 300,
                      warm_each=False, on_batch=lambda setting, n: order.append(setting))
    assert [(p.setting, p.status, len(p.rates)) for p in sweep.points] == [
        (1, "ok", ROUNDS), (2, "ok", ROUNDS)
    ]
    # warm calls, then 1, 1, 2 (first pass), then the rounds in turn: 1, 1, 2, 1, 1, 2
    assert order[-6:] == [1, 1, 2, 1, 1, 2], order
    for p in sweep.points:
        assert p.images_per_s == pytest.approx(sorted(p.rates)[1])  # the median of three
        assert p.spread().endswith(f"({ROUNDS} runs)")
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(sweep_table(sweep, None, "rounds"))
    assert "(3 runs)" in console.export_text()

    # No time for a second round: one run each, and the table says so.
    calls = iter(range(1000))
    short = run_sweep(engine, rows, 4 * GiB, max_batch=2, deadline=100.0, warm_each=False,
                      clock=lambda: 0.0 if next(calls) < 8 else 1e9)
    assert [len(p.rates) for p in short.points if p.ran] and all(
        p.spread() == "1 run" for p in short.points if p.ran
    )
    # Fewer rounds asked for (`ocrq tune --rounds`): that many runs each, time left or not.
    two = run_sweep(engine, rows, 4 * GiB, max_batch=2, deadline=time.monotonic() + 300,
                    warm_each=False, rounds=2)
    assert [(p.setting, len(p.rates)) for p in two.points] == [(1, 2), (2, 2)]
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        run_sweep(engine, rows, 4 * GiB, max_batch=2, deadline=100.0, rounds=0)


@pytest.mark.hunyuan
def test_the_loops_prefill_passes_give_the_anatomy_its_activations(tmp_path: Path) -> None:
    """With the running loop the sweep's peaks hold the pool, so the anatomy's per-batch
    workspace and activations come from prefill passes of 1, 2 and 4 rows through the open loop
    (issue 52: they were n/a): numbers, and a `how` that says so."""
    from ocrq.models.base import streaming
    from ocrq.models.hunyuan import HunyuanLoopEngine
    from ocrq.models.memory import memory_of
    from ocrq.tuning.anatomy import anatomy
    from ocrq.tuning.loop_sweep import PREFILL_HOW, PREFILL_ROWS, LoopSetting
    from tests.tiny_hunyuan import cpu_settings, item, tiny_checkpoint

    path = tiny_checkpoint(tmp_path, "1.0")
    engine = HunyuanLoopEngine(cpu_settings(str(path), 8, scheduler="continuous"), decode="fast")
    engine.load()
    try:
        assert streaming(engine) is engine
        rows = [item(64 + 32 * i, 64, 60 + i) for i in range(3)]
        for row in rows:
            engine.prepare(row)
        loop = LoopSetting(engine, engine.cost_model(), 8 * GiB)
        above, samples = loop.prefill_peaks(rows, time.monotonic() + 60)
        assert [len(s.costs) for s in samples] == list(PREFILL_ROWS)
        assert above >= reading_floor(engine) and all(s.peak_bytes >= above for s in samples)
        assert engine.settings.max_batch is None  # the slots it opened with are put back
        terms = {t.name: t for t in anatomy(
            before_load=0, after_load=above // 2, baseline=above // 2, samples=samples,
            input_bytes_per_image=1.0, kv_bytes_per_token=0.0, tokens_per_image=None,
            prefill_reserve=1, where="host RSS", batches_how=PREFILL_HOW, batches_above=above)}
        for name in ("per-batch workspace", "activations (prefill)"):
            assert terms[name].bytes is not None and terms[name].bytes >= 0
            assert "open running loop" in terms[name].how
        assert memory_of(engine).peak_memory_bytes() > 0
    finally:
        engine.close()


def reading_floor(engine: Any) -> int:
    """Host RSS now: the open loop's memory can be no less than the process's footprint
    before the passes ran, less what gc frees (~a few MiB); a rough floor of a quarter."""
    from ocrq.core import procfs

    return procfs.rss_bytes() // 4
