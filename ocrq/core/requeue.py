"""Send jobs again, from the broker's own copy where it still has one, from their rows where
not: the recovery sweep, run by every worker's heartbeat thread (ocrq/worker/heartbeat.py) and
by `ocrq requeue` (through ocrq/api/client.py), so a worker reaches it without the api.

One sweep, three cases, each a single fault that used to wait for a person or for the 1 h
visibility timeout (docs/faults.md says which bound holds for each):

- stalled: `running` rows of workers whose heartbeat is older than OCRQ_STALLED_AFTER_S;
- orphaned: messages a dead worker had taken from the queue but not started (their rows are
  still `queued`); they sit in kombu's `unacked` hash, and ocrq's workers record which
  messages they hold (ocrq/core/broker_scan.py), so a sweep can give them back;
- lost: `queued` rows older than OCRQ_STALLED_AFTER_S whose message is nowhere in Redis: taken
  by a worker killed between kombu's two round trips, or gone with a Redis that came back empty.

Where the original message still exists it is put back (kombu's own restore: one transaction),
so the job runs from exactly what was submitted, inline images included; otherwise it is rebuilt
from the row. A Redis lock lets one sweep run at a time across all workers, so no message is
put back and rebuilt both, and the workers' sweeps are paced to one per OCRQ_STALLED_SWEEP_S in
all, whatever the number of workers. Attempts are not touched here: a re-sent job that had run
before is counted when it runs again, alone (ocrq/core/store.py, ocrq/worker/alone.py).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from celery import Celery
from redis.exceptions import LockError

from ocrq.core import workers_table
from ocrq.core.broker_redis import celery_options
from ocrq.core.broker_scan import BrokerView, broker_view
from ocrq.core.contract import DEFAULT_QUEUE, TASK_NAME, JobRequest, queue_for
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore

log = logging.getLogger(__name__)

# The oldest and the newest queued rows of each lane a sweep checks for a lost message
# (workers_table.queued_before says why both), and the most queued messages it reads to look
# for them: bounded work every OCRQ_STALLED_SWEEP_S, whatever the backlog.
LOST_CANDIDATES = 1000
SCAN_LIMIT = 20_000
# Of a queue longer than that, its oldest this many messages are read too (_present).
SCAN_TAIL = 2 * LOST_CANDIDATES
# A message is declared lost only when two readings this far apart both miss it: between
# BRPOP and kombu's unacked write, or while a restore moves it back, a message is briefly in
# neither place.
RECHECK_S = 0.5


@dataclass
class Recovered:
    stalled: list[str] = field(default_factory=list)
    orphaned: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    # Of `orphaned`: messages of jobs whose row is already final, held by a worker killed after
    # it stored the result and before it acked (a kill -9 mid-drain). Put back all the same, or
    # the broker's copy stays in a dead worker's hands; the worker that takes one drops it
    # ("already done; redelivery ignored"), so it is not a job sent to run again.
    final: list[str] = field(default_factory=list)
    # A step after the put-back failed (the database went away mid-sweep): the lists hold
    # what was done before it.
    failed: Exception | None = None


def producer_app(settings: Settings) -> Celery:
    """The Celery app producers send with: the api, `ocrq submit`, the sweep, document pages."""
    app = Celery("ocrq-producer", broker=settings.broker_url)
    app.conf.update(
        task_send_sent_event=True,
        broker_connection_retry_on_startup=True,
        **celery_options(settings, None),  # Sentinel's master name (ocrq/core/broker_redis.py)
    )
    return app


def queue_of(settings: Settings) -> str:
    return settings.queue or DEFAULT_QUEUE


def recover(
    store: JobStore,
    app: Celery,
    settings: Settings,
    exclude_worker: str | None = None,
    stalled_after_s: float | None = None,
    lost: bool = True,
    paced: bool = False,
) -> Recovered:
    """One sweep (see the module doc). A live worker's jobs and messages are never touched.

    `paced` (the workers' sweeps): at most one sweep per OCRQ_STALLED_SWEEP_S across all
    workers, and none while another runs, so the cost does not grow with the worker count.
    Unpaced (`ocrq requeue`), it waits for a running sweep to end."""
    after = settings.stalled_after_s if stalled_after_s is None else stalled_after_s
    queue = queue_of(settings)
    with broker_view(app, queue) as view:
        if view is None:  # not Redis: only what the rows alone allow
            return Recovered(stalled=_resend_stalled(store, app, settings, after, exclude_worker))
        pace_ms = max(1, int(settings.stalled_sweep_s * 1000))
        if paced and not view.client.set(f"ocrq.swept:{queue}", b"1", nx=True, px=pace_ms):
            return Recovered()  # another worker swept within the last OCRQ_STALLED_SWEEP_S
        lock = view.client.lock(f"ocrq.sweep:{queue}", timeout=max(after, 5.0))
        if not lock.acquire(blocking=not paced, blocking_timeout=max(after, 5.0)):
            return Recovered()
        try:
            put_back = _restore_orphans(view, store, after, exclude_worker)
            # What was put back is reported even when a later step fails: those messages are
            # back in the queue, and a next sweep would not find them again to say so.
            done = Recovered(orphaned=put_back)
            try:
                done.stalled = _resend_stalled(
                    store, app, settings, after, exclude_worker, skip=set(put_back)
                )
                done.orphaned = [j for j in put_back if j not in set(done.stalled)]
                done.final = workers_table.final_among(store.engine, done.orphaned)
                if lost:
                    done.lost = _resend_lost(view, store, app, settings, after)
            except Exception as exc:
                done.failed = exc
            return done
        finally:
            with contextlib.suppress(LockError):  # it expired mid-sweep; another may run now
                lock.release()


@dataclass(frozen=True)
class StalledRequeue:
    """What `ocrq requeue --stalled` did, by kind: one count of all of it told an operator that
    jobs already done were re-sent (the put-back messages of finished jobs were counted in)."""

    stalled: list[str]  # `running` rows of dead workers, sent again (their message or rebuilt)
    put_back: list[str]  # the other messages dead workers held, back in the queue
    final: list[str]  # of `put_back`: jobs already final, which the worker taking them drops
    # `running` rows left alone: of workers heard from within OCRQ_STALLED_AFTER_S (alive, or
    # dead for less than that: a next run re-sends those), and of workers with no heartbeat
    # on record (left to the broker's visibility timeout, as workers_table says).
    running_heard: int = 0
    running_unrecorded: int = 0

    @property
    def to_run(self) -> list[str]:
        """The jobs that will run again: the stalled ones and the put-back ones not final."""
        final = set(self.final)
        return self.stalled + [j for j in self.put_back if j not in final]


def requeue_stalled(
    store: JobStore,
    app: Celery,
    settings: Settings,
    stalled_after_s: float | None = None,
    exclude_worker: str | None = None,
) -> StalledRequeue:
    """`ocrq requeue --stalled`: the jobs of dead workers, running or taken but not started."""
    after = settings.stalled_after_s if stalled_after_s is None else stalled_after_s
    found = recover(store, app, settings, exclude_worker, after, lost=False)
    if found.failed is not None:
        if found.orphaned:
            log.warning("put back %d message(s) before failing: %s", len(found.orphaned),
                        " ".join(found.orphaned))
        raise found.failed
    heard, unrecorded = workers_table.running_left(store.engine, after)
    return StalledRequeue(found.stalled, found.orphaned, found.final, heard, unrecorded)


def requeue_queued(
    store: JobStore, app: Celery, settings: Settings, older_than_s: float
) -> list[str]:
    """`ocrq requeue`: send again the jobs still `queued` after `older_than_s` whose message is
    in neither the queue nor a worker's hands (all of the queue is read). A waiting backlog is
    left alone: copying it doubled the queue and, for a job whose copies met two workers, ran
    it twice."""
    rows = workers_table.queued_before(store.engine, older_than_s, None)
    with broker_view(app, queue_of(settings)) as view:
        present = _present(view, [r.id for r in rows], None) if view is not None else set()
    return _resend_rows(store, app, settings, [r for r in rows if r.id not in present])


def _restore_orphans(
    view: BrokerView, store: JobStore, after: float, exclude: str | None
) -> list[str]:
    """Put back the messages held by workers that are not alive: at once when the holder is
    known dead (its heartbeat on record is older than `after`), else once taken over `after` s
    ago (a holder with no heartbeat on record: one that has not beaten yet, or was forgotten).

    Why at once: a worker's last messages are taken after its last heartbeat, so they are
    still young when the sweep finds it dead. Left for a later sweep, the message of a job
    already `running` under that worker became a second copy: this sweep re-sent the row,
    the next put the original back, and the two met two live workers (test_gpus saw a job
    run twice after a kill -9)."""
    alive = workers_table.alive(store.engine, after)
    dead = workers_table.dead(store.engine, after)
    if exclude is not None:
        alive.add(exclude)
        dead.discard(exclude)
    orphans = [h for h in view.held() if h.worker and h.worker not in alive]
    taken = view.delivered_at([h.tag for h in orphans])
    cutoff = time.time() - after  # kombu stamps the unacked index with the taker's clock
    put_back = []
    for held in orphans:
        if held.worker in dead or taken.get(held.tag, cutoff) < cutoff:
            view.restore(held.tag)
            if held.job_id:
                put_back.append(held.job_id)
    return put_back


def _resend_stalled(
    store: JobStore,
    app: Celery,
    settings: Settings,
    after: float,
    exclude: str | None,
    skip: Collection[str] = (),
) -> list[str]:
    """Flip the running rows of dead workers to `queued` (one UPDATE: each to one sweeper) and
    re-send those whose original message was not put back."""
    stalled = workers_table.flip_stalled(store.engine, after, exclude=exclude)
    rebuild = [j for j in stalled if j.id not in skip]
    sent = _resend_rows(store, app, settings, rebuild, unflip=True)
    workers_table.forget_dead(store.engine, after)
    return [j.id for j in stalled if j.id in skip] + sent


def _resend_lost(
    view: BrokerView, store: JobStore, app: Celery, settings: Settings, after: float
) -> list[str]:
    rows = workers_table.queued_before(store.engine, after, LOST_CANDIDATES)
    missing = [r.id for r in rows]
    for reading in range(2):
        if reading:
            time.sleep(RECHECK_S)
        present = _present(view, missing, SCAN_LIMIT, reference=[r.id for r in rows])
        if present is None:
            return []
        missing = [i for i in missing if i not in present]
        if not missing:
            return []
    lost = workers_table.still_queued(store.engine, missing)
    return _resend_rows(store, app, settings, [r for r in rows if r.id in lost])


def _present(
    view: BrokerView, job_ids: list[str], limit: int | None, reference: list[str] | None = None
) -> set[str] | None:
    """The ids among `job_ids` with a message in the queue or in a worker's hands, or that may
    have one where the queue was not read. `reference`: the candidates these are taken from,
    oldest row first (default: `job_ids`, in that order), whose messages place them in order.

    A queue longer than `limit` is read at both ends (`BrokerView.queued_ends`); its middle is
    judged by order, as a queue is first in first out: a job whose row is older than one whose
    message sits among the oldest would be there too, and one newer than one among the newest
    would be there; only those in between may wait unread in the middle, and count as present.
    Before, such a queue proved nothing and no lost message was looked for until it drained
    (a backlog over 20,000). A message out of that order (a restored one, a re-send) may be
    judged lost wrongly: it is then sent twice, and its claim keeps it to one row and one run."""
    if not job_ids:
        return set()
    if limit is None:
        found, _whole = view.queued(job_ids, None)
        partial: dict[str, tuple[set[str], set[str]]] = {}
    else:
        found, partial = view.queued_ends(job_ids, limit, SCAN_TAIL, reference or ())
    held = {h.job_id for h in view.held()}  # the lists first, then unacked: a message moving
    found |= held & set(job_ids)  # from one to the other is seen in unacked
    ranked = reference if reference is not None else job_ids
    order = {j: i for i, j in enumerate(ranked)}
    for newest, oldest in partial.values():
        below = max((order[j] for j in oldest if j in order), default=-1)
        above = min((order[j] for j in newest if j in order), default=len(ranked))
        # Unplaced (not in `reference`): anywhere, so maybe in the middle.
        found |= {j for j in job_ids if j not in order or below < order[j] < above}
    return found


def _resend_rows(
    store: JobStore,
    app: Celery,
    settings: Settings,
    jobs: list[workers_table.StalledJob],
    unflip: bool = False,
) -> list[str]:
    sent: list[str] = []
    unsent = {j.id for j in jobs}
    try:
        # The sweep's queries return ids and references only: the job is rebuilt from its whole
        # row (JobRequest.from_row: its caps, lane, batch and re-run, as submitted).
        rows = store.get([j.id for j in jobs])
        for job in jobs:
            assert job.reference is not None  # the row queries return only rows that have one
            row = {**rows.get(job.id, {}), "id": job.id, "task": job.task}
            try:
                request = JobRequest.from_row({**row, "reference": job.reference})
            except ValueError as exc:  # a row no worker would run: not worth a broken sweep
                log.error("job %s cannot be re-sent from its row: %s", job.id, exc)
                unsent.discard(job.id)
                continue
            resend(app, settings, request)
            sent.append(job.id)
            unsent.discard(job.id)
    finally:  # the broker failed mid-way: leave the rest for the next sweep
        if unflip:
            workers_table.unflip(store.engine, [j for j in jobs if j.id in unsent])
    return sent


def send_job(
    app: Celery, settings: Settings, request: JobRequest, expires: dt.datetime | None = None
) -> None:
    """The one way ocrq sends a job (the api, `ocrq submit`, document pages, re-sends): its
    message (`JobRequest.message`) to its lane's queue, under its job id as the task id."""
    app.send_task(
        TASK_NAME,
        kwargs=request.message(),
        queue=queue_for(request.priority, queue_of(settings)),
        task_id=request.job_id,
        expires=expires,
    )


def resend(app: Celery, settings: Settings, request: JobRequest) -> None:
    """A job's message rebuilt from its row (`JobRequest.from_row`): the path or URL (and page)
    exactly as submitted, never its display `source` (a redacted URL, a document page's name),
    with the row's caps, lane, batch and re-run generation (a lower one would be refused as
    stale)."""
    send_job(app, settings, request)
