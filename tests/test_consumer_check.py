"""A wait whose jobs no worker consumes says so (ocrq/api/consumers.py): the first-hour case of
a worker started with another OCRQ_QUEUE than the producer's, or of no worker at all.

A real `ocrq worker` on one queue, a real `ocrq submit --wait` to another; the worker answers
Celery's `active_queues` broadcast over the session's Redis.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

from ocrq.api.consumers import ASK_AFTER_S, missing_consumer
from ocrq.cli import EXIT_PENDING
from ocrq.core.samples import draw_text_image
from tests.conftest import BIN, WorkerProcess


def test_submit_wait_names_the_queue_no_worker_consumes(
    service_env: dict[str, str], image_root: Path, tmp_path: Path
) -> None:
    theirs, ours = (f"cc-{uuid.uuid4().hex[:6]}" for _ in range(2))
    image = image_root / "consumer-check" / "word.png"
    image.parent.mkdir(parents=True, exist_ok=True)
    draw_text_image(["HELLO"]).save(image)
    batch = f"cc-batch-{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess({**service_env, "OCRQ_QUEUE": theirs}, tmp_path / "w.log")

    def ocrq(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "ocrq"), *args, "--timeout", str(ASK_AFTER_S + 6)],
            env={**service_env, "OCRQ_QUEUE": ours},
            capture_output=True,
            text=True,
            timeout=ASK_AFTER_S + 60,
            check=False,
        )

    try:
        worker.wait_ready(90)
        submitted = ocrq("submit", str(image), "--wait", "--batch", batch)
        waited = ocrq("wait", batch)  # resuming the wait: the same advice
    finally:
        worker.stop()
    for done, queues in ((submitted, f"queue '{ours}'"),
                         (waited, f"queue '{ours}' or '{ours}.interactive'")):
        assert done.returncode == EXIT_PENDING, done.stderr
        warning = " ".join(ln for ln in done.stderr.splitlines() if "no worker consumes" in ln)
        assert queues in warning and theirs in warning and "OCRQ_QUEUE" in warning, done.stderr
    assert "queued" in submitted.stdout  # the job waits; nothing was lost or failed


def test_the_warning_branches() -> None:
    consumers = {"w1@h": ["celery", "ocr", "ocr.interactive"]}
    assert missing_consumer(consumers, ["ocr"], "redis://h") is None
    assert missing_consumer(consumers, ["other", "ocr.interactive"], "redis://h") is None
    alone = missing_consumer({}, ["ocr", "ocr.interactive"], "redis://h:6379/0")
    assert alone is not None
    assert "no worker answered on redis://h:6379/0" in alone and "'ocr' or 'ocr.interactive'" in (
        alone
    )
    elsewhere = missing_consumer(consumers, ["mine"], "redis://h")
    assert elsewhere is not None and "w1@h: celery, ocr, ocr.interactive" in elsewhere
