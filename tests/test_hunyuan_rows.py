"""A cut result reaches its job row, the api's JSON and `ocrq status`; a job's `max_pixels`
reaches the engine.

The real job path on the real PostgreSQL (migrated by `ocrq migrate`, so through
migrations/versions/0003): JobRunner -> Batcher -> the tiny HunyuanOCR 1.5 on the CPU, whose
rows are forced to loop (ocrq/testing/tiny_hunyuan.py, `ForcedLoop`) under a guard small enough
for a CPU test. Only the forcing is test-only (a subclass); the guard, the trimming, the store and
the views are production code.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ocrq.core.contract import JobRequest
from ocrq.core.db import get_engine
from ocrq.core.store import JobStore, public_view
from ocrq.models.base import OcrResult
from ocrq.models.hunyuan import HunyuanEngine
from ocrq.models.hunyuan.versions import RepetitionGuard
from tests.tiny_hunyuan import cpu_settings, noise, tiny_checkpoint

pytestmark = pytest.mark.hunyuan

BIN = Path(__file__).resolve().parents[1] / ".venv" / "bin"
SMALL = RepetitionGuard(every=8, min_repeats=4, max_unit=8, min_span=16)


class LoopingEngine(HunyuanEngine):
    """Rows of the task "text" loop on "abc" from their 6th token; others are left alone. It
    also records the size of every image it was given."""

    seen: list[tuple[int, int]]

    def run(self, batch: Any) -> list[OcrResult | Exception]:
        from ocrq.testing.tiny_hunyuan import ForcedLoop

        self.seen.extend(it.image.size for it in batch)
        vocab = self.processor.tokenizer.get_vocab()
        cycle = [vocab["a"], vocab["b"], vocab["c"]]
        cycles = [cycle if it.task == "text" else [] for it in batch]
        with ForcedLoop(self.model, cycles, start=5):
            return super().run(batch)


@dataclasses.dataclass
class Setup:
    runner: Any  # worker.jobs.JobRunner
    engine: LoopingEngine
    root: Path  # the allowed image folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Setup]:
    from ocrq.scheduling.batcher import StaticBatcher as Batcher
    from ocrq.scheduling.vocabulary import BatchConfig
    from ocrq.worker.jobs import JobRunner

    root = tmp_path_factory.mktemp("images")
    path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "1.5")
    settings = cpu_settings(str(path), 48, allowed_roots=[root])
    engine = LoopingEngine(settings, decode="fast")
    engine.load()
    engine.seen = []
    engine.version = dataclasses.replace(engine.version, guard=SMALL)
    batcher = Batcher(engine, BatchConfig(max_items=4, wait_s=0.01)).start()
    store = JobStore(get_engine(database_url))
    yield Setup(JobRunner(settings, engine, batcher, store, "test-rows"), engine, root)
    batcher.stop()


def submit(setup: Setup, task: str, size: tuple[int, int], **extra: Any) -> str:
    job_id = str(uuid.uuid4())
    path = setup.root / f"{job_id}.png"
    noise(*size, seed=size[0]).save(path)
    request = JobRequest(image={"path": str(path)}, task=task, job_id=job_id, **extra)
    setup.runner.process(request)
    return job_id


def test_a_stopped_loop_is_stored_shown_and_served(setup: Setup, database_url: str) -> None:
    looping = submit(setup, "text", (100, 80))
    normal = submit(setup, "table", (100, 80))
    rows = setup.runner.store.get([looping, normal])
    assert rows[looping]["status"] == "done" and rows[looping]["truncated"] == "repetition"
    assert rows[looping]["text"].endswith("abc") and "abcabc" not in rows[looping]["text"]
    assert rows[normal]["status"] == "done" and rows[normal]["truncated"] == "max_tokens"
    view = public_view(rows[looping])
    assert view["truncated"] == "repetition" and view["text"] == rows[looping]["text"]

    env = {**os.environ, "OCRQ_DATABASE_URL": database_url, "COLUMNS": "200"}
    shown = subprocess.run(
        [str(BIN / "ocrq"), "status", looping, normal],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "done (truncated: repetition)" in shown.stdout
    assert "done (truncated: max_tokens)" in shown.stdout


def test_a_jobs_max_pixels_reaches_the_engine(setup: Setup) -> None:
    """The tiny 1.5 sees up to 192² pixels; a job asking for 64² gets its image shrunk to that
    before it waits for a batch, and its row still gives the image's own size."""
    setup.engine.seen.clear()
    job = submit(setup, "table", (190, 190), max_pixels=64 * 64)
    row = setup.runner.store.get([job])[job]
    assert row["status"] == "done" and row["width"] == 190
    assert setup.engine.seen == [(64, 64)]
    setup.engine.seen.clear()
    submit(setup, "table", (190, 190))  # no cap of its own: the model's limit
    assert setup.engine.seen == [(190, 190)]
    with pytest.raises(ValueError, match="max_pixels"):
        JobRequest(image={"path": "/x.png"}, max_pixels=5)
    with pytest.raises(ValueError, match="max_pixels"):
        JobRequest(image={"path": "/x.png"}, max_pixels=4097 * 4096)
    # A producer that never heard of max_pixels still sends valid jobs.
    assert JobRequest.model_validate({"image": {"path": "/x.png"}}).max_pixels is None


def test_the_migrated_column_accepts_what_the_engine_gives(database_url: str) -> None:
    store = JobStore(get_engine(database_url))
    job = str(uuid.uuid4())
    store.claim(job, "text", "/x.png", "w")
    assert store.finish(job, status="done", text="x", lines=[], truncated=None)
    assert store.get([job])[job]["truncated"] is None
    assert public_view(store.get([job])[job])["truncated"] is None
