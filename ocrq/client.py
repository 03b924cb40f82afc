"""A small HTTP client for other apps: submit images to the ocrq api, read and wait for results.

Why a module of its own: a producer in another app should need neither Celery, nor the job
table, nor anything else of ocrq. This file imports only httpx and the standard library (the
import-layer contract keeps it so), so it may even be copied into another project as it is.

    from ocrq.client import Client
    with Client("http://127.0.0.1:8080", token="...") as ocr:
        ids = [ocr.submit("https://example.org/a.png"), ocr.submit(b"...png bytes...")]
        for job in ocr.wait(ids, timeout=300):
            print(job["job_id"], job["status"], job["text"])

The api is the one `ocrq api` (or `uvicorn ocrq.api.http:app`) serves (docs/producers.md,
docs/api.md).
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx

__all__ = ["FINAL", "Client", "OcrqError"]

# A job's status once it will not change: done, failed, cancelled, expired, or partial (a
# document some of whose pages failed). Anything else (queued, running, unknown) is pending.
FINAL = ("done", "failed", "partial", "cancelled", "expired")
# The api answers a long poll after at most OCRQ_API_MAX_WAIT_S; each request asks this long.
POLL_S = 30.0
MAX_LOOKUP = 500  # ids per lookup request, within the api's default OCRQ_API_MAX_BATCH


class OcrqError(Exception):
    """The api refused a request or could not serve it: `status` is the HTTP status (0 when no
    answer came), `detail` the api's explanation."""

    def __init__(self, status: int, detail: Any) -> None:
        self.status = status
        self.detail = detail
        super().__init__(f"ocrq api: HTTP {status}: {detail}")


def image_of(image: str | Path | bytes | Mapping[str, Any]) -> dict[str, Any]:
    """What a job names as its image: a URL string as a URL, a path as a path (the worker must
    be allowed to read it), bytes inline (base64), a dict as given (`{"path"|"url"|"b64": ..}`)."""
    if isinstance(image, Mapping):
        return dict(image)
    if isinstance(image, bytes | bytearray | memoryview):
        return {"b64": base64.b64encode(bytes(image)).decode("ascii")}
    text = str(image)
    if text.startswith(("http://", "https://")):
        return {"url": text}
    return {"path": str(Path(text).expanduser().resolve())}


class Client:
    """The ocrq HTTP api's jobs, from another app.

    `base_url` and `token` default to OCRQ_API_URL and OCRQ_API_TOKEN. One httpx.Client is
    kept (connections are reused); close it, or use the client as a context manager.
    """

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        base_url = base_url or os.environ.get("OCRQ_API_URL") or "http://127.0.0.1:8080"
        token = token if token is not None else os.environ.get("OCRQ_API_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # The long polls below last up to POLL_S on the server: the read timeout allows that.
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout, read=max(timeout, POLL_S + 15)),
            transport=transport,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, url: str, **kwargs: Any) -> Any:
        try:
            answer = self._http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise OcrqError(0, f"{type(exc).__name__}: {exc} ({self._http.base_url})") from exc
        if answer.status_code >= 400:
            try:
                detail = answer.json().get("detail", answer.text)
            except ValueError:
                detail = answer.text
            raise OcrqError(answer.status_code, detail)
        return answer.json()

    def submit(
        self,
        image: str | Path | bytes | Mapping[str, Any],
        task: str = "text",
        job_id: str | None = None,
        max_pixels: int | None = None,
        expires_at: dt.datetime | None = None,
        callback_url: str | None = None,
        priority: str | None = None,
        batch: str | None = None,
        max_new_tokens: int | None = None,
    ) -> str:
        """Enqueue one job; its id. With `job_id` (a UUID) a retry is idempotent: the same id
        and image return the job already recorded. `expires_at`: not run after it (the job
        ends `expired`); `callback_url`: POSTed the outcome, signed (docs/api.md);
        `priority="interactive"`: ahead of the bulk backlog (a live app's jobs); the default is
        "bulk"; `batch`: your name for a group of jobs (`batch()` follows it);
        `max_new_tokens`: the job's cap on new tokens (at most the workers' own), kept when
        the job is sent again."""
        body: dict[str, Any] = {"image": image_of(image), "task": task}
        if priority is not None:
            body["priority"] = priority
        if batch is not None:
            body["batch"] = batch
        if job_id is not None:
            body["job_id"] = job_id
        if max_pixels is not None:
            body["max_pixels"] = max_pixels
        if max_new_tokens is not None:
            body["max_new_tokens"] = max_new_tokens
        if expires_at is not None:
            body["expires_at"] = expires_at.isoformat()
        if callback_url is not None:
            body["callback_url"] = callback_url
        return str(self._call("POST", "/jobs", json=body)["job_id"])

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job not final yet; its row, now `cancelled`. A final job raises OcrqError
        409, an unknown id 404."""
        return dict(self._call("DELETE", f"/jobs/{job_id}"))

    def batch(self, name: str) -> dict[str, Any]:
        """A batch's jobs counted by status, its documents, first and last finish, and
        `eta_s` from its own completion rate; `final` once every job is. Unknown: 404."""
        return dict(self._call("GET", f"/batches/{name}"))

    def retry(self, batch: str | None = None, job_ids: Iterable[str] | None = None) -> list[str]:
        """Run the failed jobs of `batch` (and/or `job_ids`) again; the ids sent again."""
        body: dict[str, Any] = {}
        if batch is not None:
            body["batch"] = batch
        if job_ids is not None:
            body["job_ids"] = list(job_ids)
        return list(self._call("POST", "/jobs/retry", json=body)["job_ids"])

    def get(self, job_id: str, wait: float = 0.0) -> dict[str, Any]:
        """The job's row (status, text, lines with boxes, error, ...); with `wait`, answered
        once it is final or after `wait` s (the api caps one wait at OCRQ_API_MAX_WAIT_S).
        An unknown id raises OcrqError with status 404."""
        return dict(self._call("GET", f"/jobs/{job_id}", params={"wait": wait}))

    def wait(self, job_ids: Iterable[str], timeout: float | None = None) -> list[dict[str, Any]]:
        """Every job's row, in the order given, once all are final (FINAL) or `timeout` s
        passed (None: no limit); check each row's status. Long polls, no busy loop."""
        ids = list(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        rows: dict[str, dict[str, Any]] = {}
        pending = list(ids)
        delay = 0.05
        while True:
            left = POLL_S if deadline is None else max(0.0, deadline - time.monotonic())
            asked_at = time.monotonic()
            for start in range(0, len(pending), MAX_LOOKUP):
                chunk = pending[start : start + MAX_LOOKUP]
                wait = min(POLL_S, left) if start == 0 else 0.0
                got = self._call("POST", "/jobs/lookup", json={"job_ids": chunk, "wait": wait})
                for asked, row in zip(chunk, got["jobs"], strict=True):
                    rows[asked] = row
            pending = [j for j in ids if rows[j]["status"] not in FINAL]
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                return [rows[j] for j in ids]
            if time.monotonic() - asked_at < min(1.0, left):
                # The api answered at once although jobs are pending: ids it has no row for
                # (yet: a bare producer's job gets its row when a worker claims it) end its
                # long poll. Back off instead of asking in a tight loop.
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
