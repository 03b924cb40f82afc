"""The job table on the real PostgreSQL (migrated by `ocrq migrate`) and on SQLite."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, event, func, select, update

from ocrq.core.db import get_engine, ocr_jobs
from ocrq.core.store import JobStore


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
    again = store.claim(job, "text", "/x.png", "w2")  # redelivered before done: run again,
    assert again.run and again.retry  # alone, and counted only then
    assert store.get([job])[job]["attempts"] == 1
    assert store.count_retry(job)
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


def test_claim_of_a_queued_row_is_one_statement(store: JobStore) -> None:
    """Every job's claim finds the producer's row: one UPDATE ... RETURNING in autocommit
    (was SELECT ... FOR UPDATE + UPDATE in a transaction), its enqueue time kept."""
    job = str(uuid.uuid4())
    store.enqueue(job, "text", "/one.png")
    created = store.get([job])[job]["created_at"]
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        claim = store.claim(job, "text", "/one.png", "w1", max_attempts=3)
    finally:
        event.remove(store.engine, "before_cursor_execute", count)
    assert claim.run and claim.created_at is not None
    assert claim.created_at == (created if created.tzinfo else created.replace(tzinfo=dt.UTC))
    assert len(statements) == 1 and statements[0].lstrip().upper().startswith("UPDATE"), statements
    row = store.get([job])[job]
    assert (row["status"], row["attempts"], row["worker"]) == ("running", 1, "w1")


def test_finish_stores_any_engines_text(store: JobStore) -> None:
    """NUL and lone surrogates, which PostgreSQL's text and jsonb refuse, in the text, the lines
    and the error alike: stored as U+FFFD, whichever engine made them."""
    done, failed = str(uuid.uuid4()), str(uuid.uuid4())
    for job in (done, failed):
        assert store.claim(job, "text", "/n.png", "w1").run
    lines = [{"text": "a\x00b", "box": [0, 0, 1, 1], "label": "x\ud800"}]
    assert store.finish(done, status="done", text="A\x00B\udfffC", lines=lines)
    assert store.finish(failed, status="failed", error="bad \x00 answer")
    rows = store.get([done, failed])
    assert rows[done]["text"] == "A\ufffdB\ufffdC"
    assert rows[done]["lines"] == [{"text": "a\ufffdb", "box": [0, 0, 1, 1], "label": "x\ufffd"}]
    assert rows[failed]["error"] == "bad \ufffd answer"


def test_a_failed_row_stays_failed(store: JobStore) -> None:
    """A client told `failed` is never told otherwise: a redelivery does not claim it, a late
    result does not overwrite it."""
    job = str(uuid.uuid4())
    assert store.claim(job, "text", "/y.png", "w1").run
    assert store.finish(job, status="failed", error="bad image")
    claim = store.claim(job, "text", "/y.png", "w2", max_attempts=3)
    assert not claim.run and claim.error is None and claim.row["status"] == "failed"
    assert not store.finish(job, status="done", text="late")
    row = store.get([job])[job]
    assert (row["status"], row["error"], row["text"], row["attempts"], row["worker"]) == (
        "failed",
        "bad image",
        None,
        1,
        "w1",
    )
    with pytest.raises(ValueError):
        store.finish(job, status="running")


def test_redelivery_cap(store: JobStore) -> None:
    """Claims that find the row still running (the previous attempt died) stop at the cap."""
    job = str(uuid.uuid4())
    for attempt in range(1, 4):
        claim = store.claim(job, "text", "/p.png", f"w{attempt}", max_attempts=3)
        assert claim.run and claim.error is None and claim.retry == (attempt > 1)
        if claim.retry:  # what the worker does once the retry runs alone
            assert store.count_retry(job)
        assert store.get([job])[job]["attempts"] == attempt
    claim = store.claim(job, "text", "/p.png", "w4", max_attempts=3)
    assert not claim.run
    assert claim.error == (
        "gave up after 3 attempts: the worker died while processing it (possible poison input)"
    )
    row = store.get([job])[job]
    assert (row["status"], row["error"], row["attempts"], row["worker"]) == (
        "failed",
        claim.error,
        3,
        "w3",
    )
    assert row["finished_at"] is not None
    # Later copies of the message (the sweep's, the visibility timeout's) find it final.
    claim = store.claim(job, "text", "/p.png", "w5", max_attempts=3)
    assert not claim.run and claim.error is None
    assert store.get([job])[job]["attempts"] == 3


def test_a_sweep_requeue_does_not_reset_the_count(store: JobStore) -> None:
    """The stall sweep puts a dead worker's rows back to `queued` before re-sending them: that
    is still an attempt that died, so the cap counts it (the probe saw attempts 8 of 3)."""
    job = str(uuid.uuid4())
    store.enqueue(job, "text", "/q.png")
    for attempt in range(1, 4):
        claim = store.claim(job, "text", "/q.png", f"w{attempt}", max_attempts=3)
        assert claim.run
        if claim.retry:
            assert store.count_retry(job)
        with store.engine.begin() as conn:  # what workers_table.flip_stalled does
            conn.execute(update(ocr_jobs).where(ocr_jobs.c.id == job).values(status="queued"))
    claim = store.claim(job, "text", "/q.png", "w4", max_attempts=3)
    assert not claim.run and claim.error is not None and "gave up after 3" in claim.error
    assert store.get([job])[job]["status"] == "failed"


def test_a_neighbour_that_died_waiting_is_not_charged(store: JobStore) -> None:
    """Two jobs die with their worker; both come back as retries. The poison one runs alone
    and dies again (counted); the healthy one, waiting for its turn, dies with it (not
    counted), and later runs alone and finishes: only the poison job runs out of attempts."""
    poison, healthy = str(uuid.uuid4()), str(uuid.uuid4())
    for job in (poison, healthy):
        store.enqueue(job, "text", f"/{job}.png")
        assert not store.claim(job, "text", f"/{job}.png", "w1", max_attempts=2).retry
    for worker in ("w2", "w3"):  # each dies while the poison job runs alone
        for job in (poison, healthy):
            claim = store.claim(job, "text", f"/{job}.png", worker, max_attempts=2)
            if job == poison and worker == "w3":
                assert not claim.run and "gave up after 2 attempts" in (claim.error or "")
                continue
            assert claim.run and claim.retry
        if worker == "w2":
            assert store.count_retry(poison)  # it runs alone; w2 dies under it
    claim = store.claim(healthy, "text", f"/{healthy}.png", "w4", max_attempts=2)
    assert claim.run and claim.retry and store.count_retry(healthy)
    assert store.finish(healthy, status="done", text="fine")
    rows = store.get([poison, healthy])
    assert (rows[poison]["status"], rows[poison]["attempts"]) == ("failed", 2)
    assert (rows[healthy]["status"], rows[healthy]["attempts"]) == ("done", 2)


def test_reused_job_id_refused(store: JobStore) -> None:
    """A job id names one image and task; another content never touches the row."""
    job = str(uuid.uuid4())
    store.enqueue(job, "text", "/a.png")
    for source, task in (("/b.png", "text"), ("/a.png", "spotting")):
        claim = store.claim(job, task, source, "w1")
        assert not claim.run
        assert claim.error == "job_id already used for a different image or task"
    row = store.get([job])[job]
    assert (row["status"], row["attempts"], row["source"], row["task"]) == (
        "queued",
        0,
        "/a.png",
        "text",
    )
    assert store.claim(job, "text", "/a.png", "w1").run
    store.finish(job, status="done", text="A")
    before = store.get([job])[job]
    claim = store.claim(job, "text", "/b.png", "w2")
    assert not claim.run and claim.error is not None and claim.row == before
    assert store.get([job])[job] == before


def test_concurrent_first_claims_make_one_row(database_url: str) -> None:
    """Duplicate deliveries claiming a new job at once: one row, one attempt counted; the later
    claims are retries, counted only as each runs alone in its worker."""
    from concurrent.futures import ThreadPoolExecutor

    store = JobStore(get_engine(database_url))
    job = str(uuid.uuid4())
    with ThreadPoolExecutor(8) as pool:
        claims = list(pool.map(lambda i: store.claim(job, "text", "/c.png", f"w{i}"), range(8)))
    assert all(c.run for c in claims) and sum(not c.retry for c in claims) == 1
    assert _count(store, job) == 1 and store.get([job])[job]["attempts"] == 1


def test_concurrent_claims_of_a_queued_row_make_one_first_run(database_url: str) -> None:
    """Duplicate deliveries of a job whose row the producer wrote, claiming at once: one takes
    the one-statement claim (the first run, counted); PostgreSQL re-checks the others against
    that committed row, so they fall through to the locked claim and are retries, counted only
    when they run alone (`count_retry`)."""
    from concurrent.futures import ThreadPoolExecutor

    store = JobStore(get_engine(database_url))
    job = str(uuid.uuid4())
    store.enqueue(job, "text", "/d.png")
    with ThreadPoolExecutor(8) as pool:
        claims = list(pool.map(lambda i: store.claim(job, "text", "/d.png", f"w{i}", 5), range(8)))
    assert all(c.run for c in claims) and sum(not c.retry for c in claims) == 1
    row = store.get([job])[job]
    assert row["attempts"] == 1 and row["status"] == "running", row


def test_cancelled_and_expired_rows_are_never_claimed_nor_overwritten(store: JobStore) -> None:
    """A copy of a cancelled job's message (a redelivery after its worker was killed -9, a
    re-send) finds the row final; a job past its row's deadline is expired by its claim."""
    from ocrq.core.store import NewJob

    running, queued, done = (str(uuid.uuid4()) for _ in range(3))
    for job in (running, queued, done):
        store.enqueue(job, "text", "/c.png")
    assert store.claim(running, "text", "/c.png", "w1").run
    assert store.claim(done, "text", "/c.png", "w1").run
    assert store.finish(done, status="done", text="ok")
    assert sorted(store.cancel([running, queued, done])) == sorted([running, queued])
    assert not store.finish(running, status="done", text="late")  # the batch's result: dropped
    for job in (running, queued):
        claim = store.claim(job, "text", "/c.png", "w2", max_attempts=3)
        assert not claim.run and claim.error is None and claim.row["status"] == "cancelled"
        assert store.get([job])[job]["text"] is None
    assert store.get([done])[done]["status"] == "done"

    late, fresh = str(uuid.uuid4()), str(uuid.uuid4())
    t = dt.datetime.now(dt.UTC)
    store.enqueue_many(
        [
            NewJob(late, "text", "/e.png", expires_at=t - dt.timedelta(seconds=1)),
            NewJob(fresh, "text", "/e.png", expires_at=t + dt.timedelta(hours=1)),
        ]
    )
    claim = store.claim(late, "text", "/e.png", "w1")
    assert not claim.run and claim.row["status"] == "expired" and "deadline" in claim.row["error"]
    assert store.get([late])[late]["status"] == "expired"
    assert store.claim(fresh, "text", "/e.png", "w1").run
