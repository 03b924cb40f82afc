"""ocrq through PgBouncer in transaction mode, as docs/operations.md recommends for GPU hosts.

A real PgBouncer (Debian's package) on a free loopback port in front of the test PostgreSQL,
a database of this module's own migrated by `ocrq migrate` straight to PostgreSQL (as the docs
say), then a real `ocrq worker` and `ocrq submit --wait` whose OCRQ_DATABASE_URL is the
bouncer, with OCRQ_DATABASE_PREPARED_STATEMENTS=false.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError

from ocrq.core.db import get_engine
from ocrq.core.problems import infrastructure_problem
from ocrq.core.samples import draw_text_image
from ocrq.core.store import JobStore
from tests.conftest import BIN, TEST_PG, WorkerProcess
from tests.servers import PrivateBouncer
from tests.waiting import Budget

JOBS = 30
# Server connections the bouncer may open for all its clients: the worker's pool (10), its
# heartbeat and the producer share them.
SERVER_CONNECTIONS = 3
WORDS = ("STATION", "HELLO")


@pytest.fixture(scope="module")
def direct_url() -> Iterator[str]:
    """A database of this module's own, created and migrated by `ocrq migrate` with
    OCRQ_DATABASE_URL naming PostgreSQL itself (the docs' way: migrate does not go through
    the bouncer, it creates the database from the `postgres` one)."""
    name = f"ocrq_test_pgb_{uuid.uuid4().hex[:8]}"
    url = make_url(TEST_PG).set(database=name).render_as_string(hide_password=False)
    migrate = subprocess.run(
        [str(BIN / "ocrq"), "migrate"],
        env={**os.environ, "OCRQ_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert migrate.returncode == 0, migrate.stderr
    yield url
    admin = create_engine(TEST_PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _bouncer(direct_url: str, pool_size: int) -> PrivateBouncer:
    url = make_url(direct_url)
    bouncer = PrivateBouncer(url.port or 5432, str(url.database), pool_size)
    bouncer.start()
    return bouncer


def _server_connections(direct_url: str) -> int:
    """PostgreSQL's own count of sessions on the module's database (the bouncer's alone:
    nothing else connects to it straight)."""
    admin = create_engine(TEST_PG, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d"),
                    {"d": make_url(direct_url).database},
                ).scalar_one()
            )
    finally:
        admin.dispose()


def test_prepared_statements_break_in_transaction_mode(direct_url: str) -> None:
    """Why the setting exists: with one server connection behind the bouncer, the second
    client connection to repeat a statement prepares `_pg3_0` again where the first one's
    still lives. Deterministic: psycopg names a connection's first prepared statement
    `_pg3_0` on every connection, and prepares a query on its fifth use."""
    bouncer = _bouncer(direct_url, pool_size=1)
    try:
        outcomes: dict[bool, str] = {}
        problem = None
        for prepared in (True, False):
            engine = get_engine(bouncer.url, prepared, 2, 0)
            first, second = engine.connect(), engine.connect()
            try:
                for conn in (first, second):
                    for _ in range(8):
                        conn.execute(text("SELECT count(*) FROM ocr_jobs")).scalar_one()
                        conn.commit()
                outcomes[prepared] = "ok"
            except ProgrammingError as exc:
                outcomes[prepared] = str(exc.orig)
                problem = infrastructure_problem(exc)
            finally:
                first.close()
                second.close()
                engine.dispose()
        assert 'prepared statement "_pg3_0" already exists' in outcomes[True], outcomes
        assert outcomes[False] == "ok", outcomes
        # What the CLI prints for it names the setting.
        assert problem is not None and "OCRQ_DATABASE_PREPARED_STATEMENTS=false" in problem.message
    finally:
        bouncer.stop()


def test_worker_through_pgbouncer(
    direct_url: str,
    service_env: dict[str, str],
    image_root: Path,
    tmp_path: Path,
) -> None:
    """Every job done exactly once, with the worker and the producer on the bouncer and
    PostgreSQL serving them on SERVER_CONNECTIONS sessions."""
    budget = Budget(420, "test_worker_through_pgbouncer")
    folder = image_root / f"pgbouncer-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    for i in range(JOBS):
        draw_text_image([WORDS[i % 2]], margin=4).save(folder / f"{i:02d}-{WORDS[i % 2]}.png")
    bouncer = _bouncer(direct_url, pool_size=SERVER_CONNECTIONS)
    env = {
        **service_env,
        "OCRQ_DATABASE_URL": bouncer.url,
        "OCRQ_DATABASE_PREPARED_STATEMENTS": "false",
    }
    worker = WorkerProcess(env, tmp_path / "worker.log", "--concurrency", "8")
    try:
        worker.wait_ready(timeout=budget.left())
        submit = subprocess.run(
            [str(BIN / "ocrq"), "submit", str(folder), "--wait", "--json", "--timeout", "240"],
            env=env,
            capture_output=True,
            text=True,
            timeout=budget.left(),
            check=False,
        )
        assert submit.returncode == 0, f"{submit.stderr}\n{worker.text()[-3000:]}"
        results = [json.loads(line) for line in submit.stdout.splitlines()]
        assert len(results) == JOBS
        assert all(r["status"] == "done" for r in results), results
        servers = _server_connections(direct_url)
    finally:
        worker.stop()
        bouncer.stop()

    ids = [r["job_id"] for r in results]
    assert len(set(ids)) == JOBS
    rows = JobStore(get_engine(direct_url)).get(ids)
    assert len(rows) == JOBS
    for r in results:
        row = rows[r["job_id"]]
        # Claimed once (attempts 1), finished once, by this worker, with the image's text.
        assert row["status"] == "done" and row["attempts"] == 1, row
        assert row["worker"] and row["finished_at"] is not None, row
        word = Path(r["path"]).stem.split("-")[1]
        assert word in (row["text"] or "").upper(), row
    assert 0 < servers <= SERVER_CONNECTIONS, servers
    assert "prepared statement" not in worker.text()


def test_retention_lock_is_released_through_the_bouncer(direct_url: str) -> None:
    """The daily pass's advisory lock is a server session's: taken and released in one
    transaction, it is released on the session that took it even when another client takes
    over a server connection meanwhile. (Were the transaction ended after taking it, that other
    client would get the lock's server connection here and the unlock another one: the lock
    would stay held, and every later pass skip.)"""
    from ocrq.core import retention

    bouncer = _bouncer(direct_url, pool_size=3)
    engine = get_engine(bouncer.url, False, 3, 0)
    other = get_engine(bouncer.url, False, 2, 0)  # another client's pool
    held = []
    real_prune = retention.prune

    def with_a_rival(
        db: Any, cutoff: dt.datetime, upload_dir: Path | None, **kwargs: Any
    ) -> Any:
        rival = other.connect()  # a transaction of another client, open across the unlock
        rival.execute(text("SELECT 1")).scalar_one()
        held.append(rival)
        return real_prune(db, cutoff, upload_dir, **kwargs)

    try:
        retention.prune = with_a_rival  # type: ignore[assignment]
        try:
            assert retention.prune_once_locked(engine, _long_ago(), None) is not None
        finally:
            retention.prune = real_prune  # type: ignore[assignment]
            for conn in held:
                conn.close()
        assert held and _retention_locks(direct_url) == 0
        assert retention.prune_once_locked(engine, _long_ago(), None) is not None
    finally:
        engine.dispose()
        other.dispose()
        bouncer.stop()


def _long_ago() -> dt.datetime:
    return dt.datetime.now(dt.UTC) - dt.timedelta(days=3650)  # nothing that old to delete


def _retention_locks(direct_url: str) -> int:
    """Sessions holding the retention lock on the module's database, asked of PostgreSQL."""
    from ocrq.core.retention import LOCK_KEY

    admin = create_engine(TEST_PG, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            return int(conn.execute(text(
                "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
                "AND l.classid::bigint = :high AND l.objid::bigint = :low AND d.datname = :d"
            ), {"high": LOCK_KEY >> 32, "low": LOCK_KEY & 0xFFFFFFFF,
                "d": make_url(direct_url).database}).scalar_one())
    finally:
        admin.dispose()
