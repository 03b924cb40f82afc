"""What the Redis broker still holds, by job id: for the sweep that recovers lost and orphaned
messages (ocrq/core/requeue.py) and for `ocrq requeue`, which must not copy a waiting message.

Why the broker must be looked at: kombu's Redis transport takes a message in two round trips,
BRPOP (the message leaves the queue's list) and then a pipeline that records it in the
`unacked` hash. A worker killed between the two loses the message for good, and a Redis that
restarts without its data loses all of them; their rows stay `queued`. The job table is the
record of what was submitted; this module says which of its queued jobs still have a message.

Where a message can be, in kombu's own layout (read through kombu's channel, so key prefixes and
priority-list names are kombu's): the lists of every queue bound in Redis, one per priority
step (a job's row does not say which queue it was sent to), and the `unacked`
hash (delivery tag -> [message, exchange, routing key]) while a worker holds it. ocrq's workers
also write, for each message they take, `HOLDERS_KEY` (delivery tag -> worker name and job id,
ocrq/worker/broker.py): a worker killed with messages it had not started leaves them in
`unacked`, and without an owner on record only the visibility timeout (1 h) brings them back.

Cost, per call: one HSCAN of the holders hash (one short entry per message workers hold, at
most the sum of their concurrency), the keys of `unacked` (not its values, which may carry
inline images), and the queue's lists in LRANGE pages, stopping as soon as every wanted id was
seen, or after `limit` messages. The lists are read from the left (the newest end): producers
push there and shift what was read onward (read twice, never skipped), while BRPOP takes from the
other end; read from the right, each pop would shift an unread message into the pages already
read, and it would look lost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from celery import Celery

# Delivery tag -> "worker name<TAB>job id", written by ocrq's workers next to kombu's `unacked`.
HOLDERS_KEY = "ocrq.unacked_holders"
PAGE = 500  # messages per LRANGE
# Read from the right (the end BRPOP pops), pages overlap by this many messages: each pop
# between two page reads shifts the list by one toward that end, and without the overlap the
# message moved across the page boundary would be skipped (and look lost).
OVERLAP = 100
# How long a holder entry without its `unacked` entry is given to get one before it is dropped
# as stale (`BrokerView.held`): the two are written one Redis round trip apart.
STALE_RECHECK_S = 0.05


def holder_entry(worker: str, job_id: str | None) -> str:
    return f"{worker}\t{job_id or ''}"


def message_job_id(raw: bytes | str) -> str | None:
    """The job id (Celery's task id) of a message as kombu stores it, or None.

    ocrq's producers and Celery's `send_task` write protocol 2, with the id in the headers."""
    try:
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if isinstance(payload, list) and payload:  # an `unacked` entry: [message, exchange, key]
        payload = payload[0]
    headers = payload.get("headers") if isinstance(payload, dict) else None
    job_id = headers.get("id") if isinstance(headers, dict) else None
    return job_id if isinstance(job_id, str) else None


@dataclass(frozen=True)
class Held:
    """A message some worker holds (in `unacked`)."""

    tag: str
    job_id: str | None
    worker: str | None  # None: taken by a consumer that records no holder


class BrokerView:
    def __init__(self, channel: Any, queue: str) -> None:
        self.channel = channel
        self.client = channel.client
        # Every queue Redis knows of, not only ours: the job table does not say which queue a
        # job was sent to, and a job waiting in another queue (another engine's workers) must
        # not look lost.
        queues = {queue, *self._bound_queues()}
        self.lists = [
            channel._q_for_pri(q, pri) for q in sorted(queues) for pri in channel.priority_steps
        ]
        self.unacked_key = channel.unacked_key
        self.index_key = channel.unacked_index_key

    def _bound_queues(self) -> set[str]:
        """The queues in kombu's binding tables (one set per exchange, members
        `routing key<sep>pattern<sep>queue`)."""
        sep = self.channel.sep
        found: set[str] = set()
        for key in self.client.scan_iter(match=self.channel.keyprefix_queue % "*", count=1000):
            for member in self.client.smembers(key):
                found.add(as_text(member).split(sep)[-1])
        found.discard("")
        return found

    def held(self) -> list[Held]:
        """Every message in `unacked`, with its holder where a worker recorded one. Entries of
        the holders hash whose message is no longer unacked (acked or restored by a consumer
        that does not clear them) are removed."""
        holders: dict[str, tuple[str, str | None]] = {}
        for tag, entry in self.client.hscan_iter(HOLDERS_KEY, count=1000):
            worker, _, job_id = as_text(entry).partition("\t")
            holders[as_text(tag)] = (worker, job_id or None)
        tags = [as_text(t) for t in self.client.hkeys(self.unacked_key)]
        stale = sorted(set(holders) - set(tags))
        if stale:
            # A worker writes its holder entry first and kombu's `unacked` entry a round trip
            # later (ocrq/worker/broker.py): an entry read between the two looks stale. Dropped
            # then, the message would sit in `unacked` with no holder, where no sweep puts it
            # back when that worker dies (only kombu's visibility timeout does). So an entry is
            # dropped only if its message is still not in `unacked` a moment later.
            time.sleep(STALE_RECHECK_S)
            pipe = self.client.pipeline()
            for tag in stale:
                pipe.hexists(self.unacked_key, tag)
            arrived = {t for t, there in zip(stale, pipe.execute(), strict=True) if there}
            gone = [t for t in stale if t not in arrived]
            if gone:
                self.client.hdel(HOLDERS_KEY, *gone)
            tags += sorted(arrived)
        out = []
        for tag in tags:
            if tag in holders:
                worker, job_id = holders[tag]
                out.append(Held(tag, job_id, worker))
            else:  # rare (see `worker`): read the message itself for its id
                raw = self.client.hget(self.unacked_key, tag) or b""
                out.append(Held(tag, message_job_id(raw), None))
        return out

    def delivered_at(self, tags: Collection[str]) -> dict[str, float]:
        """When each message was taken (kombu's unacked index), for those still unacked."""
        tags = list(tags)
        pipe = self.client.pipeline()
        for tag in tags:
            pipe.zscore(self.index_key, tag)
        return {t: s for t, s in zip(tags, pipe.execute(), strict=True) if s is not None}

    def queued(self, wanted: Collection[str], limit: int | None) -> tuple[set[str], bool]:
        """Which of `wanted` have a message in the queue's lists, and whether the lists were
        read whole (False: `limit` messages were read and some wanted ids were not among them,
        so their absence proves nothing)."""
        missing = set(wanted)
        found: set[str] = set()
        read = 0
        for key in self.lists:
            start = 0
            while missing:
                if limit is not None and read >= limit:
                    return found, False
                page = self.client.lrange(key, start, start + PAGE - 1)
                for raw in page:
                    job_id = message_job_id(raw)
                    if job_id in missing:
                        missing.discard(job_id)
                        found.add(job_id)
                read += len(page)
                if len(page) < PAGE:
                    break
                start += PAGE
        return found, True

    def queued_ends(
        self,
        wanted: Collection[str],
        limit: int,
        tail: int,
        reference: Collection[str] = (),
    ) -> tuple[set[str], dict[str, tuple[set[str], set[str]]]]:
        """As `queued`, but a queue too long to read whole within `limit` messages is also read
        at its other end, its oldest `tail` messages: which of `wanted` have a message, and, for
        each list not read whole, (the wanted ids seen in its newest messages, those seen in
        its oldest; `reference`: more ids to note there, for the order). The caller judges by
        order what the unread middle may hold (requeue.py
        `_present`). Why: with a backlog over `limit`, `queued` proved nothing, and the sweep
        stopped looking for lost messages until the backlog drained; a message lost as it was
        taken is among the oldest of its lane, exactly what the old end shows."""
        missing = set(wanted)
        noted = missing | set(reference)
        found: set[str] = set()
        partial: dict[str, tuple[set[str], set[str]]] = {}
        read = 0
        for key in self.lists:
            start = 0
            newest: set[str] = set()
            whole = not missing
            while missing and not whole and read < limit:
                page = self.client.lrange(key, start, start + PAGE - 1)
                for raw in page:
                    job_id = message_job_id(raw)
                    if job_id in noted:
                        newest.add(job_id)
                    if job_id in missing:
                        missing.discard(job_id)
                        found.add(job_id)
                read += len(page)
                whole = len(page) < PAGE
                start += PAGE
            if whole or not missing:
                continue
            oldest, reached = self._oldest(key, noted, tail)
            if not reached:  # a list the tail read whole (one the limit left unread) is whole
                partial[key] = (newest, oldest)
            found |= oldest & missing
            missing -= oldest
        return found, partial

    def _oldest(self, key: str, wanted: set[str], tail: int) -> tuple[set[str], bool]:
        """The ids of `wanted` among the oldest `tail` messages of the list `key`, and whether
        that read reached the list's newest end."""
        seen: set[str] = set()
        start = 0  # from the right end
        while start < tail:
            page = self.client.lrange(key, -(start + PAGE), -(start + 1))
            seen.update(j for j in map(message_job_id, page) if j in wanted)
            if len(page) < PAGE:
                return seen, True
            start += PAGE - OVERLAP
        return seen, False

    def restore(self, tag: str) -> None:
        """Put a held message back at the head of its queue, as kombu does at a clean shutdown
        (one transaction: removed from `unacked` and pushed back, or neither)."""
        self.channel.qos.restore_by_tag(tag, client=self.client)
        self.client.hdel(HOLDERS_KEY, tag)


def holds(app: Celery, worker: str, job_id: str) -> bool | None:
    """Whether `worker` holds a message of job `job_id` now: its holder entry, and kombu's
    `unacked` entry beside it (an entry alone may be stale). None: the broker is not Redis,
    there is nothing to look at. One HSCAN of the holders hash (a short entry per message the
    workers hold), asked only when a claim finds the job running under another worker."""
    wanted = holder_entry(worker, job_id)
    with _redis_channel(app) as channel:
        if channel is None:
            return None
        client = channel.client
        for tag, entry in client.hscan_iter(HOLDERS_KEY, count=1000):
            if as_text(entry) == wanted and client.hexists(channel.unacked_key, tag):
                return True
    return False


# Job id -> the worker that gave the job's message back while the database was away, after it
# had claimed the job's row (ocrq/worker/claiming.py). The next claim finds the row `running` with
# an attempt made, which reads as a worker that died mid-run; this note says it did not.
GIVEN_BACK_KEY = "ocrq.given_back:"
# A message given back is delivered again within seconds to minutes (or after the visibility
# timeout, 1 h, if a worker died holding it); a week bounds notes whose job never came back.
GIVEN_BACK_TTL_S = 7 * 86400


class BrokerNotes:
    """What a Celery worker asks of the broker, and leaves with it, about jobs other workers
    may hold: `holds` for a second copy of a running job, `gave_back`/`given_back` for a job
    whose message went back to the queue with its row claimed. A broker that is not Redis
    answers None: nothing to look at, and a job is then treated as before these checks."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def holds(self, worker: str, job_id: str) -> bool | None:
        return holds(self.app, worker, job_id)

    def gave_back(self, job_id: str, worker: str) -> None:
        with _redis_channel(self.app) as channel:
            if channel is not None:
                channel.client.set(GIVEN_BACK_KEY + job_id, worker, ex=GIVEN_BACK_TTL_S)

    def given_back(self, job_id: str) -> str | None:
        """The worker that gave the job back, once: the note is taken (a later claim that finds
        the row running again is a worker that died, and is charged as one)."""
        with _redis_channel(self.app) as channel:
            if channel is None:
                return None
            pipe = channel.client.pipeline()  # MULTI/EXEC: GETDEL needs Redis 6.2
            pipe.get(GIVEN_BACK_KEY + job_id)
            pipe.delete(GIVEN_BACK_KEY + job_id)
            worker = pipe.execute()[0]
        return None if worker is None else as_text(worker)


def as_text(value: bytes | str) -> str:
    """A Redis reply as text: redis-py gives bytes unless its client decodes responses."""
    return value.decode() if isinstance(value, bytes) else value


@contextmanager
def _redis_channel(app: Celery) -> Iterator[Any]:
    """kombu's Redis channel of `app`'s broker, or None for a broker that is not Redis."""
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        yield channel if hasattr(channel, "unacked_key") else None


@contextmanager
def broker_view(app: Celery, queue: str) -> Iterator[BrokerView | None]:
    """The broker of `app` seen through kombu's Redis channel, or None for a broker that is
    not Redis (nothing can then be checked, and nothing is re-sent on a guess)."""
    with _redis_channel(app) as channel:
        yield None if channel is None else BrokerView(channel, queue)
