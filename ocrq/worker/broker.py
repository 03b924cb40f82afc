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

import functools
import logging
from collections.abc import Callable, Collection
from typing import Any

from kombu.transport import redis

from ocrq.worker.envelope import Problem, excerpt, message_problem, safe_text

log = logging.getLogger(__name__)


class TolerantQoS(redis.QoS):
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
    )
    ocrq_task_queues: Collection[str] = ()
    ocrq_task_names: Collection[str] = ()
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
        try:
            return deliver(payload)
        except self.connection_errors:
            raise
        except Exception as exc:
            self.qos.reject(payload["properties"]["delivery_tag"], requeue=False)
            reason = f"{type(exc).__name__} while the worker took it: {exc}"
            _log_rejected(queue, Problem(reason, payload.get("headers") or payload))
            return None

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


class TolerantSentinelChannel(TolerantChannel, redis.SentinelChannel):
    """The same channel, its connections to whichever Redis the sentinels name master
    (kombu's SentinelChannel; ocrq/core/broker_redis.py says why Sentinel)."""

    from_transport_options = tuple(
        dict.fromkeys(
            (*TolerantChannel.from_transport_options, *redis.SentinelChannel.from_transport_options)
        )
    )


class TolerantSentinelTransport(redis.SentinelTransport):
    Channel = TolerantSentinelChannel


TRANSPORT = f"{__name__}:TolerantRedisTransport"
SENTINEL_TRANSPORT = f"{__name__}:TolerantSentinelTransport"
