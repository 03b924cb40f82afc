"""What a broker (or result backend) URL names: plain Redis, or Redis behind Sentinel.

Pure tests of a URL's scheme, apart from ocrq/core/broker_redis.py (which reaches the broker
and takes a Settings): the settings' own validators need them, and importing broker_redis from
there made the two modules import each other.
"""

from __future__ import annotations

PLAIN_SCHEMES = ("redis://", "rediss://")
SENTINEL_SCHEME = "sentinel://"


def is_sentinel(url: str) -> bool:
    return url.strip().lower().startswith(SENTINEL_SCHEME)


def is_redis(url: str) -> bool:
    """A broker (or result backend) URL that names Redis, directly or through Sentinel."""
    return url.strip().lower().startswith((*PLAIN_SCHEMES, SENTINEL_SCHEME))
