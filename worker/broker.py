"""kombu's Redis transport, made to survive Redis going away while tasks are in flight.

When Redis restarts, kombu's channel drops its connection object before everything that uses
it has finished: an ack from a task thread, or the restore of unacked messages when the consumer
closes the broken channel, then fails with AttributeError instead of a connection error. Celery
calls that unrecoverable and the worker process dies. Here both are treated as what they are, a
lost connection: the messages stay in Redis's unacked set (Redis keeps it) and come back after
the visibility timeout, where a done row makes their redelivery a no-op. The worker meanwhile
reconnects as it does after any connection error.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis

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


class TolerantChannel(redis.Channel):
    QoS = TolerantQoS


class TolerantRedisTransport(redis.Transport):
    Channel = TolerantChannel


TRANSPORT = f"{__name__}:TolerantRedisTransport"
