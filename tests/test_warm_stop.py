"""A warm shutdown says what it waits for (ocrq/worker/exit_state.py `WarmStopReport`): a
real worker stopped with SIGTERM while a job is in progress. Before, Celery's "Warm shutdown"
line was followed by 35 s of silence, read as a hang."""

from __future__ import annotations

import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ocrq.api.client import Client
from ocrq.core.db import get_engine
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from tests.conftest import WorkerProcess
from tests.waiting import Budget


def test_a_warm_shutdown_says_how_many_jobs_it_waits_for(
    service_env: dict[str, str], text_images: dict[str, Path], tmp_path: Path
) -> None:
    image = text_images["word"].read_bytes()
    requested = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requested.set()
            time.sleep(3)  # the job is in progress while the stop comes
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    queue = f"ocr-warm-{uuid.uuid4().hex[:6]}"
    env = {
        **service_env,
        "OCRQ_QUEUE": queue,
        "OCRQ_CONSUME_DEFAULT_QUEUE": "false",
        "OCRQ_URL_ALLOW_NETWORKS": "127.0.0.0/8",
    }
    settings = Settings(
        broker_url=env["OCRQ_BROKER_URL"], database_url=env["OCRQ_DATABASE_URL"], queue=queue
    )
    budget = Budget(150, "warm stop")
    worker = WorkerProcess(env, tmp_path / "worker.log", "--no-supervise", "--concurrency", "2")
    try:
        worker.wait_ready(90)
        port = server.server_address[1]
        job = Client(settings).submit({"url": f"http://127.0.0.1:{port}/slow.png"})
        budget.until("the job fetching its image", requested.is_set, 30, worker.text)
        worker.stop()
        log = worker.text()
        assert "warm shutdown: waiting for 1 job(s) in progress" in log, log[-3000:]
        assert "warm shutdown: jobs finished after" in log, log[-3000:]
        store = JobStore(get_engine(env["OCRQ_DATABASE_URL"]))
        assert store.get([job])[job]["status"] == "done"  # it did finish, and was waited for
    finally:
        worker.stop()
        server.shutdown()
