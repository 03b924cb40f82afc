"""The `openai` engine end to end: CPU-only `ocrq worker`s (the test venv, no vLLM in it) sending
each image to a real vLLM OpenAI-compatible server (.venv-vllm) of the tiny HunyuanOCR-1.5,
with real Redis and PostgreSQL.

One server serves the module (it takes 30-100 s to start here). Outputs equal transformers'
generate() per image; a request the server refuses (HTTP 400) fails its job alone; the server
killed mid-run and started again loses no job and stores none twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ocrq.api.client import Client
from ocrq.core.db import get_engine
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from tests.conftest import FIGURES, WorkerProcess
from tests.servers import free_port
from tests.vllm_support import (
    IMAGES,
    VllmServer,
    build_tiny,
    reference_texts,
    wait_for,
    write_images,
)

pytestmark = pytest.mark.hunyuan
MAX_MODEL_LEN = 400  # a 450-character free prompt cannot fit: the server answers 400


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("openai-ckpt"))


@pytest.fixture(scope="module")
def images(image_root: Path) -> dict[str, Path]:
    return write_images(image_root)


@pytest.fixture(scope="module")
def references(ckpt: Path, images: dict[str, Path]) -> dict[str, str]:
    refs = reference_texts(ckpt, images)
    assert len(set(refs.values())) == len(refs), refs  # distinct: swaps would show
    return refs


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    srv = VllmServer(ckpt, free_port(), log, MAX_MODEL_LEN)
    srv.start()
    yield srv
    srv.stop()


def _env(service_env: dict[str, str], server: VllmServer, **extra: str) -> dict[str, str]:
    return {
        **service_env,
        "OCRQ_ENGINE": "openai",
        "OCRQ_OPENAI_URL": server.url,
        "OCRQ_OPENAI_API_KEY": server.API_KEY,
        "OCRQ_OPENAI_VERSION": "1.5",
        "OCRQ_MODEL": server.MODEL_NAME,
        "OCRQ_MAX_NEW_TOKENS": "24",
        "OCRQ_QUEUE": f"ocr-openai-{uuid.uuid4().hex[:6]}",
        **extra,
    }


@pytest.fixture(scope="module")
def env(service_env: dict[str, str], server: VllmServer) -> dict[str, str]:
    return _env(service_env, server, OCRQ_BATCH_WAIT_MS="300")


@pytest.fixture(scope="module")
def worker(
    env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("openai-worker") / "worker.log"
    proc = WorkerProcess(env, log, "--concurrency", "8").wait_ready(120)
    wait_for(lambda: "openai engine: HunyuanOCR-1.5" in proc.text(), 120, "the engine")
    yield proc
    proc.stop()


def _client(env: dict[str, str]) -> Client:
    return Client(
        Settings(
            broker_url=env["OCRQ_BROKER_URL"],
            database_url=env["OCRQ_DATABASE_URL"],
            queue=env["OCRQ_QUEUE"],
        )
    )


def _store(env: dict[str, str]) -> JobStore:
    return JobStore(get_engine(env["OCRQ_DATABASE_URL"]))


def _rows(env: dict[str, str], ids: list[str], timeout: float = 300) -> dict[str, dict[str, Any]]:
    store = _store(env)

    def final() -> dict[str, dict[str, Any]] | None:
        rows = store.get(ids)
        done = len(rows) == len(ids) and all(
            r["status"] in ("done", "failed") for r in rows.values()
        )
        return rows if done else None

    return wait_for(final, timeout, f"jobs {ids} final")


def test_remote_worker_matches_transformers_per_image(
    worker: WorkerProcess,
    env: dict[str, str],
    images: dict[str, Path],
    references: dict[str, str],
) -> None:
    client = _client(env)
    ids = {n: client.submit({"path": str(p)}, task=IMAGES[n][3]) for n, p in images.items()}
    rows = _rows(env, list(ids.values()))
    for name, job in ids.items():
        assert rows[job]["status"] == "done", rows[job]
        assert rows[job]["engine"] == "openai"
        assert rows[job]["text"] == references[name], (name, rows[job]["text"], references[name])


def test_start_up_says_the_numerics_are_transformers_not_the_trained_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The `hunyuan` engine follows the training code; a vLLM server cannot (issue 52): one
    start-up line says so, even with the server not up yet."""
    from ocrq.models.openai.engine import NUMERICS_NOTE
    from ocrq.models.registry import create_engine

    settings = Settings(openai_url=f"http://127.0.0.1:{free_port()}/v1", openai_retry_s=0)
    engine = create_engine("openai", settings)
    with caplog.at_level("INFO", logger="ocrq.models.openai.engine"):
        engine.load()
    engine.close()
    said = [r.getMessage() for r in caplog.records if "XD-RoPE" in r.getMessage()]
    assert said == [NUMERICS_NOTE]
    assert "not the trained ones" in NUMERICS_NOTE and "hunyuan-numerics.md" in NUMERICS_NOTE


def test_4xx_fails_the_job_and_the_worker_goes_on(
    worker: WorkerProcess,
    env: dict[str, str],
    images: dict[str, Path],
    references: dict[str, str],
) -> None:
    client = _client(env)
    refused = client.submit({"path": str(images["b"])}, task="a" * 450)  # too long for the server
    good = client.submit({"path": str(images["a"])}, task="text")
    rows = _rows(env, [refused, good])
    assert rows[refused]["status"] == "failed"
    assert "server refused the request (HTTP 400" in rows[refused]["error"], rows[refused]["error"]
    assert rows[good]["status"] == "done" and rows[good]["text"] == references["a"]
    assert worker.alive()
    # No retry of a refusal: the server's answer was final.
    assert "retry 1 in" not in worker.text()


def test_wrong_api_key_fails_the_job(
    service_env: dict[str, str],
    server: VllmServer,
    images: dict[str, Path],
    tmp_path: Path,
) -> None:
    """401 is a refusal too: the job fails saying so, and the worker stays up."""
    env = _env(service_env, server, OCRQ_OPENAI_API_KEY="wrong-key-0123456789")
    proc = WorkerProcess(env, tmp_path / "worker.log", "--concurrency", "2").wait_ready(120)
    try:
        job = _client(env).submit({"path": str(images["a"])}, task="text")
        row = _rows(env, [job])[job]
        assert row["status"] == "failed" and "HTTP 401" in row["error"], row
        assert proc.alive()
    finally:
        proc.stop()


def test_server_killed_mid_run_loses_and_duplicates_nothing(
    service_env: dict[str, str],
    server: VllmServer,
    images: dict[str, Path],
    references: dict[str, str],
    broker_url: str,
    tmp_path: Path,
) -> None:
    """One request at a time so the run lasts; the server is killed (SIGKILL, its engine
    processes too) after the first results and started again on the same port: every job ends
    done with its own image's text, one row each, and no message is left in Redis."""
    env = _env(
        service_env,
        server,
        OCRQ_OPENAI_CONCURRENCY="1",
        OCRQ_MAX_BATCH="1",
        OCRQ_OPENAI_RETRY_S="600",
        OCRQ_OPENAI_TIMEOUT_S="30",
    )
    proc = WorkerProcess(env, tmp_path / "worker.log", "--concurrency", "4").wait_ready(120)
    try:
        client = _client(env)
        names = [n for n in IMAGES for _ in range(4)]  # 16 jobs, every image four times
        ids = [client.submit({"path": str(images[n])}, task=IMAGES[n][3]) for n in names]
        store = _store(env)
        done_before = wait_for(
            lambda: sum(r["status"] == "done" for r in store.get(ids).values()) >= 2 or None,
            300,
            "the first results",
            every=0.1,
        )
        assert done_before
        server.kill()
        at_kill = sum(r["status"] == "done" for r in store.get(ids).values())
        assert at_kill < len(ids), "the run ended before the kill: nothing was tested"
        wait_for(lambda: "retry 2 in" in proc.text(), 120, "the worker retrying")
        server.start()
        rows = _rows(env, ids, timeout=600)
        assert proc.alive()
        for job, name in zip(ids, names, strict=True):
            assert rows[job]["status"] == "done", rows[job]
            assert rows[job]["text"] == references[name], (name, rows[job])
        # One row per job id, and nothing left to deliver or ack.
        from sqlalchemy import func, select

        from ocrq.core.db import ocr_jobs

        with store.engine.connect() as conn:
            count = conn.execute(
                select(func.count()).select_from(ocr_jobs).where(ocr_jobs.c.id.in_(ids))
            ).scalar_one()
        assert count == len(ids)
        r = redis.Redis.from_url(broker_url)
        assert r.llen(env["OCRQ_QUEUE"]) == 0

        def ours_unacked() -> list[str]:
            return [v.decode() for v in r.hvals("unacked") if any(i.encode() in v for i in ids)]

        wait_for(lambda: not ours_unacked() or None, 30, "every message acked")
        FIGURES.append(
            f"openai engine, server killed mid-run: {len(ids)} jobs, {at_kill} done at the kill, "
            f"{len(ids)} done after the restart, 0 lost, 0 duplicated"
        )
    finally:
        proc.stop()
