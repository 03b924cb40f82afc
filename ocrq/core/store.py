"""Job rows: the only code that writes `ocr_jobs`, for the worker and embedded mode alike.

Idempotency lives here, in SQL, not in callers: claiming a job creates or locks its row and
bumps `attempts`, but a row that is already final (`done` or `failed`) is left untouched and
reported as such, so a redelivered message neither creates a second row, nor overwrites a
finished result, nor runs a failed job again: a status a client was told is final never
changes, except by the user's own explicit re-run (`ocrq retry`, ocrq/core/rerun.py), which
puts a failed row back to `queued` and counts a new retry generation that only its own message
carries: a late copy of an older message still finds the job final (or stale) and leaves it.
A job id names one image and task: another message reusing it is refused, and a job
whose worker keeps dying under it is failed after `max_attempts` instead of being run again.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Engine, bindparam, delete, func, or_, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite

from ocrq.core.contract import JobRequest, redact_url
from ocrq.core.db import ocr_jobs
from ocrq.core.storable import storable


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# Statuses no claim or finish changes: redeliveries and sweeps copy messages (the sweep re-sends,
# the unacked original returns after the visibility timeout), and each copy must find the
# outcome the first one stored.
FINAL = ("done", "failed", "cancelled", "expired")
# What a producer may cancel: a job not yet final. A `running` one may already be in an engine
# batch: that batch finishes, but finish() never stores its result over `cancelled`.
CANCELLABLE = ("queued", "running")
CANCELLED = "cancelled by request"


REUSED_ID = "job_id already used for a different image or task"


def gave_up(attempts: int) -> str:
    return (
        f"gave up after {attempts} attempts: the worker died while processing it "
        "(possible poison input)"
    )


@dataclass(frozen=True)
class NewJob:
    """A job a producer is about to send: what its row records before the message goes."""

    id: str
    task: str
    source: str
    max_pixels: int | None = None
    reference: dict[str, Any] | None = None  # ImageRef.reference(): what a re-send sends
    expires_at: dt.datetime | None = None  # the job's deadline (Celery's `expires`)
    callback_url: str | None = None  # the job's webhook
    batch: str | None = None  # the producer's grouping (not batch_id, the engine batch)
    max_new_tokens: int | None = None  # the job's own output cap; NULL: the worker's
    priority: str | None = None  # its lane; NULL: bulk
    retries: int = 0  # its user re-run generation
    file_name: str | None = None  # an upload's name on the producer's side: display only

    @classmethod
    def of(
        cls,
        request: JobRequest,
        expires_at: dt.datetime | None = None,
        callback_url: str | None = None,
        file_name: str | None = None,
    ) -> NewJob:
        """The row of a request: every one of its fields (`JobRequest.columns`), so a re-send
        from the row (`JobRequest.from_row`) is the same job, plus its delivery's."""
        return cls(
            **request.columns(),
            expires_at=expires_at,
            callback_url=callback_url,
            file_name=file_name,
        )


def expired_error(expires_at: dt.datetime) -> str:
    return f"expired: its deadline {expires_at.isoformat()} passed before it ran"


class JobIdReused(ValueError):
    """Job ids whose rows name another image or task: nothing of the request was recorded."""

    def __init__(self, job_ids: Sequence[str]) -> None:
        self.job_ids = list(job_ids)
        super().__init__(f"{REUSED_ID}: {', '.join(self.job_ids)}")


@dataclass(frozen=True)
class Page:
    """One page of jobs, newest first; `next_after` is the (created_at, id) to go on from."""

    rows: list[dict[str, Any]]
    next_after: tuple[dt.datetime, str] | None


@dataclass(frozen=True)
class Claim:
    """The outcome of claiming a job: run it, or not (then `row` is the stored row).

    Not run, with `error` None: the job is already final, done or failed (a redelivery; `row`
    says which). With `error`: the
    message must fail with it, either because the job id belongs to another image (the row is
    left as it was) or because the attempts ran out (the row is now failed with that error).
    """

    run: bool
    row: dict[str, Any] | None = None
    error: str | None = None
    # When the producer wrote the row (its enqueue time: the queue-wait metric); None when the
    # claim created the row itself.
    created_at: dt.datetime | None = None
    # An earlier run never finished (its worker died): this one must run alone in its worker
    # process, and its attempt is counted only then (`count_retry`, ocrq/worker/alone.py).
    retry: bool = False
    callback_url: str | None = None  # the job's webhook, posted once its row is final
    # Not run: the row is `running` under this other worker (a claim with take_running=False).
    elsewhere: str | None = None
    # Not run: this claim found the job past its deadline and made its row `expired` (its
    # webhook is due now, once).
    expired_now: bool = False


class JobStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # The same pool, each statement committed on its own: for writes that are one statement,
        # atomic by themselves, a BEGIN ... COMMIT around them is two more round trips per job.
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert

    def create_tables(self) -> None:
        """For embedded SQLite only; the service's schema is Alembic's (`ocrq migrate`)."""
        ocr_jobs.metadata.create_all(self.engine)

    def enqueue(
        self,
        job_id: str,
        task: str,
        source: str,
        max_pixels: int | None = None,
        reference: dict[str, Any] | None = None,
        batch: str | None = None,
    ) -> None:
        """Record a submitted job as queued; an existing row (any status) is kept."""
        stmt = self._insert(ocr_jobs).values(
            id=job_id,
            status="queued",
            task=task,
            source=source,
            max_pixels=max_pixels,
            reference=reference,
            batch=batch,
            created_at=now(),
            attempts=0,
        )
        with self.engine.begin() as conn:
            conn.execute(stmt.on_conflict_do_nothing(index_elements=["id"]))

    def enqueue_many(self, jobs: Sequence[NewJob]) -> dict[str, str | None]:
        """Record jobs as queued, all or none: job id -> None when its row is new, else the
        status of the row that was already there (an idempotent retry: same image and task).

        Raises JobIdReused, recording nothing, when any id's row names another image or task
        (the worker's claim refuses such a message anyway: better the producer hears it now).
        """
        t = now()
        ids = list(dict.fromkeys(j.id for j in jobs))
        with self.engine.begin() as conn:
            found = {
                r.id: r
                for r in conn.execute(
                    select(ocr_jobs.c.id, ocr_jobs.c.source, ocr_jobs.c.task, ocr_jobs.c.status)
                    .where(ocr_jobs.c.id.in_(ids))
                    .with_for_update()
                )
            }
            new = {j.id: j for j in jobs if j.id not in found}
            inserted: set[str] = set()
            if new:
                values = [
                    {**asdict(j), "status": "queued", "created_at": t, "attempts": 0}
                    for j in new.values()
                ]
                stmt = (
                    self._insert(ocr_jobs)
                    .values(values)
                    .on_conflict_do_nothing(index_elements=["id"])
                    .returning(ocr_jobs.c.id)
                )
                inserted = set(conn.execute(stmt).scalars())
            raced = [i for i in new if i not in inserted]  # another producer's row, just now
            if raced:
                found.update(
                    (r.id, r)
                    for r in conn.execute(
                        select(
                            ocr_jobs.c.id, ocr_jobs.c.source, ocr_jobs.c.task, ocr_jobs.c.status
                        ).where(ocr_jobs.c.id.in_(raced))
                    )
                )
            stored = {i: (j.source, j.task) for i, j in new.items()}
            stored.update((i, (r.source, r.task)) for i, r in found.items())
            reused = [j.id for j in jobs if stored[j.id] != (j.source, j.task)]
            if reused:  # leaving the block rolls the inserts back
                raise JobIdReused(list(dict.fromkeys(reused)))
        return {i: (found[i].status if i in found else None) for i in ids}

    def discard_queued(self, job_ids: Sequence[str]) -> int:
        """Delete rows recorded by enqueue whose message was never sent (the broker failed):
        only rows still `queued` and never claimed, so a job a worker took is never lost."""
        if not job_ids:
            return 0
        stmt = delete(ocr_jobs).where(
            ocr_jobs.c.id.in_(list(job_ids)),
            ocr_jobs.c.status == "queued",
            ocr_jobs.c.attempts == 0,
        )
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount

    def page(
        self,
        statuses: Sequence[str] = (),
        created_after: dt.datetime | None = None,
        created_before: dt.datetime | None = None,
        limit: int = 50,
        after: tuple[dt.datetime, str] | None = None,
        batch: str | None = None,
    ) -> Page:
        """Jobs newest first, filtered; `after` is the previous page's `next_after` (keyset
        paging: stable while new jobs arrive, and each page is one index range scan)."""
        stmt = select(ocr_jobs)
        if batch is not None:
            stmt = stmt.where(ocr_jobs.c.batch == batch)
        if statuses:
            stmt = stmt.where(ocr_jobs.c.status.in_(list(statuses)))
        if created_after is not None:
            stmt = stmt.where(ocr_jobs.c.created_at >= created_after)
        if created_before is not None:
            stmt = stmt.where(ocr_jobs.c.created_at < created_before)
        if after is not None:
            stmt = stmt.where(tuple_(ocr_jobs.c.created_at, ocr_jobs.c.id) < tuple_(*after))
        stmt = stmt.order_by(ocr_jobs.c.created_at.desc(), ocr_jobs.c.id.desc()).limit(limit + 1)
        with self.engine.connect() as conn:
            rows = [dict(r) for r in conn.execute(stmt).mappings()]
        more = len(rows) > limit
        rows = rows[:limit]
        last = rows[-1] if more else None
        return Page(rows, (last["created_at"], last["id"]) if last else None)

    def claim(
        self,
        job_id: str,
        task: str,
        source: str,
        worker: str,
        max_attempts: int | None = None,
        page: int | None = None,
        reference: dict[str, Any] | None = None,
        batch: str | None = None,
        rerun: int = 0,
        columns: Mapping[str, Any] | None = None,
        take_running: bool = True,
    ) -> Claim:
        """Mark the job running (creating its row if the producer did not), unless it must not run.

        The common case (the producer's row, never run, the same source and task) is one
        UPDATE (`_claim_in_one_statement`); the rest is one transaction with the row locked.
        Either way concurrent deliveries of one job see each other's claim. A row is one job: a
        message whose source or task differs from the row's is refused, whatever the row's
        status. A final row (done or failed) is never run again.
        `attempts` counts runs that could have killed their worker: the first run (counted
        here) and each retry, counted only once it runs alone in its worker process
        (`count_retry`). A claim that finds the row not final with attempts already made in
        this re-run means the previous run never finished (its worker died: the row is still
        `running`, or the sweep put it back to `queued` to re-send it); once `max_attempts` were
        made the job fails instead of running again, so a poison message costs at most
        `max_attempts` worker deaths, however many copies of its message are about, while a
        neighbour that died waiting for its retry to run alone is not charged.
        `reference` (the message's ImageRef.reference()) is recorded when the row has none yet
        (a bare producer's job), so that a re-send can name the image exactly.
        `rerun` is the message's user re-run generation: a message of an older one than the
        row's (`retries`, bumped by `ocrq retry`) is a late copy and does not run; attempts are
        counted from when the current re-run began (`retry_attempts`).
        `columns` (the message's JobRequest.columns()) fill a row the claim creates, so a bare
        producer's job is re-sent with its own caps and lane too.
        `take_running=False`: a row `running` under another worker is left as it is and named
        in `Claim.elsewhere`, for the caller to ask whether that worker still holds the job's
        message (a second copy of a running job) before it claims again with True.
        """
        t = now()
        if self.engine.dialect.update_returning:
            claimed = self._claim_in_one_statement(
                job_id, task, source, worker, reference, t, rerun
            )
            if claimed is not None:
                return Claim(run=True, created_at=claimed[0], callback_url=claimed[1])
        locked = select(ocr_jobs).where(ocr_jobs.c.id == job_id).with_for_update()
        with self.engine.begin() as conn:
            row = conn.execute(locked).mappings().first()
            if row is None:
                created = conn.execute(
                    self._insert(ocr_jobs)
                    .values(
                        {
                            **(columns or {}),
                            "id": job_id,
                            "status": "running",
                            "task": task,
                            "source": source,
                            "created_at": t,
                            "started_at": t,
                            "attempts": 1,
                            "worker": worker,
                            # a page job sent by a producer: resendable from its row
                            "page": page,
                            "reference": reference,
                            "batch": batch,
                            "retries": rerun,
                        }
                    )
                    .on_conflict_do_nothing(index_elements=["id"])
                    .returning(ocr_jobs.c.id)
                ).first()
                if created is not None:
                    return Claim(run=True)
                row = conn.execute(locked).mappings().one()  # a concurrent claim created it
            row = dict(row)
            if (row["source"], row["task"]) != (source, task):
                return Claim(run=False, row=row, error=REUSED_ID)
            if row["status"] in FINAL or (row.get("retries") or 0) > rerun:
                return Claim(run=False, row=row)  # final, or a copy from an older re-run
            holder = row.get("worker")
            if not take_running and row["status"] == "running" and holder not in (None, worker):
                return Claim(run=False, row=row, elsewhere=holder)
            where = ocr_jobs.c.id == job_id
            expires_at = _aware(row.get("expires_at"))
            if expires_at is not None and expires_at <= t:  # past its deadline: never run
                fields = {"status": "expired", "error": expired_error(expires_at), "finished_at": t}
                conn.execute(update(ocr_jobs).where(where).values(**fields))
                return Claim(run=False, row={**row, **fields}, expired_now=True)
            this_run = row["attempts"] - (row.get("retry_attempts") or 0)
            if max_attempts is not None and this_run >= max(max_attempts, 1):
                error = gave_up(this_run)
                fields = {"status": "failed", "error": error, "finished_at": t}
                conn.execute(update(ocr_jobs).where(where).values(**fields))
                return Claim(run=False, row={**row, **fields}, error=error)
            retry = this_run > 0
            running: dict[str, Any] = {"status": "running", "started_at": t, "worker": worker}
            if not retry:
                running["attempts"] = ocr_jobs.c.attempts + 1
            if row.get("reference") is None and reference is not None:
                running["reference"] = reference
            conn.execute(update(ocr_jobs).where(where).values(**running))
        return Claim(
            run=True,
            created_at=_aware(row["created_at"]),
            retry=retry,
            callback_url=row.get("callback_url"),
        )

    def _claim_in_one_statement(
        self,
        job_id: str,
        task: str,
        source: str,
        worker: str,
        reference: dict[str, Any] | None,
        t: dt.datetime,
        rerun: int = 0,
    ) -> tuple[dt.datetime | None, str | None] | None:
        """The common claim (the producer's row, not final, never run in this re-run, the same
        source and task, not past its deadline, not a late copy of an older re-run) as one
        autocommit UPDATE ... RETURNING; the row's created_at and callback_url, or None when the
        row is missing or any rule says otherwise (claim() then decides, under its lock: a
        retry, a foreign message, a final row, the attempt cap, the deadline).

        Why: the locked transaction is 4 statements (BEGIN, SELECT ... FOR UPDATE, UPDATE,
        COMMIT) on every job, where this is 1 (bench/results/control_plane/ has the figures).
        Concurrent deliveries still serialise on the row: PostgreSQL re-checks the WHERE
        against the row a concurrent claim committed (its attempts moved on), so the second
        one falls through to the locked path and is seen there as a retry.
        """
        stmt = (
            update(ocr_jobs)
            .where(
                ocr_jobs.c.id == job_id,
                ocr_jobs.c.status.not_in(FINAL),
                ocr_jobs.c.source == source,
                ocr_jobs.c.task == task,
                ocr_jobs.c.attempts == ocr_jobs.c.retry_attempts,  # not run in this re-run
                ocr_jobs.c.retries <= rerun,
                or_(ocr_jobs.c.expires_at.is_(None), ocr_jobs.c.expires_at > t),
            )
            .values(
                status="running",
                attempts=ocr_jobs.c.attempts + 1,
                started_at=t,
                worker=worker,
                reference=func.coalesce(
                    ocr_jobs.c.reference,
                    bindparam("reference", reference, type_=ocr_jobs.c.reference.type),
                ),
            )
            .returning(ocr_jobs.c.created_at, ocr_jobs.c.callback_url)
        )
        with self._autocommit.connect() as conn:
            row = conn.execute(stmt).first()
        return None if row is None else (_aware(row[0]), row[1])

    def count_retry(self, job_id: str) -> bool:
        """Count a retry's attempt as it starts running alone in its worker process; False when
        the row turned final meanwhile (another copy of the message ran it)."""
        stmt = (
            update(ocr_jobs)
            .where(ocr_jobs.c.id == job_id, ocr_jobs.c.status.not_in(FINAL))
            .values(attempts=ocr_jobs.c.attempts + 1, started_at=now())
        )
        with self._autocommit.connect() as conn:
            return conn.execute(stmt).rowcount > 0

    def finish(self, job_id: str, **fields: Any) -> bool:
        """Store a final status; never overwrites a final row (an attempt still running when a
        copy of its message gave the job up must not turn `failed` into `done`, nor a late
        duplicate `done` into `failed`). Returns whether a row changed.

        One UPDATE in autocommit: every job ends here, and the BEGIN and COMMIT of a transaction
        around the one statement were 2 of the worker's 9 database round trips per image job
        (bench/results/control_plane/control_plane_cpu.md has the before and after).
        """
        if fields.get("status") not in ("done", "failed", "expired"):
            raise ValueError("finish() needs status 'done', 'failed' or 'expired'")
        # Text, lines and errors come from engines and exceptions: NUL and lone surrogates in
        # them would make this UPDATE raise and leave the row `running` (core/storable.py).
        fields = {k: storable(v) for k, v in fields.items()}
        fields.setdefault("finished_at", now())
        stmt = (
            update(ocr_jobs)
            .where(ocr_jobs.c.id == job_id, ocr_jobs.c.status.not_in(FINAL))
            .values(**fields)
        )
        with self._autocommit.connect() as conn:
            return conn.execute(stmt).rowcount > 0

    def cancel(self, job_ids: Sequence[str]) -> list[str]:
        """Mark jobs `cancelled` that are not final yet; the ids whose row changed.

        A queued job's message stays in Redis: its claim finds the row final and acks it
        without running. A running job's batch is not disturbed: its result is dropped, since
        finish() never writes over a final row.
        """
        if not job_ids:
            return []
        stmt = (
            update(ocr_jobs)
            .where(ocr_jobs.c.id.in_(list(job_ids)), ocr_jobs.c.status.in_(CANCELLABLE))
            .values(status="cancelled", error=CANCELLED, finished_at=now())
            .returning(ocr_jobs.c.id)
        )
        with self.engine.begin() as conn:
            return list(conn.execute(stmt).scalars())

    def cancel_batch(self, batch: str) -> list[str]:
        """Cancel every job of `batch` not final yet (as `cancel` does each); the ids whose row
        changed. One UPDATE over the batch's index: a job of the batch submitted after it is
        not cancelled, and nothing outside the batch is touched."""
        stmt = (
            update(ocr_jobs)
            .where(ocr_jobs.c.batch == batch, ocr_jobs.c.status.in_(CANCELLABLE))
            .values(status="cancelled", error=CANCELLED, finished_at=now())
            .returning(ocr_jobs.c.id)
        )
        with self.engine.begin() as conn:
            return list(conn.execute(stmt).scalars())

    def cancelled_among(self, job_ids: Sequence[str]) -> list[str]:
        """Which of these jobs are `cancelled`: a worker asks for those it is running, so that
        its engine can drop them (ocrq/worker/cancels.py)."""
        if not job_ids:
            return []
        stmt = select(ocr_jobs.c.id).where(
            ocr_jobs.c.id.in_(list(job_ids)), ocr_jobs.c.status == "cancelled"
        )
        with self._autocommit.connect() as conn:
            return list(conn.execute(stmt).scalars())

    def expire(self, job_id: str, task: str, source: str, expires_at: dt.datetime) -> bool:
        """Record a job Celery discarded as past its `expires` (it never reached the task):
        its row, created if the producer wrote none, becomes `expired` unless already final."""
        t = now()
        fields = {"status": "expired", "error": expired_error(expires_at), "finished_at": t}
        with self.engine.begin() as conn:
            conn.execute(
                self._insert(ocr_jobs)
                .values(id=job_id, task=task, source=source, created_at=t, attempts=0, **fields)
                .on_conflict_do_nothing(index_elements=["id"])
            )
            stmt = (
                update(ocr_jobs)
                .where(ocr_jobs.c.id == job_id, ocr_jobs.c.status.not_in(FINAL))
                .values(**fields)
            )
            return conn.execute(stmt).rowcount > 0

    def get(self, job_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(ocr_jobs).where(ocr_jobs.c.id.in_(list(job_ids))))
            return {r["id"]: dict(r) for r in rows.mappings()}

    def count_by_status(self, job_ids: Iterable[str] | None = None) -> dict[str, int]:
        from sqlalchemy import func

        stmt = select(ocr_jobs.c.status, func.count()).group_by(ocr_jobs.c.status)
        if job_ids is not None:
            stmt = stmt.where(ocr_jobs.c.id.in_(list(job_ids)))
        with self.engine.connect() as conn:
            return {status: n for status, n in conn.execute(stmt)}


def _aware(value: dt.datetime | None) -> dt.datetime | None:
    """SQLite keeps no time zone: its times are UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value


def public_view(row: dict[str, Any]) -> dict[str, Any]:
    """The JSON object users see for a job (same keys as `ocrq run` output, plus job_id)."""
    return {
        "job_id": row["id"],
        "path": row["source"],
        "status": row["status"],
        "text": row.get("text"),
        "lines": row.get("lines") or [],
        "error": row.get("error"),
        "truncated": row.get("truncated"),  # None | "max_tokens" | "repetition"
    }


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def full_view(row: dict[str, Any]) -> dict[str, Any]:
    """Everything a job's row says, for `GET /jobs/{id}` and `ocrq status --json`: the public
    view plus task, timings, engine, worker, attempts, batch and image facts."""
    return {
        **public_view(row),
        "file_name": row.get("file_name"),  # an upload's own name (display only)
        "task": row.get("task"),
        "max_pixels": row.get("max_pixels"),
        "max_new_tokens": row.get("max_new_tokens"),
        "priority": row.get("priority"),
        "engine": row.get("engine"),
        "worker": row.get("worker"),
        "attempts": row.get("attempts"),
        "retries": row.get("retries"),
        "batch": row.get("batch"),
        "batch_id": row.get("batch_id"),
        "sha256": row.get("sha256"),
        "width": row.get("width"),
        "height": row.get("height"),
        "created_at": _iso(row.get("created_at")),
        "started_at": _iso(row.get("started_at")),
        "finished_at": _iso(row.get("finished_at")),
        "document_id": row.get("document_id"),
        "page": row.get("page"),
        "expires_at": _iso(row.get("expires_at")),
        "callback_url": redact_url(row["callback_url"]) if row.get("callback_url") else None,
    }
