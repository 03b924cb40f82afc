"""kombu's Redis transport, made to survive Redis going away and hostile messages.

When Redis restarts, kombu's channel drops its connection object before everything that uses
it has finished: an ack from a task thread, or the restore of unacked messages when the consumer
closes the broken channel, then fails with AttributeError instead of a connection error. Celery
calls that unrecoverable and the worker process dies. Here both are treated as what they are, a
lost connection: the messages stay in Redis's unacked set (Redis keeps it) and come back after
the visibility timeout, where a done row makes their redelivery a no-op. The worker meanwhile
reconnects as it does after any connection error.

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
from collections.abc import Callable, Collection, Sequence
from typing import Any

from kombu.transport import redis

from ocrq.core.broker_scan import HOLDERS_KEY, holder_entry
from ocrq.worker.envelope import (
    REFUSED_HEADER,
    Problem,
    excerpt,
    message_problem,
    refused,
    safe_text,
    task_refusal,
)

log = logging.getLogger(__name__)

# This process's worker name (ocrq/worker/runtime.py sets it before Celery consumes).
_holder: str | None = None


def set_holder(name: str) -> None:
    global _holder
    _holder = name


class TolerantQoS(redis.QoS):
    def append(self, message: Any, delivery_tag: Any) -> None:
        """Record which worker holds the message (ocrq/core/broker_scan.py), then let kombu
        record it in `unacked`. A worker killed with messages it had not started leaves them
        there; with the holder on record, the sweep of a live worker puts them back once this
        one's heartbeat stops, instead of the visibility timeout. Written first: an entry
        whose message never reached `unacked` is dropped by the next sweep."""
        if _holder is not None:
            job_id = (message.headers or {}).get("id")
            entry = holder_entry(_holder, job_id if isinstance(job_id, str) else None)
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

    def restore_unacked(self, client: Any = None) -> None:
        try:
            super().restore_unacked(client)
        except AttributeError:
            log.warning(
                "broker connection gone: %d unacked message(s) stay in Redis and are redelivered "
                "after the visibility timeout",
                len(self._delivered),
            )
            self._delivered.clear()


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
    )
    ocrq_task_queues: Collection[str] = ()
    ocrq_task_names: Collection[str] = ()
    ocrq_max_eta_s: float = float("inf")
    ocrq_link_tasks: Sequence[str] = ()
    # Whether the current read reached a delivery callback: an exception before that came from
    # decoding the popped item itself.
    _delivering = False

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        names = frozenset(self.ocrq_task_names) if queue in self.ocrq_task_queues else None
        deliver = self.connection._callbacks[queue]
        self.connection._callbacks[queue] = functools.partial(
            self._checked_deliver, queue, names, deliver
        )
        return result

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
                payload, self.ocrq_max_eta_s, dt.datetime.now(dt.UTC), self.ocrq_link_tasks
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
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            if self._delivering:
                raise
            # kombu could not decode the item BRPOP popped: it is gone from the list already.
            sample = getattr(exc, "doc", None) or f"{type(exc).__name__}: {exc}"
            _log_rejected(None, Problem(f"not a JSON message ({type(exc).__name__})", sample))
            return True


class TolerantRedisTransport(redis.Transport):
    Channel = TolerantChannel


TRANSPORT = f"{__name__}:TolerantRedisTransport"
