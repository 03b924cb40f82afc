"""The whole service with the running loop: `ocrq worker` (hunyuan engine, tiny 1.5 on the CPU,
OCRQ_SCHEDULER=continuous) <- Redis <- jobs, results in PostgreSQL.

Short jobs (their own `max_new_tokens` of 2) sent together with long ones (the worker's cap of
48, eos banned by nothing: a random model rarely ends early) must be stored, each as soon as its
row ends, while the long rows still decode: with static batches every row of a batch is
resolved when its longest row ends.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from tests.conftest import WorkerProcess
from tests.servers import free_port
from tests.test_service import _wait_rows
from tests.tiny_hunyuan import loop_worker_env, tiny_hf_cache

pytestmark = pytest.mark.hunyuan

LONG = 400  # long enough on an idle CPU to tell apart from 2 tokens (~6 ms a step)


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_cache(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module", params=["off", "on"], ids=["in-worker", "engine-process"])
def running_worker(
    request: pytest.FixtureRequest,
    service_env: dict[str, str],
    tiny_cache: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[WorkerProcess, str]]:
    """The loop in the worker process, and in an engine process of its own (ocrq/
    engine_process/link.py): the same rows, results and metrics either way."""
    queue = f"ocr-running-{uuid.uuid4().hex[:6]}"
    env = loop_worker_env(
        service_env, tiny_cache, queue, max_new_tokens=LONG, max_batch=8,
        budget_gib=3.4, engine_process=request.param,
        profile_dir=tmp_path_factory.mktemp("profiles"), metrics_port=free_port(),
    )
    env.update(OCRQ_BATCH_WAIT_MS="500")
    log = tmp_path_factory.mktemp("worker") / "ocrq.worker.log"
    proc = WorkerProcess(env, log, "--concurrency", "8").wait_ready(timeout=240)
    yield proc, queue
    proc.stop()


def test_short_rows_are_stored_while_long_rows_decode(
    running_worker: tuple[WorkerProcess, str],
    broker_url: str,
    database_url: str,
    text_images: dict[str, Path],
) -> None:
    proc, queue = running_worker
    assert proc.alive()
    app = Celery(broker=broker_url)
    paths = list(text_images.values())
    jobs: dict[str, int | None] = {}
    for i in range(6):
        short = i % 2 == 1
        job_id = str(uuid.uuid4())
        kwargs = {"image": {"path": str(paths[i % len(paths)])}, "job_id": job_id}
        if short:
            kwargs["max_new_tokens"] = 2
        app.send_task("ocrq.recognize", kwargs=kwargs, queue=queue, task_id=job_id)
        jobs[job_id] = 2 if short else None
    rows = _wait_rows(database_url, list(jobs), timeout=300)
    assert all(r["status"] == "done" for r in rows.values()), rows
    short = [rows[j] for j, cap in jobs.items() if cap == 2]
    long = [rows[j] for j, cap in jobs.items() if cap is None]
    assert all(r["truncated"] == "max_tokens" for r in short)
    ran_long = [r for r in long if r["truncated"] == "max_tokens"]
    assert ran_long, "every long row ended early: nothing to compare"
    last_short = max(r["finished_at"] for r in short)
    first_long = min(r["finished_at"] for r in ran_long)
    # 2 tokens take a step or two, LONG take LONG: every short row is stored before any long row
    # of the same hand-over ends (a static batch would store them all together, last).
    assert last_short < first_long, (last_short, first_long)
    # Each short row was resolved on its own, not with the batch of the long rows.
    assert not {r["batch_id"] for r in short} & {r["batch_id"] for r in ran_long}

    # The loop's own account reaches the worker's metrics: steps, rows and (here, host) seconds;
    # a row's time splits into waiting for the loop and decoding in it.
    import httpx

    port = int(proc.env["OCRQ_METRICS_PORT"])
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = {
        line.split(" ")[0]: float(line.split(" ")[-1])
        for line in text.splitlines()
        if line.startswith(("ocrq_loop_", "ocrq_stage_seconds_sum")) and " " in line
    }
    assert values["ocrq_loop_steps_total"] >= LONG
    assert values["ocrq_loop_prefilled_rows_total"] >= len(jobs)
    assert values["ocrq_loop_decode_seconds_total"] > 0
    assert 0 < values["ocrq_loop_row_steps_total"] <= values["ocrq_loop_slot_steps_total"]
    assert values['ocrq_stage_seconds_sum{stage="gpu"}'] > 0
    # The loop thread's own account: it launched prefills and steps and read rows. On the CPU
    # the copies are read at once, so it never waits for them.
    assert values["ocrq_loop_prefill_host_seconds_total"] > 0
    assert values["ocrq_loop_decode_host_seconds_total"] > 0
    assert values["ocrq_loop_harvest_host_seconds_total"] > 0
    assert values["ocrq_loop_wait_seconds_total"] == 0
