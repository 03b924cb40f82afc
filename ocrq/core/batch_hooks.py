"""A batch's webhook (`callback_url` on POST /jobs/batch): where it waits until the batch ends.

Kept in the broker's Redis, one hash field per batch (`KEY`), not in PostgreSQL: a batch has no
row of its own (it is a name on job rows), and the api already reaches that Redis to send the
jobs. The api registers the URL before it sends the batch's jobs, so a batch cannot end before
its webhook is known. Workers fire it (ocrq/worker/batch_hooks.py): `take` reads and deletes
the field in one MULTI, so of all the workers that see the batch final exactly one gets the URL
and sends it. What is lost: the registration with a Redis that loses its data (no persistence,
a failover before the replica had it); the batch's rows, `GET /batches/{id}`, remain the record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

KEY = "ocrq:batch-callbacks"


def register(client: redis.Redis, batch: str, url: str) -> None:
    """The batch's webhook: the last one registered for a batch name wins."""
    client.hset(KEY, batch, url)


def waiting(client: redis.Redis, batch: str) -> bool:
    """Whether the batch has a webhook not sent yet."""
    return bool(client.hexists(KEY, batch))


def take(client: redis.Redis, batch: str) -> str | None:
    """The batch's webhook, removed: for one caller only, however many ask at once."""
    with client.pipeline(transaction=True) as pipe:
        pipe.hget(KEY, batch)
        pipe.hdel(KEY, batch)
        url, deleted = pipe.execute()
    if not deleted or url is None:
        return None
    return url.decode() if isinstance(url, bytes) else str(url)
