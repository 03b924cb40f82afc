"""A job cancelled while its row decodes in the running loop (issue 30): `ocrq worker` with the
hunyuan engine (tiny 1.5 on the CPU, OCRQ_SCHEDULER=continuous) <- Redis <- jobs, rows in
PostgreSQL.

The row's cap is far beyond what it decodes before the cancel (a random model rarely ends
early), so only the drop can end it: the worker learns the cancel from the job table
(ocrq/worker/cancels.py), the batcher drops the row at the loop's next harvest, the task ends
with the row still `cancelled`, and the loop goes on serving the next job. In the worker
process and in an engine process of its own (the drop crosses the pipe there).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ocrq.api.client import Client
from ocrq.core.contract import JobRequest
from ocrq.core.settings import Settings
from tests.conftest import WorkerProcess
from tests.servers import free_port
from tests.tiny_hunyuan import loop_worker_env, tiny_hf_cache
from tests.waiting import Budget

pytestmark = pytest.mark.hunyuan

CAP = 20_000  # tokens: minutes of decoding on a CPU, never reached in this test


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_cache(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module", params=["off", "on"], ids=["in-worker", "engine-process"])
def looping_worker(
    request: pytest.FixtureRequest,
    service_env: dict[str, str],
    tiny_cache: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[WorkerProcess, str]]:
    queue = f"ocr-cancel-loop-{uuid.uuid4().hex[:6]}"
    env = loop_worker_env(
        service_env, tiny_cache, queue, max_new_tokens=CAP, max_batch=4,
        budget_gib=12, engine_process=request.param,
        profile_dir=tmp_path_factory.mktemp("profiles"), metrics_port=free_port(),
    )
    log = tmp_path_factory.mktemp("worker") / "ocrq.worker.log"
    proc = WorkerProcess(env, log, "--concurrency", "4").wait_ready(timeout=240)
    yield proc, queue
    proc.stop()


def _metrics(proc: WorkerProcess, prefix: str = "ocrq_loop_") -> dict[str, float]:
    port = int(proc.env["OCRQ_METRICS_PORT"])
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        line.split(" ")[0]: float(line.split(" ")[-1])
        for line in text.splitlines()
        if line.startswith(prefix) and " " in line
    }


def test_a_row_decoding_in_the_loop_is_dropped_when_cancelled(
    looping_worker: tuple[WorkerProcess, str],
    broker_url: str,
    database_url: str,
    text_images: dict[str, Path],
) -> None:
    proc, queue = looping_worker
    budget = Budget(300, "cancel a row in the running loop")
    client = Client(Settings(broker_url=broker_url, database_url=database_url, queue=queue))
    request = JobRequest.model_validate({"image": {"path": str(text_images["hello"])}})
    (long,) = client.submit_many([request])
    job = long.job_id

    def decoding() -> bool:
        """Claimed, and rows in the engine (the loop's own counters move only when a row ends:
        this gauge is set when rows reach an idle engine)."""
        row = client.store.get([job]).get(job) or {}
        busy = _metrics(proc, "ocrq_batch_running_since").get(
            "ocrq_batch_running_since_timestamp_seconds", 0
        )
        return row.get("status") == "running" and busy > 0

    budget.until("the row to decode in the loop", decoding, 150, proc.text)
    (row,) = client.cancel([job])
    assert row["cancelled"] is True and row["status"] == "cancelled", (row, proc.text()[-4000:])
    budget.until(
        "the worker to drop the row from the loop and its task to end",
        lambda: "dropped 1 cancelled row(s) from the running loop" in proc.text()
        and f"job {job} is cancelled already" in proc.text(),
        60,
        proc.text,
    )
    # The row still says cancelled, with no text stored over it.
    stored = client.store.get([job])[job]
    assert stored["status"] == "cancelled" and stored["text"] is None
    assert stored["error"] == "cancelled by request"

    # The loop serves on: a short job (its own cap of 2 tokens) after the drop is stored.
    after = str(uuid.uuid4())
    kwargs = {"image": {"path": str(text_images["word"])}, "job_id": after, "max_new_tokens": 2}
    client.app.send_task("ocrq.recognize", kwargs=kwargs, queue=queue, task_id=after)
    budget.until(
        "the job after the drop to be done",
        lambda: (client.store.get([after]).get(after) or {}).get("status") == "done",
        120,
        proc.text,
    )
    assert client.store.get([job])[job]["status"] == "cancelled"
    # Dropped long before its cap: the loop (its counters read once a row ended) stepped a
    # fraction of CAP in all.
    assert _metrics(proc)["ocrq_loop_steps_total"] < CAP / 2
