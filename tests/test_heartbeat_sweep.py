"""When a worker's first recovery sweep comes (ocrq/worker/heartbeat.py): after a few of its own
heartbeats, not after OCRQ_STALLED_AFTER_S. A worker restarted after its predecessor died is
what finds that one's lost message: waiting OCRQ_STALLED_AFTER_S (60 s) first, the job ran 68 s
after the worker came back."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ocrq.core.db import get_engine
from ocrq.core.requeue import Recovered
from ocrq.core.settings import Settings
from ocrq.worker.heartbeat import SETTLE_BEATS, Heartbeat


def test_the_first_sweep_comes_after_three_beats_not_the_stall_bound(
    private_database: str,
) -> None:
    settings = Settings(
        database_url=private_database, heartbeat_s=0.3, stalled_after_s=20, stalled_sweep_s=30
    )
    swept = threading.Event()

    def sweep() -> Recovered:
        swept.set()
        return Recovered()

    started = time.monotonic()
    beat = Heartbeat(get_engine(private_database), "settle-test/1-abc", settings, sweep).start()
    try:
        assert swept.wait(10), "no sweep within 10 s (the stall bound is 20 s)"
        took = time.monotonic() - started
        assert took >= SETTLE_BEATS * settings.heartbeat_s - 0.05, took
    finally:
        beat.stop()


def test_a_crashed_childs_running_job_is_rerun_without_waiting_for_the_stall_bound(
    service_env: dict[str, str], text_images: dict[str, Path], tmp_path: Path
) -> None:
    """A supervised worker's process is killed (-9) while its job runs. The supervisor saw it
    die, but its heartbeat row only went stale after OCRQ_STALLED_AFTER_S (60 s), and only then
    did a sweep re-send the job. The supervisor marks the row dead at once: the restarted
    process's first sweep (three beats after it starts) re-sends the job."""
    import os
    import re
    import signal
    import uuid
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ocrq.api.client import Client
    from ocrq.core.store import JobStore
    from tests.conftest import WorkerProcess
    from tests.waiting import Budget

    image = text_images["word"].read_bytes()
    calls: list[float] = []

    class SlowOnce(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            calls.append(time.monotonic())
            if len(calls) == 1:
                time.sleep(30)  # the first fetch hangs: its worker dies meanwhile
            try:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(image)))
                self.end_headers()
                self.wfile.write(image)
            except OSError:  # the first fetch's worker is gone
                pass

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowOnce)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    queue = f"ocr-crash-{uuid.uuid4().hex[:6]}"
    env = {
        **service_env,
        "OCRQ_QUEUE": queue,
        "OCRQ_CONSUME_DEFAULT_QUEUE": "false",
        "OCRQ_URL_ALLOW_NETWORKS": "127.0.0.0/8",
        "OCRQ_HEARTBEAT_S": "1",
        "OCRQ_STALLED_AFTER_S": "60",
        "OCRQ_STALLED_SWEEP_S": "1",
        "OCRQ_VISIBILITY_TIMEOUT_S": "3600",
    }
    settings = Settings(
        broker_url=env["OCRQ_BROKER_URL"], database_url=env["OCRQ_DATABASE_URL"], queue=queue
    )
    store = JobStore(get_engine(env["OCRQ_DATABASE_URL"]))
    budget = Budget(200, "crashed child")
    worker = WorkerProcess(env, tmp_path / "worker.log", "--concurrency", "2")  # supervised
    try:
        worker.wait_ready(90)
        port = server.server_address[1]
        job = Client(settings).submit({"url": f"http://127.0.0.1:{port}/slow.png"})
        budget.until("the job running", lambda: bool(calls), 30, worker.text)
        (child,) = re.findall(r"started worker process pid (\d+)", worker.text())
        os.kill(int(child), signal.SIGKILL)
        killed = time.monotonic()
        budget.until(
            "the job done by the restarted process",
            lambda: store.get([job])[job]["status"] == "done",
            45,
            worker.text,
        )
        # Well inside the 60 s its row took to go stale (restart, start-up, three beats).
        assert time.monotonic() - killed < 45
        assert "marked dead" in worker.text()
    finally:
        worker.stop()
        server.shutdown()
