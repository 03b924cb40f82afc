"""The webhook sender (ocrq/worker/webhooks.py) against real HTTP receivers on loopback:
receivers that hang do not hold up a healthy one, a policy refusal is not retried, a warm
shutdown sends what is due and names what it drops, and bodies leave out the server's path."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ocrq.core.settings import Settings
from ocrq.worker import webhooks as webhooks_module
from ocrq.worker.webhooks import Webhooks


class Receiver:
    """A loopback HTTP server that records every POST body; `delay_s` before answering."""

    def __init__(self, delay_s: float = 0.0, status: int = 200) -> None:
        self.bodies: list[dict[str, object]] = []
        self.arrived: list[float] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(length))
                time.sleep(delay_s)
                receiver.bodies.append(body)
                receiver.arrived.append(time.monotonic())
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Hanging:
    """Accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"

    def close(self) -> None:
        self.sock.close()


def _settings(**fields: object) -> Settings:
    given: dict[str, object] = {
        "webhook_secret": "a-test-secret-of-some-length",
        "url_allow_networks": ["127.0.0.0/8"],
        "webhook_backoff_s": 0.2,
        **fields,
    }
    return Settings(**given)  # type: ignore[arg-type]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_hanging_receivers_do_not_delay_a_healthy_one(receiver: Receiver) -> None:
    hanging = [Hanging() for _ in range(6)]
    hooks = Webhooks(_settings())
    try:
        for i, h in enumerate(hanging):
            hooks.send(h.url, {"job_id": f"hung-{i}", "status": "done"})
        time.sleep(0.3)  # the hung tries have taken their threads
        sent = time.monotonic()
        future = hooks.send(receiver.url, {"job_id": "fast", "status": "done"})
        assert future is not None and future.result(timeout=8) is True
        # Four hung receivers held all four threads for 6 x 15 s + backoff (seen 153 s).
        assert receiver.arrived[0] - sent < 3.0
    finally:
        hooks.close(within_s=0)
        for h in hanging:
            h.close()


def test_a_policy_refusal_is_not_retried(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    hooks = Webhooks(_settings(url_allow_networks=[]))
    caplog.set_level(logging.INFO, logger=webhooks_module.__name__)
    try:
        future = hooks.send(receiver.url, {"job_id": "loop", "status": "done"})
        assert future is not None and future.result(timeout=5) is False
        lines = [r for r in caplog.records if "loop" in r.getMessage()]
        assert len(lines) == 1 and "not retried" in lines[0].getMessage(), lines
        assert receiver.bodies == []
    finally:
        hooks.close(within_s=0)


def test_warm_shutdown_sends_what_is_due_and_names_what_it_drops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    slow = Receiver(delay_s=0.2)  # healthy, one POST at a time
    failing = Receiver(status=503)
    hooks = Webhooks(_settings(webhook_backoff_s=30))
    caplog.set_level(logging.INFO, logger=webhooks_module.__name__)
    try:
        futures = [hooks.send(slow.url, {"job_id": f"ok-{i}"}) for i in range(5)]
        retried = hooks.send(failing.url, {"job_id": "retry-later"})
        assert retried is not None
        deadline = time.monotonic() + 5
        while not failing.bodies and time.monotonic() < deadline:
            time.sleep(0.05)
        hooks.close(within_s=8)
        assert all(f is not None and f.result(timeout=1) for f in futures)
        assert len(slow.bodies) == 5
        assert retried.result(timeout=1) is False
        dropped = [r.getMessage() for r in caplog.records if "not sent" in r.getMessage()]
        assert len(dropped) == 1 and "1 webhook(s)" in dropped[0], dropped
        assert "job retry-later" in dropped[0]
    finally:
        slow.close()
        failing.close()


def test_the_body_leaves_out_the_servers_path(receiver: Receiver) -> None:
    hooks = Webhooks(_settings())
    try:
        outcome = {"job_id": "j", "path": "/srv/ocrq/uploads/ab/abcdef", "status": "done"}
        future = hooks.send(receiver.url, outcome)
        assert future is not None and future.result(timeout=5) is True
        assert receiver.bodies == [{"event": "job.finished", "job_id": "j", "status": "done"}]
    finally:
        hooks.close(within_s=0)


def test_a_batch_behind_more_than_a_page_of_orphans_still_fires(
    private_database: str, receiver: Receiver
) -> None:
    """105 registrations older than the batch's that never fire (no job of theirs exists):
    reading the 100 oldest only, every sweep found the same orphans and batch.finished never
    came. Sweeps page on."""
    import datetime as dt
    import uuid

    from sqlalchemy import insert

    from ocrq.core.db import get_engine, ocr_batch_hooks, ocr_jobs
    from ocrq.worker.batch_hooks import BatchHooks

    engine = get_engine(private_database)
    old = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    batch = f"real-{uuid.uuid4().hex[:6]}"
    with engine.begin() as conn:
        conn.execute(
            insert(ocr_batch_hooks),
            [
                {"batch": f"orphan-{i:03d}", "url": receiver.url, "registered_at": old}
                for i in range(105)
            ],
        )
        conn.execute(
            insert(ocr_batch_hooks).values(
                batch=batch, url=receiver.url, registered_at=old + dt.timedelta(seconds=1)
            )
        )
        conn.execute(
            insert(ocr_jobs).values(
                id=str(uuid.uuid4()),
                status="done",
                task="text",
                source="x",
                attempts=1,
                created_at=old,
                finished_at=old,
                batch=batch,
            )
        )
    hooks = Webhooks(_settings())
    batches = BatchHooks(_settings(), engine, lambda: hooks)
    try:
        sent: list[str] = []
        for _ in range(3):  # a page, then the next: the sweep's own pace when pages are full
            batches.sweep()
            sent += batches.check()
        assert sent == [batch]
        deadline = time.monotonic() + 5
        while not receiver.bodies and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [b["event"] for b in receiver.bodies] == ["batch.finished"]
    finally:
        hooks.close(within_s=0)


def test_task_threads_using_webhooks_at_once_share_one_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first webhooks of a busy worker come from many task threads at once: one sender
    (its retries, its warm shutdown) for all of them, not one per thread that raced. The real
    sender, made 50 ms slower to start so that the threads surely meet there."""
    from ocrq.worker import notices as notices_module

    class SlowToStart(Webhooks):
        def __init__(self, settings: Settings) -> None:
            time.sleep(0.05)
            super().__init__(settings)

    monkeypatch.setattr(notices_module, "Webhooks", SlowToStart)
    notices = notices_module.Notices(_settings(), rows=None)  # type: ignore[arg-type]
    start = threading.Barrier(16)
    made: list[Webhooks] = []

    def first_use() -> None:
        start.wait()
        made.append(notices._webhook())

    threads = [threading.Thread(target=first_use) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    try:
        assert len(made) == 16 and len({id(w) for w in made}) == 1
    finally:
        notices.close()
