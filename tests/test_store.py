"""The job table on the real PostgreSQL (migrated by `ocrq migrate`) and on SQLite."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select

from ocrq.db import get_engine, ocr_jobs
from ocrq.store import JobStore


@pytest.fixture(params=["postgresql", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> JobStore:
    if request.param == "postgresql":
        return JobStore(get_engine(request.getfixturevalue("database_url")))
    s = JobStore(create_engine(f"sqlite:///{tmp_path / 'jobs.sqlite'}"))
    s.create_tables()
    return s


def _count(store: JobStore, job_id: str) -> int:
    with store.engine.connect() as conn:
        return conn.execute(select(func.count()).where(ocr_jobs.c.id == job_id)).scalar_one()


def test_claim_finish_redelivery(store: JobStore) -> None:
    job = str(uuid.uuid4())
    store.enqueue(job, "text", "/x.png")
    assert store.get([job])[job]["status"] == "queued"
    assert store.claim(job, "text", "/x.png", "w1").run
    assert store.claim(job, "text", "/x.png", "w2").run  # redelivered before done: run again
    assert store.get([job])[job]["attempts"] == 2
    assert store.finish(job, status="done", text="first", lines=[{"text": "first"}])
    # A late duplicate (or a failed retry) never overwrites a done row.
    assert not store.finish(job, status="failed", error="boom")
    claim = store.claim(job, "text", "/x.png", "w3")
    assert not claim.run and claim.row is not None and claim.row["text"] == "first"
    row = store.get([job])[job]
    assert (row["status"], row["text"], row["attempts"], row["worker"]) == (
        "done",
        "first",
        2,
        "w2",
    )
    assert _count(store, job) == 1


def test_failed_job_can_be_retried_to_done(store: JobStore) -> None:
    job = str(uuid.uuid4())
    assert store.claim(job, "text", "/y.png", "w1").run
    store.finish(job, status="failed", error="transient")
    assert store.claim(job, "text", "/y.png", "w1").run
    assert store.finish(job, status="done", text="ok")
    assert store.get([job])[job]["status"] == "done"
    with pytest.raises(ValueError):
        store.finish(job, status="running")
