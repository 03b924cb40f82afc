"""Job webhooks: a signed POST of a job's outcome to its `callback_url`, off the GPU path.

Called once the job's row is final and committed; the POSTs happen in a small thread pool, so
a slow or dead receiver never holds a task thread (and through it a decoded-image slot) or the
batcher. A network failure, a 5xx or a 429 is tried again after an exponential backoff;
another 4xx is the receiver's final word, and so is a refusal by the URL-image address policy
(ocrq/intake/fetch.py: no internal address unless OCRQ_URL_ALLOW_NETWORKS allows it, since a
producer names the URL), which no retry can change: one WARNING, no retry.

Why a schedule rather than a retry loop in a thread: one receiver that hangs held a sender
thread for every try and every backoff sleep between them (6 tries x 15 s + 62 s), and four of
them held all four threads: a healthy receiver's webhook then came 153 s late. Here a thread
holds one try only (at most `TRY_S`); a retry waits in the schedule, not in a thread; one host
has at most one POST in flight; and retries (receivers already known to fail) may take at most
`RETRY_THREADS` of the threads, so a first try always finds one free soon.

At a warm shutdown (`close`) no retry is scheduled any more; the tries already due are made
for up to `CLOSE_S`, and what is left unsent is logged, with its count and the jobs it was for
(the rows are the record: `GET /jobs/{id}`). Receivers must accept a repeat (a redelivered
job that another worker also finished), keyed by `job_id`.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from ocrq.core.contract import redact_url
from ocrq.core.settings import Settings
from ocrq.intake.fetch import FetchError, post

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Ocrq-Signature"
THREADS = 8
RETRY_THREADS = 4  # of THREADS, at most this many busy with retries
MAX_WAIT_S = 300.0
TRY_S = 10.0  # one try's connect/read/write timeout and deadline, at most
CLOSE_S = 10.0  # at shutdown, how long the tries already due may still take
# Keys a webhook body never carries: `path` is the server-side source (an upload's path names
# OCRQ_UPLOAD_DIR); the producer knows its job by `job_id`.
HIDDEN = ("path",)


def signature(secret: bytes, timestamp: int, body: bytes) -> str:
    """`t=<unix time>,v1=<hex HMAC-SHA256 of "<t>." + body>`: the time is signed too, so a
    receiver can refuse an old call replayed (docs/security.md, Webhooks)."""
    mac = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def _host(url: str) -> str:
    try:
        return httpx.URL(url).netloc.decode("ascii", "replace")
    except Exception:  # the post refuses it with its reason
        return url


@dataclass(order=True)
class _Delivery:
    due: float
    seq: int
    url: str = field(compare=False)
    body: bytes = field(compare=False)
    key: str = field(compare=False)
    future: Future[bool] = field(compare=False)
    attempt: int = field(default=1, compare=False)


class Webhooks:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        secret = settings.webhook_secret
        self._secret = secret.get_secret_value().encode() if secret is not None else None
        # One try's limits: a receiver that hangs costs TRY_S a try, not the URL fetch's 15/30 s.
        self._try_settings = settings.model_copy(
            update={
                "url_timeout_s": min(settings.url_timeout_s, TRY_S),
                "url_deadline_s": min(settings.url_deadline_s, TRY_S),
            }
        )
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="ocrq-webhook")
        self._lock = threading.Condition()
        self._schedule: list[_Delivery] = []  # a heap by due time
        self._busy_hosts: set[str] = set()
        self._retrying = 0  # threads busy with a retry
        self._running = 0  # threads busy
        self._seq = itertools.count()
        self._closing = False
        self._dispatcher: threading.Thread | None = None

    def send(
        self,
        url: str,
        outcome: dict[str, Any],
        event: str = "job.finished",
        key: str | None = None,
    ) -> Future[bool] | None:
        """Queue the POST of `{"event": event, **outcome}` (less `HIDDEN`); returns at once
        (None when no secret is set: nothing is sent). `key` names it in the log (default:
        its job). The future says whether the receiver took it."""
        key = key or f"job {outcome.get('job_id')}"
        if self._secret is None:
            log.warning("%s has a callback_url but OCRQ_WEBHOOK_SECRET is not set: not sent", key)
            return None
        shown = {k: v for k, v in outcome.items() if k not in HIDDEN}
        body = json.dumps({"event": event, **shown}, ensure_ascii=False, default=str).encode()
        future: Future[bool] = Future()
        with self._lock:
            if self._closing:
                log.warning("webhook for %s not sent: the worker is stopping", key)
                future.set_result(False)
                return future
            heapq.heappush(
                self._schedule, _Delivery(time.monotonic(), next(self._seq), url, body, key, future)
            )
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(
                    target=self._dispatch, name="ocrq-webhooks", daemon=True
                )
                self._dispatcher.start()
            self._lock.notify_all()
        return future

    def _startable(self, now: float) -> _Delivery | None:
        """The first due delivery whose host has nothing in flight and that a thread may take."""
        if self._running >= THREADS:
            return None
        for delivery in sorted(d for d in self._schedule if d.due <= now):
            if _host(delivery.url) in self._busy_hosts:
                continue
            if delivery.attempt > 1 and self._retrying >= RETRY_THREADS:
                continue
            self._schedule.remove(delivery)
            heapq.heapify(self._schedule)
            return delivery
        return None

    def _dispatch(self) -> None:
        with self._lock:
            while True:
                if self._closing and not self._schedule and self._running == 0:
                    return
                now = time.monotonic()
                delivery = self._startable(now)
                if delivery is None:
                    due = [d.due - now for d in self._schedule if d.due > now]
                    self._lock.wait(min([*due, 1.0]))
                    continue
                self._running += 1
                self._retrying += delivery.attempt > 1
                self._busy_hosts.add(_host(delivery.url))
                self._pool.submit(self._try, delivery)

    def _try(self, delivery: _Delivery) -> None:
        try:
            verdict = self._post_once(delivery)
        except Exception:  # a bug: its traceback, and the webhook counts as not sent
            log.warning("webhook for %s failed", delivery.key, exc_info=True)
            verdict = False
        with self._lock:
            self._running -= 1
            self._retrying -= delivery.attempt > 1
            self._busy_hosts.discard(_host(delivery.url))
            if verdict is None:  # worth another try
                if delivery.attempt >= self.settings.webhook_attempts or self._closing:
                    log.warning(
                        "webhook for %s to %s: gave up%s",
                        delivery.key,
                        redact_url(delivery.url),
                        " (worker stopping)" if self._closing else " after every try",
                    )
                    delivery.future.set_result(False)
                else:
                    wait = self.settings.webhook_backoff_s * 2 ** (delivery.attempt - 1)
                    delivery.due = time.monotonic() + min(wait, MAX_WAIT_S)
                    delivery.attempt += 1
                    heapq.heappush(self._schedule, delivery)
            else:
                delivery.future.set_result(verdict)
            self._lock.notify_all()

    def _post_once(self, delivery: _Delivery) -> bool | None:
        """True: taken; False: refused for good; None: worth another try."""
        assert self._secret is not None
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: signature(self._secret, int(time.time()), delivery.body),
            "User-Agent": "ocrq-webhook",
        }
        try:
            status = post(delivery.url, delivery.body, headers, self._try_settings)
        except FetchError as exc:
            if exc.permanent:
                log.warning("webhook for %s: %s (%s); not retried", delivery.key, exc, exc.detail)
                return False
            log.info("webhook for %s: %s (%s)", delivery.key, exc, exc.detail)
            return None
        if status >= 500 or status == 429:
            log.info("webhook for %s: HTTP %d, will retry", delivery.key, status)
            return None
        if status >= 300:
            log.warning("webhook for %s: HTTP %d, not retried", delivery.key, status)
            return False
        return True

    def close(self, within_s: float = CLOSE_S) -> None:
        """Schedule no more retries; make the tries already due for up to `within_s`, then log
        what stays unsent (the rows remain the record)."""
        deadline = time.monotonic() + within_s
        with self._lock:
            self._closing = True
            # Retries waiting for their backoff are not made: only what is due now.
            now = time.monotonic()
            later = [d for d in self._schedule if d.due > now]
            self._schedule = [d for d in self._schedule if d.due <= now]
            heapq.heapify(self._schedule)
            self._lock.notify_all()
            while (self._schedule or self._running) and time.monotonic() < deadline:
                self._lock.wait(max(0.0, min(0.2, deadline - time.monotonic())))
            dropped = [*later, *self._schedule]
            self._schedule = []
            self._lock.notify_all()
        for delivery in dropped:
            delivery.future.set_result(False)
        if dropped:
            keys = ", ".join(d.key for d in dropped[:20])
            more = f" and {len(dropped) - 20} more" if len(dropped) > 20 else ""
            log.warning(
                "worker stopping: %d webhook(s) not sent (the rows are the record): %s%s",
                len(dropped),
                keys,
                more,
            )
        self._pool.shutdown(wait=False, cancel_futures=True)
