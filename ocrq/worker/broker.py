"""kombu's Redis transport, made to survive Redis going away and hostile messages.

When Redis restarts, kombu's channel drops its connection object before everything that uses
it has finished: an ack from a task thread, or the restore of unacked messages when the consumer
closes the broken channel, then fails with AttributeError instead of a connection error. Celery
calls that unrecoverable and the worker process dies. Here both are treated as what they are, a
lost connection: the messages stay in Redis's unacked set (Redis keeps it) and come back after
the visibility timeout, where a done row makes their redelivery a no-op. The worker meanwhile
reconnects as it does after any connection error. Messages it had taken but not started (Celery
drops them with the connection), and one it was taking as the connection broke, would wait
there too: the reconnected channel puts them back on their queue instead (`NotStarted`). The
same holds after a Sentinel failover, where the promoted replica holds the `unacked` hash
(`TolerantSentinelChannel`).

Malformed messages (see ocrq/worker/envelope.py) are rejected here, at the one place that sees every
message as it leaves Redis and before kombu builds a Message from it: the channel's per-queue
delivery callback. Why here and not in Celery's hooks (`on_decode_error`, `on_unknown_message`,
`on_invalid_task`): a message that is not JSON, not an object, without properties or with an
undecodable body fails inside kombu, before any Celery hook runs, and Celery's hooks themselves
let some shapes through to code that raises in the event loop (a JSON-string body kills the
worker from `Request.__init__`). Rejecting here is also the cheapest possible rejection: BRPOP
has already removed the message from the list and it is not yet in the unacked set, so not
delivering it removes it for good: one WARNING line, no redelivery, no loop. As a last resort,
anything that still raises while Celery takes a delivered message (other than a connection
error) rejects that message instead of killing the worker.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from queue import Empty
from typing import Any

from kombu.transport import redis

from ocrq.core.broker_scan import HOLDERS_KEY, holder_entry
from ocrq.core.contract import message_job_id
from ocrq.core.process import STATE
from ocrq.worker.envelope import (
    REFUSED_HEADER,
    Problem,
    excerpt,
    message_problem,
    refused,
    safe_text,
    task_refusal,
)
from ocrq.worker.lane_fetch import LaneOrder

log = logging.getLogger(__name__)

def delivered_job_id(message: Any) -> str | None:
    """The job a delivered message runs, as the task will name it: the `job_id` of its kwargs,
    else its task id, in their canonical spelling (ocrq/core/contract.py `message_job_id`).

    Why not the task id alone: a bare producer may send `job_id` with a task id of Celery's
    own, and two copies of one job then carry two task ids. A holder entry under the task id
    did not match the job's row, so a second copy took over a job its worker still held and ran
    it twice. The body is decoded through kombu's memo, the decode Celery's request makes next
    anyway; anything undecodable is named by its task id (the task refuses it)."""
    task_id = (message.headers or {}).get("id")
    try:
        payload = message.decode()
        kwargs = payload[1] if isinstance(payload, list | tuple) and len(payload) > 1 else None
        return message_job_id(kwargs, task_id)
    except Exception:  # a name for the holder entry, never a reason to fail
        return task_id if isinstance(task_id, str) else None


class TolerantQoS(redis.QoS):
    def append(self, message: Any, delivery_tag: Any) -> None:
        """Record which worker holds the message (ocrq/core/broker_scan.py), then let kombu
        record it in `unacked`. A worker killed with messages it had not started leaves them
        there; with the holder on record, the sweep of a live worker puts them back once this
        one's heartbeat stops, instead of the visibility timeout. Written first: an entry
        whose message never reached `unacked` is dropped by the next sweep."""
        holder = STATE.worker_name  # set by ocrq/worker/runtime.py before Celery consumes
        if holder is not None:
            entry = holder_entry(holder, delivered_job_id(message))
            with self.channel.conn_or_acquire() as client:
                client.hset(HOLDERS_KEY, delivery_tag, entry)
        super().append(message, delivery_tag)

    def _remove_from_indices(self, delivery_tag: Any, pipe: Any = None) -> Any:
        """kombu's removal from `unacked` (ack, reject, restore) also drops the holder."""
        return super()._remove_from_indices(delivery_tag, pipe).hdel(HOLDERS_KEY, delivery_tag)

    def ack(self, delivery_tag: Any) -> None:
        try:
            super().ack(delivery_tag)
        except AttributeError:
            log.warning(
                "broker connection gone: message %s stays unacked in Redis and is redelivered "
                "after the visibility timeout",
                delivery_tag,
            )
        except self.channel.connection_errors:
            # The task is over with it (done, or failed before its body: its STARTED state
            # goes to the broker's Redis too), but Redis keeps it: put it back once reconnected.
            # Its redelivery finds a done row final, or runs a job that never started.
            _not_started.defer_acked(delivery_tag)

    def restore_unacked(self, client: Any = None) -> None:
        """kombu puts back, as the channel closes, every message it delivered and that was not
        acked. When the connection is what broke, that fails: Redis keeps them in its `unacked`
        hash, where they would wait for the visibility timeout. Those Celery has not started
        (it forgets them as the connection goes: they "can't be acked anyway") are put back once
        the worker has reconnected instead (`restore_after_reconnect`); those it is running stay
        unacked, so their redelivery finds the row done rather than running them twice."""
        delivered = dict(self._delivered)
        try:
            super().restore_unacked(client)
            return
        except (AttributeError, *self.channel.connection_errors):
            self._delivered.clear()
        _not_started.defer(delivered)


class NotStarted:
    """Messages the broken connection left in Redis's `unacked`, kept until a reconnected
    channel can put them back on their queue, each once its job no longer runs in this process.

    Why every one, not only those Celery never started: a task that had started may still end
    without running its body (its STARTED state goes to the result backend, the broker's Redis,
    and that write fails with the connection: "Exception raised outside body"), its row left
    `queued`. Putting back the message of a job that finished costs one delivery that finds its
    row final; leaving one costs the visibility timeout. Process-wide: Celery reconnects with a
    new connection, transport and channel."""

    RECHECK_S = 2.0  # how often jobs still running are looked at again

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tags: dict[str, str | None] = {}  # delivery tag -> job id (Celery's task id)
        self._recheck: threading.Timer | None = None

    def defer(self, delivered: dict[str, Any]) -> None:
        with self._lock:
            for tag, message in delivered.items():
                self._tags.setdefault(tag, _job_id(message))  # an acked one stays unchecked
        log.warning(
            "broker connection gone: %d unacked message(s) stay in Redis; each goes back to the "
            "queue once the worker has reconnected and its job no longer runs here",
            len(delivered),
        )

    def defer_acked(self, tag: str) -> None:
        """An ack that failed: put back whether or not the job runs (no job id to check)."""
        with self._lock:
            self._tags[tag] = None
        log.warning("broker connection gone: message %s acked, put back once reconnected", tag)

    def defer_taken(self, tag: str, job_id: str | None) -> None:
        """A message popped while the connection broke, before kombu's `unacked` record came
        back acknowledged: Redis may hold it there (the write happened, its reply was lost).
        Where the write did not happen it is in neither place and its row stays `queued`
        (`ocrq requeue`)."""
        with self._lock:
            self._tags[tag] = job_id
        log.warning(
            "broker connection gone while taking message %s: put back once reconnected if "
            "Redis holds it",
            tag,
        )

    def restore(self, qos: redis.QoS, client: Any) -> None:
        """Put back each message whose job does not run here now (kombu's restore: one
        transaction; nothing for a tag no longer in `unacked`, e.g. acked). The others are
        looked at again in RECHECK_S; a broker that fails again keeps them all."""
        with self._lock:
            tags = dict(self._tags)
        if not tags:
            return
        running = _running_job_ids()
        put_back = 0
        for tag, job_id in tags.items():
            if job_id is not None and job_id in running:
                continue
            if client.hexists(qos.unacked_key, tag):  # for the count: restore is a no-op then
                qos.restore_by_tag(tag, client=client)
                put_back += 1
            with self._lock:
                self._tags.pop(tag, None)
        if put_back:
            log.warning("reconnected: put back %d message(s) left unacked", put_back)
        with self._lock:
            if self._tags and (self._recheck is None or not self._recheck.is_alive()):
                self._recheck = threading.Timer(self.RECHECK_S, self._again, (qos, client))
                self._recheck.daemon = True
                self._recheck.start()

    def _again(self, qos: redis.QoS, client: Any) -> None:
        with self._lock:
            self._recheck = None  # this timer: the next restore may start another
        try:
            self.restore(qos, client)
        except Exception as exc:  # the channel went too: the next reconnect tries again
            log.warning("messages left unacked kept for the next reconnect: %s", exc)


_not_started = NotStarted()


def _job_id(message: Any) -> str | None:
    headers = getattr(message, "headers", None)
    job_id = headers.get("id") if isinstance(headers, dict) else None
    return job_id if isinstance(job_id, str) else None


def _running_job_ids() -> set[str]:
    """The task ids of the requests Celery's pool runs now (its own worker state)."""
    from celery.worker.state import active_requests

    return {request.id for request in tuple(active_requests)}


def _log_rejected(queue: str | None, problem: Problem) -> None:
    log.warning(
        "rejected a malformed message%s (removed, not redelivered): %s; message: %s",
        f" from queue {safe_text(queue, 60)!r}" if queue else "",
        safe_text(problem.reason, 200),
        excerpt(problem.sample),
    )


class TolerantChannel(redis.Channel):
    QoS = TolerantQoS
    # Set by ocrq/worker/celery_app.py through broker_transport_options: the queues that carry
    # tasks, and the task names they may carry, get Celery's task protocol checked too.
    from_transport_options = (
        *redis.Channel.from_transport_options,
        "ocrq_task_queues",
        "ocrq_task_names",
        "ocrq_max_eta_s",
        "ocrq_link_tasks",
        "ocrq_link_queues",
        "ocrq_bulk_max_wait_s",
    )
    ocrq_task_queues: Collection[str] = ()
    ocrq_task_names: Collection[str] = ()
    ocrq_max_eta_s: float = float("inf")
    ocrq_link_tasks: Sequence[str] = ()
    ocrq_link_queues: Sequence[str] = ()
    # None: kombu's own queue order (queue_order_strategy); a number: the lanes' order with the
    # bulk lane never starved longer than that (ocrq/worker/lane_fetch.py).
    ocrq_bulk_max_wait_s: float | None = None
    # Whether the current read reached a delivery callback: an exception before that came from
    # decoding the popped item itself.
    _delivering = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.ocrq_bulk_max_wait_s is not None:
            self._queue_cycle = LaneOrder(self.ocrq_bulk_max_wait_s)
            self._update_queue_cycle()

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self.restore_after_reconnect()
        names = frozenset(self.ocrq_task_names) if queue in self.ocrq_task_queues else None
        deliver = self.connection._callbacks[queue]
        self.connection._callbacks[queue] = functools.partial(
            self._checked_deliver, queue, names, deliver
        )
        return result

    def restore_after_reconnect(self) -> None:
        """Messages dropped unstarted by the connection that broke (TolerantQoS), put back
        through this one; kept for the next channel while the broker still fails."""
        try:
            _not_started.restore(self.qos, self.client)
        except self.connection_errors as exc:
            log.warning("broker still failing; messages to put back kept: %s", exc)

    def _checked_deliver(
        self,
        queue: str,
        task_names: frozenset[str] | None,
        deliver: Callable[[Any], Any],
        payload: Any,
    ) -> Any:
        self._delivering = True
        problem = message_problem(payload, task_names)
        if problem is not None:
            _log_rejected(queue, problem)
            return None
        if task_names is not None:
            payload = self._refusing(queue, payload)
            if payload is None:
                return None
        try:
            return deliver(payload)
        except self.connection_errors:
            tag = (payload.get("properties") or {}).get("delivery_tag")
            job_id = (payload.get("headers") or {}).get("id")
            if isinstance(tag, str):
                _not_started.defer_taken(tag, job_id if isinstance(job_id, str) else None)
            raise
        except Exception as exc:
            self.qos.reject(payload["properties"]["delivery_tag"], requeue=False)
            reason = f"{type(exc).__name__} while the worker took it: {exc}"
            _log_rejected(queue, Problem(reason, payload.get("headers") or payload))
            return None

    def _refusing(self, queue: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        """A task message that must fail its job (envelope.task_refusal), rewritten to reach
        the task at once, without links, carrying why; a protocol 1 one is rejected."""
        headers = payload.get("headers")
        if isinstance(headers, dict) and REFUSED_HEADER in headers:  # only ours counts
            payload = {
                **payload,
                "headers": {k: v for k, v in headers.items() if k != REFUSED_HEADER},
            }
        try:
            reason = task_refusal(
                payload, self.ocrq_max_eta_s, dt.datetime.now(dt.UTC), self.ocrq_link_tasks,
                self.ocrq_link_queues,
            )
            rewritten = refused(payload, reason) if reason is not None else None
        except Exception as exc:  # checked sound already; never let it reach the event loop
            _log_rejected(queue, Problem(f"{type(exc).__name__}: {exc}", payload.get("headers")))
            return None
        if reason is None:
            return payload
        if rewritten is None:
            _log_rejected(queue, Problem(reason, payload.get("headers") or payload))
        return rewritten

    def _brpop_read(self, **options: Any) -> Any:
        self._delivering = False
        try:
            return super()._brpop_read(**options)
        except Empty:
            if isinstance(self._queue_cycle, LaneOrder):
                self._queue_cycle.fetched(None)
            raise
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            if self._delivering:
                raise
            # kombu could not decode the item BRPOP popped: it is gone from the list already.
            sample = getattr(exc, "doc", None) or f"{type(exc).__name__}: {exc}"
            _log_rejected(None, Problem(f"not a JSON message ({type(exc).__name__})", sample))
            return True


class _BrokerWait:
    """Whether this process has reached its broker, for the probes and the log.

    Why here: Celery retries a broker it cannot reach for ever, logging only its own "Cannot
    connect ... Trying again" lines, and no signal of Celery's marks a connection made (its
    `worker_ready` comes later, and not at all while the broker stays away); the transport's
    `establish_connection` (a channel that pings Redis) is the one call every connection
    attempt, the consumer's and the event dispatcher's, goes through. A failed one sets the
    gauge /readyz names the wait from (ocrq/worker/health.py) and, the first time until a
    connection succeeds, logs one WARNING naming OCRQ_BROKER_URL; a successful one clears it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = False

    def failed(self, exc: BaseException) -> None:
        from ocrq.core import metrics
        from ocrq.core.broker_redis import shown_url

        with self._lock:
            if self._waiting:
                return
            self._waiting = True
        metrics.BROKER_WAIT_SINCE.set(time.time())
        settings = STATE.settings
        url = shown_url(settings.broker_url) if settings is not None else "(not configured)"
        log.warning(
            "broker not reachable at OCRQ_BROKER_URL=%s: %s: %s; retrying until it answers "
            "(/readyz says so meanwhile)", url, type(exc).__name__, exc,
        )

    def reached(self) -> None:
        from ocrq.core import metrics

        with self._lock:
            if not self._waiting:
                return
            self._waiting = False
        metrics.BROKER_WAIT_SINCE.set(0)
        log.info("broker reached")


BROKER_WAIT = _BrokerWait()


class _WatchedConnect:
    """A transport whose connection attempts are reported to `BROKER_WAIT`."""

    def establish_connection(self) -> Any:
        try:
            connection = super().establish_connection()  # type: ignore[misc]
        except Exception as exc:
            BROKER_WAIT.failed(exc)
            raise
        BROKER_WAIT.reached()
        return connection


class TolerantRedisTransport(_WatchedConnect, redis.Transport):
    Channel = TolerantChannel


class TolerantSentinelChannel(TolerantChannel, redis.SentinelChannel):
    """The same channel, its connections to whichever Redis the sentinels name master
    (kombu's SentinelChannel; ocrq/core/broker_redis.py says why Sentinel)."""

    from_transport_options = tuple(
        dict.fromkeys(
            (*TolerantChannel.from_transport_options, *redis.SentinelChannel.from_transport_options)
        )
    )


class TolerantSentinelTransport(_WatchedConnect, redis.SentinelTransport):
    Channel = TolerantSentinelChannel


TRANSPORT = f"{__name__}:TolerantRedisTransport"
SENTINEL_TRANSPORT = f"{__name__}:TolerantSentinelTransport"


def keep_transport_on_reconnect() -> None:
    """Make the URL schemes name these transports in this (worker) process.

    Celery's `broker_transport` picks them for the first connection only: when a reconnect
    attempt fails, kombu's failover (`Connection.switch`, also with a single URL) derives the
    transport from the URL's scheme again, and the worker went on consuming through kombu's own,
    without the checks and restores above (seen after every Sentinel failover: the sentinels
    name the dead master for a second or two)."""
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES.update(redis=TRANSPORT, rediss=TRANSPORT, sentinel=SENTINEL_TRANSPORT)
