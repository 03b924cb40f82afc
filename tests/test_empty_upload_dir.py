"""An empty `OCRQ_UPLOAD_DIR=` adds no allowed root (issue 52): a real `ocrq worker` under
`prlimit --as`, real Redis and PostgreSQL.

Before, pydantic read the empty value as Path(""), the worker's working directory, which
`Settings.roots()` then allowed: a path job read a file outside OCRQ_ALLOWED_ROOTS, and a
worker with no roots at all started instead of refusing. Empty now means unset, as the docs
say.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

from ocrq.api.client import Client
from ocrq.core.db import get_engine
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from tests.conftest import BIN, WorkerProcess
from tests.waiting import Budget

CAP = 3 * 2**30  # the worker's address space


class WorkerIn(WorkerProcess):
    """`ocrq worker` under `prlimit --as`, started in `cwd` (where Path("") points)."""

    def __init__(self, env: dict[str, str], log: Path, cwd: Path, *args: str) -> None:
        self.log = log
        self.env = env
        self._fh = log.open("w")
        self.proc = subprocess.Popen(
            ["prlimit", f"--as={CAP}", "--", str(BIN / "ocrq"), "worker", *args],
            env=env, cwd=cwd, stdout=self._fh, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _env(service_env: dict[str, str], roots: bool) -> dict[str, str]:
    env = {k: v for k, v in service_env.items() if k != "OCRQ_ALLOWED_ROOTS" or roots}
    return {**env, "OCRQ_UPLOAD_DIR": "", "OCRQ_QUEUE": f"ocr-empty-{uuid.uuid4().hex[:6]}"}


def test_a_worker_with_no_roots_but_an_empty_upload_dir_refuses_to_start(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    worker = WorkerIn(_env(service_env, roots=False), tmp_path / "worker.log", tmp_path)
    try:
        code = worker.proc.wait(60)
    finally:
        worker.stop()
    assert code == 78, worker.text()[-2000:]
    assert "OCRQ_ALLOWED_ROOTS is not set" in worker.text()


def test_a_path_job_in_the_working_directory_is_refused_with_an_empty_upload_dir(
    service_env: dict[str, str], text_images: dict[str, Path], tmp_path: Path
) -> None:
    cwd = tmp_path / "workdir"  # outside every allowed root
    cwd.mkdir()
    secret = cwd / "secret.png"
    shutil.copy(text_images["hello"], secret)
    env = _env(service_env, roots=True)
    worker = WorkerIn(env, tmp_path / "worker.log", cwd, "--concurrency", "2")
    try:
        worker.wait_ready()
        client = Client(
            Settings(
                broker_url=env["OCRQ_BROKER_URL"],
                database_url=env["OCRQ_DATABASE_URL"],
                queue=env["OCRQ_QUEUE"],
            )
        )
        outside = client.submit({"path": str(secret)})
        inside = client.submit({"path": str(text_images["hello"])})
        store = JobStore(get_engine(env["OCRQ_DATABASE_URL"]))

        def final() -> dict[str, dict[str, object]] | None:
            rows = store.get([outside, inside])
            done = len(rows) == 2 and all(
                r["status"] in ("done", "failed") for r in rows.values()
            )
            return rows if done else None

        rows = Budget(90, "empty upload dir").until(
            "both jobs final", final, 90, lambda: worker.text()[-2000:]
        )
    finally:
        worker.stop()
    assert rows[inside]["status"] == "done", rows[inside]
    assert rows[outside]["status"] == "failed", rows[outside]
    assert "outside allowed roots" in str(rows[outside]["error"])
    assert "HELLO" not in str(rows[outside]["text"] or "").upper()
