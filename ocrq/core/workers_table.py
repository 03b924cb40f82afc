"""Worker heartbeats and the stalled-job sweep, in SQL: the only code that writes `ocr_workers`.

A job is stalled when its row is `running` and the worker named in its `worker` column has a
heartbeat older than `stalled_after_s`. Only such jobs are flipped back to `queued` (to be
re-sent): a live worker's jobs never are, however long they run, and a job whose worker left
no heartbeat row (an older ocrq, embedded mode) is left to the broker's visibility timeout.

Times come from the database's clock on PostgreSQL, so hosts with skewed clocks agree on who
is alive.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, exists, func, literal, select, update
from sqlalchemy.dialects import postgresql, sqlite

from ocrq.core.contract import BULK
from ocrq.core.db import ocr_jobs, ocr_workers
from ocrq.core.store import FINAL, now

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True)
class StalledJob:
    id: str
    task: str
    source: str
    worker: str
    page: int | None = None  # a document's page job: resent as that page
    reference: dict[str, Any] | None = None  # the image as submitted: what the re-send names


def _now(engine: Engine) -> Any:
    """The database's clock where it has one we can compute with; this host's otherwise."""
    return func.now() if engine.dialect.name == "postgresql" else literal(now())


def _cutoff(engine: Engine, seconds: float) -> Any:
    return _now(engine) - dt.timedelta(seconds=seconds)


def _running_of(worker: Any) -> Any:
    return exists().where(ocr_jobs.c.status == "running", ocr_jobs.c.worker == worker)


def beat(engine: Engine, name: str) -> None:
    """Register the worker, or refresh its heartbeat (re-creating a row a sweep removed)."""
    insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
    t = _now(engine)
    stmt = insert(ocr_workers).values(
        name=name, hostname=socket.gethostname(), pid=os.getpid(), started_at=t, heartbeat_at=t
    )
    stmt = stmt.on_conflict_do_update(index_elements=["name"], set_={"heartbeat_at": t})
    with engine.begin() as conn:
        conn.execute(stmt)


def retire(engine: Engine, name: str) -> None:
    """A clean stop: drop the row, or, if jobs of ours are still `running` (a task thread that
    never came back), mark us dead at once so the next sweep re-sends them."""
    with engine.begin() as conn:
        gone = conn.execute(
            delete(ocr_workers).where(ocr_workers.c.name == name, ~_running_of(name))
        ).rowcount
        if not gone:
            conn.execute(
                update(ocr_workers).where(ocr_workers.c.name == name).values(heartbeat_at=EPOCH)
            )


def mark_dead(engine: Engine, name_prefix: str) -> int:
    """Mark the workers whose names start with `name_prefix` dead at once (the supervisor's
    word for a child process it saw die: ocrq/worker/supervisor.py), so the next sweep re-sends
    their jobs instead of waiting OCRQ_STALLED_AFTER_S for their heartbeat to go stale."""
    with engine.begin() as conn:
        return conn.execute(
            update(ocr_workers)
            .where(ocr_workers.c.name.startswith(name_prefix, autoescape=True))
            .values(heartbeat_at=EPOCH)
        ).rowcount


def flip_stalled(
    engine: Engine, stalled_after_s: float, exclude: str | None = None
) -> list[StalledJob]:
    """Set the stalled jobs back to `queued`, with no worker, and return them (each naming the
    dead worker it was running under), for the caller to re-send.

    The rows are locked first (SELECT ... FOR UPDATE), then updated in the same transaction:
    when several workers sweep at once, PostgreSQL makes a second sweep wait for the first's
    locks and re-checks `status = 'running'` on the row it committed, so each job is returned to
    exactly one of them. Why two statements: the dead worker's name leaves the row (a queued row
    names no worker, as `ocrq retry` leaves it, and `GET /jobs/{id}` showed a dead worker on a
    job nobody runs), yet `unflip` must put it back, and an UPDATE's RETURNING gives only the
    new value. Jobs without a `reference` (inline images; rows from before migrations/0006)
    cannot be re-sent from their row and are skipped: their own message comes back after the
    visibility timeout. `source` is a display name and never rebuilt into one.
    """
    cutoff = _cutoff(engine, stalled_after_s)
    dead = select(ocr_workers.c.name).where(ocr_workers.c.heartbeat_at < cutoff)
    found = (
        select(
            ocr_jobs.c.id,
            ocr_jobs.c.task,
            ocr_jobs.c.source,
            ocr_jobs.c.worker,
            ocr_jobs.c.page,
            ocr_jobs.c.reference,
        )
        .where(
            ocr_jobs.c.status == "running",
            ocr_jobs.c.worker.in_(dead),
            ocr_jobs.c.reference.is_not(None),
        )
        .order_by(ocr_jobs.c.id)  # one lock order for every sweep: no deadlock between two
        .with_for_update(of=ocr_jobs)
    )
    if exclude is not None:
        found = found.where(ocr_jobs.c.worker != exclude)
    with engine.begin() as conn:
        stalled = [StalledJob(*row) for row in conn.execute(found)]
        if stalled:
            conn.execute(
                update(ocr_jobs)
                .where(ocr_jobs.c.id.in_([j.id for j in stalled]))
                .values(status="queued", worker=None)
            )
    return stalled


def unflip(engine: Engine, jobs: list[StalledJob]) -> None:
    """Put back to `running` under their dead worker flipped jobs that could not be re-sent
    (the broker was down), so a later sweep finds them again; a job claimed meanwhile is left
    alone."""
    if not jobs:
        return
    by_worker: dict[str, list[str]] = {}
    for job in jobs:
        by_worker.setdefault(job.worker, []).append(job.id)
    with engine.begin() as conn:
        for worker, ids in by_worker.items():
            conn.execute(
                update(ocr_jobs)
                .where(
                    ocr_jobs.c.id.in_(ids),
                    ocr_jobs.c.status == "queued",
                    ocr_jobs.c.worker.is_(None),
                )
                .values(status="running", worker=worker)
            )


def forget_dead(engine: Engine, stalled_after_s: float) -> int:
    """Delete rows of dead workers that have no `running` job left: the table stays as small as
    the number of live worker processes (one new row per recycle)."""
    stmt = delete(ocr_workers).where(
        ocr_workers.c.heartbeat_at < _cutoff(engine, stalled_after_s),
        ~_running_of(ocr_workers.c.name),
    )
    with engine.begin() as conn:
        return conn.execute(stmt).rowcount


def heartbeats(engine: Engine) -> dict[str, dt.datetime]:
    """Every registered worker's last heartbeat (for status displays and tests)."""
    with engine.connect() as conn:
        rows = conn.execute(select(ocr_workers.c.name, ocr_workers.c.heartbeat_at))
        return {name: at for name, at in rows}


def alive(engine: Engine, stalled_after_s: float) -> set[str]:
    """Names of the workers that beat within `stalled_after_s`."""
    stmt = select(ocr_workers.c.name).where(
        ocr_workers.c.heartbeat_at >= _cutoff(engine, stalled_after_s)
    )
    with engine.connect() as conn:
        return set(conn.execute(stmt).scalars())


def dead(engine: Engine, stalled_after_s: float) -> set[str]:
    """Names of the workers on record whose last beat is older than `stalled_after_s`."""
    stmt = select(ocr_workers.c.name).where(
        ocr_workers.c.heartbeat_at < _cutoff(engine, stalled_after_s)
    )
    with engine.connect() as conn:
        return set(conn.execute(stmt).scalars())


def queued_before(engine: Engine, age_s: float, limit: int | None) -> list[StalledJob]:
    """`queued` rows created more than `age_s` ago, oldest first, that can be re-sent from their
    row: those with a `reference` (not inline b64 images, nor rows from before it was kept).
    `worker` is empty: no worker holds them.

    `limit`: the oldest `limit` and the newest `limit` rows of each lane. Why each lane's own:
    the lanes are queues of their own, and a bulk backlog is older than the interactive jobs
    behind it; the oldest rows of all would all be bulk ones, waiting in their queue, and an
    interactive job whose message was lost would be looked for only once the whole bulk backlog
    ahead of it had run. Why the newest too: a message is lost at the moment it is taken or
    sent, so it is found soon after among the newest, however long a backlog is waiting, also
    in another queue of the lane (another engine's, or one no worker consumes); the oldest
    find what is lost behind a backlog, as it drains."""
    columns = (
        ocr_jobs.c.id,
        ocr_jobs.c.task,
        ocr_jobs.c.source,
        ocr_jobs.c.page,
        ocr_jobs.c.reference,
    )
    where = (
        ocr_jobs.c.status == "queued",
        ocr_jobs.c.created_at < _cutoff(engine, age_s),
        ocr_jobs.c.reference.is_not(None),
    )
    if limit is None:
        stmt = select(*columns).where(*where).order_by(ocr_jobs.c.created_at)
    else:
        lane = func.coalesce(ocr_jobs.c.priority, BULK)
        oldest = func.row_number().over(partition_by=lane, order_by=ocr_jobs.c.created_at)
        newest = func.row_number().over(partition_by=lane, order_by=ocr_jobs.c.created_at.desc())
        ranked = (
            select(*columns, ocr_jobs.c.created_at, oldest.label("old"), newest.label("new"))
            .where(*where)
            .subquery()
        )
        stmt = (
            select(*(ranked.c[c.name] for c in columns))
            .where((ranked.c.old <= limit) | (ranked.c.new <= limit))
            .order_by(ranked.c.created_at)
        )
    with engine.connect() as conn:
        return [
            StalledJob(i, task, source, "", page, reference)
            for i, task, source, page, reference in conn.execute(stmt)
        ]


def still_queued(engine: Engine, job_ids: list[str]) -> set[str]:
    if not job_ids:
        return set()
    stmt = select(ocr_jobs.c.id).where(ocr_jobs.c.id.in_(job_ids), ocr_jobs.c.status == "queued")
    with engine.connect() as conn:
        return set(conn.execute(stmt).scalars())


def final_among(engine: Engine, job_ids: list[str]) -> list[str]:
    """The ids among `job_ids` whose row is final, in their order: messages put back for jobs
    already finished are said apart from jobs sent to run again."""
    if not job_ids:
        return []
    stmt = select(ocr_jobs.c.id).where(ocr_jobs.c.id.in_(job_ids), ocr_jobs.c.status.in_(FINAL))
    with engine.connect() as conn:
        final = set(conn.execute(stmt).scalars())
    return [i for i in job_ids if i in final]


def running_left(engine: Engine, stalled_after_s: float) -> tuple[int, int]:
    """`running` rows a sweep leaves alone: (those whose worker beat within `stalled_after_s`,
    those whose worker has no heartbeat row). Why: a sweep run right after a kill -9 re-sent
    nothing and said nothing of the jobs it would re-send once the worker's silence reached
    OCRQ_STALLED_AFTER_S. One query over the running rows, which a sweep reads anyway."""
    joined = ocr_jobs.outerjoin(ocr_workers, ocr_workers.c.name == ocr_jobs.c.worker)
    stmt = (
        select(
            func.count().filter(ocr_workers.c.heartbeat_at >= _cutoff(engine, stalled_after_s)),
            func.count().filter(ocr_workers.c.name.is_(None)),
        )
        .select_from(joined)
        .where(ocr_jobs.c.status == "running")
    )
    with engine.connect() as conn:
        heard, unrecorded = conn.execute(stmt).one()
    return int(heard), int(unrecorded)
