"""Job webhooks: a signed POST of a job's outcome to its `callback_url`, off the GPU path.

Called once the job's row is final and committed; the POST itself happens in a small thread
pool, so a slow or dead receiver never holds a task thread (and through it a decoded-image
slot) or the batcher. Retried with exponential backoff (tenacity, as the database retries) on
a network failure, a 5xx or a 429; another 4xx is the receiver's final word. Sent through the
URL-image address policy (ocrq/intake/fetch.py): no internal address unless
OCRQ_URL_ALLOW_NETWORKS allows it, since a producer names the URL.

What is lost: a webhook still waiting for a retry when its worker stops is not sent (the row
is the record; `GET /jobs/{id}` answers). Receivers must accept a repeat (a redelivered job
that another worker also finished), keyed by `job_id`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_when_event_set,
    wait_exponential,
)

from ocrq.core.contract import redact_url
from ocrq.core.settings import Settings
from ocrq.intake.fetch import FetchError, post

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Ocrq-Signature"
THREADS = 4
MAX_WAIT_S = 300.0


def signature(secret: bytes, timestamp: int, body: bytes) -> str:
    """`t=<unix time>,v1=<hex HMAC-SHA256 of "<t>." + body>`: the time is signed too, so a
    receiver can refuse an old call replayed (docs/security.md, Webhooks)."""
    mac = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


class _Again(Exception):
    """An answer worth retrying (5xx, 429) or no answer at all."""


class Webhooks:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        secret = settings.webhook_secret
        self._secret = secret.get_secret_value().encode() if secret is not None else None
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="ocrq-webhook")
        # Set at shutdown: a backoff sleep ends at once and no further try is made, so a dead
        # receiver never holds up the worker's exit (the pool's threads are joined at exit).
        self._closing = threading.Event()

    def send(
        self,
        url: str,
        outcome: dict[str, Any],
        event: str = "job.finished",
        key: str | None = None,
    ) -> Future[bool] | None:
        """Queue the POST of `{"event": event, **outcome}`; returns at once (None when no
        secret is set: nothing is sent). `key` names it in the log (default: its job)."""
        key = key or f"job {outcome.get('job_id')}"
        if self._secret is None:
            log.warning("%s has a callback_url but OCRQ_WEBHOOK_SECRET is not set: not sent", key)
            return None
        body = json.dumps({"event": event, **outcome}, ensure_ascii=False, default=str).encode()
        return self._pool.submit(self._deliver, url, body, key)

    def _deliver(self, url: str, body: bytes, job_id: str) -> bool:
        assert self._secret is not None
        retrying = Retrying(
            retry=retry_if_exception_type(_Again),
            wait=wait_exponential(multiplier=self.settings.webhook_backoff_s, max=MAX_WAIT_S),
            stop=stop_after_attempt(self.settings.webhook_attempts)
            | stop_when_event_set(self._closing),
            sleep=self._closing.wait,
        )
        try:
            for attempt in retrying:
                with attempt:
                    return self._post_once(url, body, job_id)
        except RetryError:
            log.warning(
                "webhook for %s to %s: gave up%s",
                job_id,
                redact_url(url),
                " (worker stopping)" if self._closing.is_set() else " after every try",
            )
        return False

    def _post_once(self, url: str, body: bytes, job_id: str) -> bool:
        assert self._secret is not None
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: signature(self._secret, int(time.time()), body),
            "User-Agent": "ocrq-webhook",
        }
        try:
            status = post(url, body, headers, self.settings)
        except FetchError as exc:
            log.info("webhook for %s: %s (%s)", job_id, exc, exc.detail)
            raise _Again from None
        if status >= 500 or status == 429:
            log.info("webhook for %s: HTTP %d, will retry", job_id, status)
            raise _Again
        if status >= 300:
            log.warning("webhook for %s: HTTP %d, not retried", job_id, status)
            return False
        return True

    def close(self) -> None:
        """Stop retrying and drop webhooks not yet started (the rows remain the record)."""
        self._closing.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
