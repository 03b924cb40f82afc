"""`ocrq run` on the CPU engine reports results as they come, not all at once at the end.

Issue 52: a static batch of 19 receipts showed no progress for 125 s, then everything at once:
the CPU engine took up to 32 images per batch and a batch's results reach the store only when
the whole batch ends. Small batches are as fast on the CPU (bench/results/rapid_batch_size/), so
its preferred batch is small, and the first results are stored while later images still wait.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from ocrq.core.settings import Settings
from ocrq.models.base import OcrResult, PreparedImage
from ocrq.models.rapid import RapidEngine
from ocrq.tuning.probing import draw_page
from ocrq.worker.embedded import run_paths

IMAGES = 12


def test_run_stores_the_first_results_before_the_last_image_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    files = []
    for i in range(IMAGES):
        path = folder / f"r{i:02d}.png"
        draw_page(240, 60, [f"TOTAL {i}.50"], 20).save(path)
        files.append(path)
    read = [0]  # images the engine has OCR'd so far
    lock = threading.Lock()
    real_run = RapidEngine.run

    def counting_run(
        self: RapidEngine, batch: Sequence[PreparedImage]
    ) -> list[OcrResult | Exception]:
        out = real_run(self, batch)
        with lock:
            read[0] += len(batch)
        return out

    monkeypatch.setattr(RapidEngine, "run", counting_run)
    at_progress: list[int] = []

    def progress(finished: int, more: int) -> None:
        if finished:
            with lock:
                at_progress.append(read[0])

    settings = Settings(engine="rapid", profile_dir=tmp_path / "profiles", max_batch=None)
    counts = run_paths(files, settings, f"sqlite:///{tmp_path / 'run.sqlite'}", lambda _: None,
                       on_progress=progress)
    assert counts["done"] == IMAGES
    assert len(at_progress) == IMAGES
    # Results were stored (and counted) in steps while images were still to be read: with
    # batches of up to 32 the first image ran alone, then the other 11 in one batch, and 11
    # results came at once after the last image was read ([1, 12, 12, ...]).
    early = [n for n in at_progress if n < IMAGES]
    assert len(early) >= IMAGES // 2, at_progress
