"""The broker's Redis, plain (`redis://`) or behind Redis Sentinel (`sentinel://`): the one
place that knows how to reach it.

Why Sentinel: a single Redis is the one part of ocrq that has no second copy; when its host
dies, producers cannot submit and workers cannot take jobs until a person brings it back.
Sentinel is Redis's own answer (a replica, and sentinels that promote it when the master stops
answering), and every client ocrq uses already speaks it: kombu's `sentinel://` transport (the
broker), Celery's `sentinel://` result backend and redis-py's `redis.sentinel.Sentinel`. None of
them is written here; this module hands each the same two facts, the sentinels' addresses (the
URL) and the master's name (OCRQ_BROKER_MASTER_NAME), the way each documents:

- kombu and Celery take `master_name` and `sentinel_kwargs` (how to talk to the sentinels
  themselves, e.g. their password) as transport options: `celery_options`;
- ocrq's own reads of Redis (the queue-depth gauge, tests) take a redis-py client from
  `broker_client`, which for Sentinel is `Sentinel(...).master_for(name)`: its pool asks the
  sentinels for the current master whenever it opens a connection, so after a failover the
  next command reaches the promoted replica.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from ocrq.core.broker_urls import is_redis as is_redis  # its callers import it from here
from ocrq.core.broker_urls import is_sentinel

if TYPE_CHECKING:
    import redis

    from ocrq.core.settings import Settings

SENTINEL_PORT = 26379
# Answering "who is the master" is one round trip on loopback or a LAN: a sentinel that does
# not answer within this is skipped for the next one, rather than holding a reconnect.
SENTINEL_TIMEOUT_S = 2.0


def shown_url(url: str) -> str:
    """The broker URL as logs and probes show it: each `;`-separated entry (Sentinel's list, a
    failover list) redacted on its own, since a password in the second entry would otherwise
    pass through (`redact_url` reads one URL's userinfo)."""
    from ocrq.core.contract import redact_url

    return ";".join(redact_url(part) for part in url.split(";"))


def sentinel_kwargs(settings: Settings) -> dict[str, Any]:
    """How to talk to the sentinels themselves (redis-py's `sentinel_kwargs`)."""
    kwargs: dict[str, Any] = {
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
    }
    if settings.broker_sentinel_password is not None:
        kwargs["password"] = settings.broker_sentinel_password.get_secret_value()
    return kwargs


def sentinel_options(settings: Settings) -> dict[str, Any]:
    """kombu's and Celery's transport options for a `sentinel://` URL; none for plain Redis."""
    if not is_sentinel(settings.broker_url):
        return {}
    return {
        "master_name": settings.broker_master_name,
        "sentinel_kwargs": sentinel_kwargs(settings),
    }


def celery_options(settings: Settings, result_backend: str | None) -> dict[str, Any]:
    """Celery configuration that points an app at the current master: the broker's transport
    options, and the result backend's when it is a `sentinel://` URL too (the backend named
    "broker" is the broker's own URL). Merged into an app's conf by every app ocrq makes."""
    conf: dict[str, Any] = {}
    options = sentinel_options(settings)
    if options:
        conf["broker_transport_options"] = options
    if result_backend is not None and is_sentinel(result_backend):
        conf["result_backend_transport_options"] = {
            "master_name": settings.broker_master_name,
            "sentinel_kwargs": sentinel_kwargs(settings),
        }
    return conf


def parse_sentinels(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The sentinels' (host, port) of a `sentinel://a:26379;sentinel://b:26379` URL, and the
    master's credentials and database, read from the first entry (as kombu reads them)."""
    entries = [e.strip() for e in url.split(";") if e.strip()]
    sentinels: list[tuple[str, int]] = []
    master: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        parts = urlsplit(entry)
        if parts.scheme.lower() != "sentinel" or not parts.hostname:
            raise ValueError(f"not a sentinel://host:port entry: {parts.scheme}://{parts.hostname}")
        sentinels.append((parts.hostname, parts.port or SENTINEL_PORT))
        if i == 0:
            if parts.username:
                master["username"] = unquote(parts.username)
            if parts.password:
                master["password"] = unquote(parts.password)
            db = parts.path.strip("/")
            master["db"] = int(db) if db else 0
    return sentinels, master


def broker_client(settings: Settings, **kwargs: Any) -> redis.Redis:
    """A redis-py client of the broker's Redis (the current master behind Sentinel). `kwargs`
    go to every connection to the master: socket timeouts, say."""
    import redis
    from redis.sentinel import Sentinel

    url = settings.broker_url
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    sentinels, master = parse_sentinels(url)
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs(settings))
    return sentinel.master_for(settings.broker_master_name, **master, **kwargs)
