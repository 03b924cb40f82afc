"""`ocrq_queue_depth`: messages waiting in the broker queues this worker consumes.

Read when Prometheus scrapes, not on a timer: one pipelined LLEN per list, so the figure is
as fresh as the scrape and costs nothing between scrapes. Kombu's Redis transport keeps a
queue as one list per priority step (`ocr`, then `ocr\\x06\\x163`, ... for priorities 3, 6, 9);
the names come from kombu itself so they cannot drift from what the workers pop.

Served next to the worker's own metrics on OCRQ_METRICS_PORT (ocrq/worker/monitor.py). It is
the broker's figure (labelled with its lane: `ocr.interactive` is the interactive one), so
every worker reports the same number: aggregate with `max()`, not
`sum()`. KEDA reads the same lists itself (deploy/k8s/worker.yaml), which also works while no
worker runs to export this gauge (scaling from zero).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import redis
from kombu.transport.redis import PRIORITY_STEPS, Channel
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ocrq.core.broker_redis import broker_client, is_redis
from ocrq.core.contract import INTERACTIVE, lane_of_queue, queue_for
from ocrq.core.settings import Settings

log = logging.getLogger(__name__)

TIMEOUT_S = 2.0  # a scrape must answer even when Redis does not


def consumed_queues(settings: Settings) -> list[str]:
    """The queues `ocrq worker` consumes, in the order it polls them: OCRQ_QUEUE's interactive
    lane first, then OCRQ_QUEUE (bulk), and Celery's default queue where a bare `send_task`
    lands (OCRQ_CONSUME_DEFAULT_QUEUE)."""
    from celery.app.defaults import DEFAULTS

    queues = [queue_for(INTERACTIVE, settings.queue), settings.queue]
    default = DEFAULTS["task_default_queue"]
    if settings.consume_default_queue and default not in queues:
        queues.append(default)
    return queues


def priority_lists(queue: str) -> list[str]:
    """The Redis lists kombu keeps `queue`'s messages in, one per priority step."""
    return [queue if step == 0 else f"{queue}{Channel.sep}{step}" for step in PRIORITY_STEPS]


class QueueDepth(Collector):
    def __init__(self, settings: Settings, queues: list[str]) -> None:
        self.queues = queues
        self._client = broker_client(
            settings, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )

    def depths(self) -> dict[str, int]:
        with self._client.pipeline(transaction=False) as pipe:
            for queue in self.queues:
                for name in priority_lists(queue):
                    pipe.llen(name)
            sizes = iter(pipe.execute())
        return {q: sum(next(sizes) for _ in PRIORITY_STEPS) for q in self.queues}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "ocrq_queue_depth",
            "Messages waiting in the broker queue (read from Redis at scrape time)",
            labels=["queue", "lane"],
        )
        try:
            depths = self.depths()
        except redis.RedisError as exc:  # no figure rather than a wrong one; health says more
            log.warning("ocrq_queue_depth: cannot read the queue lengths: %s", exc)
            return
        for queue, depth in depths.items():
            family.add_metric([queue, lane_of_queue(queue)], depth)
        yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("ocrq_queue_depth", "", labels=["queue", "lane"])


def queue_depth_registry(settings: Settings) -> CollectorRegistry | None:
    """A registry holding the gauge, or None for a broker that is not Redis."""
    if not is_redis(settings.broker_url):
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(QueueDepth(settings, consumed_queues(settings)))
    return registry
