"""JobStore.finish runs its one UPDATE in autocommit (two round trips fewer per job): it must
keep its meaning, and the pooled connection it used must come back transactional, or a later
claim's SELECT ... FOR UPDATE would lock nothing and a rollback would undo nothing."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, make_url, select, text, update

from ocrq.core.db import metadata, ocr_jobs
from ocrq.core.store import JobStore

TEST_PG = os.environ.get(
    "OCRQ_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """One pooled connection only, so the connection finish() used is the one reused after."""
    if request.param == "sqlite":
        eng = create_engine(f"sqlite:///{tmp_path / 'jobs.sqlite'}", pool_size=1, max_overflow=0)
        metadata.create_all(eng)
        yield eng
        eng.dispose()
        return
    name = f"ocrq_test_finish_{uuid.uuid4().hex[:8]}"
    admin = create_engine(TEST_PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    eng = create_engine(make_url(TEST_PG).set(database=name), pool_size=1, max_overflow=0)
    metadata.create_all(eng)
    try:
        yield eng
    finally:
        eng.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_finish_keeps_its_meaning_and_leaves_the_pool_transactional(engine: Engine) -> None:
    store = JobStore(engine)
    job = str(uuid.uuid4())
    assert store.claim(job, "text", "/x.png", "w1").run
    assert store.finish(job, status="done", text="first")
    assert not store.finish(job, status="failed", error="late duplicate")  # done stays done
    assert store.get([job])[job]["text"] == "first"
    assert not store.finish(str(uuid.uuid4()), status="done")  # no row: nothing changed

    # The connection finish() had is transactional again: an uncommitted write is undone.
    with engine.connect() as conn:
        conn.execute(update(ocr_jobs).where(ocr_jobs.c.id == job).values(text="rolled back"))
        conn.rollback()
    with engine.connect() as conn:
        assert conn.execute(select(ocr_jobs.c.text).where(ocr_jobs.c.id == job)).scalar() == "first"
