"""Task threads follow the batch cap: a worker keeps two batches' worth of images in flight
without a hand-set --concurrency (issue 13)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from ocrq.core.settings import Settings
from ocrq.worker.runtime import FETCH_HEADROOM, task_threads
from tests.conftest import BIN, WorkerProcess


def test_threads_are_two_batches_plus_headroom_unless_set() -> None:
    assert task_threads(Settings(), 64) == 64 + FETCH_HEADROOM
    assert task_threads(Settings(concurrency=5), 64) == 5


def _pool_size(env: dict[str, str], node: str) -> int:
    out = subprocess.run(
        [str(BIN / "celery"), "--broker", env["OCRQ_BROKER_URL"], "inspect", "stats", "--json",
         "-d", node, "--timeout", "10"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    stats = json.loads(out)
    return int(stats[node]["pool"]["max-concurrency"])


def test_worker_without_concurrency_sizes_its_pool_from_the_batch_cap(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**service_env, "OCRQ_MAX_BATCH": "5"}  # two batches = 10 decoded images
    node = "threads-auto@test"
    worker = WorkerProcess(env, tmp_path / "w.log", "--hostname", node, "--no-supervise")
    try:
        worker.wait_ready()
        said = re.search(r"concurrency: (\d+) \(thread\)", worker.text())  # Celery's banner
        assert said is not None, worker.text()
        assert int(said.group(1)) == 2 * 5 + FETCH_HEADROOM
        assert _pool_size(env, node) == 2 * 5 + FETCH_HEADROOM
    finally:
        worker.stop()


def test_hand_set_concurrency_wins(service_env: dict[str, str], tmp_path: Path) -> None:
    node = "threads-set@test"
    worker = WorkerProcess(
        service_env, tmp_path / "w.log", "--hostname", node, "--concurrency", "3", "--no-supervise"
    )
    try:
        worker.wait_ready()
        assert "concurrency: 3 (thread)" in worker.text()
        assert _pool_size(service_env, node) == 3
    finally:
        worker.stop()
