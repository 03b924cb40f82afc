"""The worker's HTTP side on OCRQ_METRICS_PORT: /metrics, /healthz (live), /readyz (ready).

/metrics also carries `ocrq_queue_depth`, the broker's queue lengths (ocrq/worker/queue_depth.py).

Who serves it: under `ocrq worker` the supervisor, which outlives recycles, from the worker
processes' multiprocess files (a MultiProcessCollector over PROMETHEUS_MULTIPROC_DIR); under
`--no-supervise` the worker process itself, from its own registry. Either way the health
answers come from the same gauges (ocrq/worker/health.py). A plain http.server in a daemon
thread: three GET routes need no framework, and the worker image need not carry one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ocrq.core.broker_redis import shown_url
from ocrq.core.settings import Settings
from ocrq.worker import health
from ocrq.worker.queue_depth import queue_depth_registry

log = logging.getLogger(__name__)

SCHEMA_RECHECK_S = 10.0  # probes come every few seconds; one database round trip per 10 s


def multiprocess_registry(path: str) -> CollectorRegistry:
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    return registry


@dataclass
class SchemaCheck:
    """Whether the database is at Alembic head, asked at most every SCHEMA_RECHECK_S."""

    database_url: str
    _checked: float = -1e9
    _error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self) -> str | None:
        with self._lock:
            if time.monotonic() - self._checked >= SCHEMA_RECHECK_S:
                self._error = self._ask()
                self._checked = time.monotonic()
            return self._error

    def _ask(self) -> str | None:
        from ocrq.core.migrate import MigrationRunning, SchemaNotAtHead, check_at_head

        try:
            check_at_head(self.database_url)
        except (SchemaNotAtHead, MigrationRunning) as exc:
            return str(exc)
        except Exception as exc:  # unreachable: not ready (it cannot store results)
            return f"database unreachable: {type(exc).__name__}"
        return None


class Monitor:
    """What the three routes answer, from one registry; `process_alive` says whether the
    worker process exists at all (the supervisor knows; in-process it is always true)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        settings: Settings,
        process_alive: Callable[[], bool] = lambda: True,
    ) -> None:
        self.registry = registry
        # The broker's queue lengths, read at scrape time (ocrq/worker/queue_depth.py).
        self.queue_depth = queue_depth_registry(settings)
        self.schema = SchemaCheck(settings.database_url)
        self.process_alive = process_alive
        self.broker = f"OCRQ_BROKER_URL={shown_url(settings.broker_url)}"
        self.stale_after_s = max(3 * settings.heartbeat_s, 5.0)  # 3 missed beats
        self.hung_after_s = settings.job_timeout_s + 60.0

    def live(self) -> tuple[health.WorkerState, health.Verdict]:
        state = health.read_state([self.registry])
        if not self.process_alive():
            return state, health.Verdict(True, "worker process (re)starting")
        return state, health.liveness(state, time.time(), self.stale_after_s, self.hung_after_s)

    def ready(self) -> health.Verdict:
        state, live = self.live()
        if not self.process_alive():
            return health.Verdict(False, "no worker process")
        schema = self.schema.error() if live.ok and state.ready else None
        return health.readiness(state, live, schema, self.broker)

    def metrics(self) -> bytes:
        body = generate_latest(self.registry)
        if self.queue_depth is not None:
            body += generate_latest(self.queue_depth)
        return body


def serve(monitor: Monitor, port: int, address: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Start the server in a daemon thread; it lives as long as the process."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(with_body=True)

        def do_HEAD(self) -> None:  # load balancers' and some probes' way: the GET's status
            self._answer(with_body=False)

        def _answer(self, with_body: bool) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, monitor.metrics(), with_body)
                elif path in ("/healthz", "/readyz"):
                    verdict = monitor.live()[1] if path == "/healthz" else monitor.ready()
                    body = json.dumps(verdict.as_json()).encode()
                    self._send(200 if verdict.ok else 503, "application/json", body, with_body)
                else:
                    self._send(
                        404, "text/plain", b"not found: /metrics /healthz /readyz\n", with_body
                    )
            except Exception as exc:  # a broken probe must answer, not hang the prober
                log.exception("monitor: %s failed", path)
                self._send(500, "text/plain", f"{type(exc).__name__}\n".encode(), with_body)

        def _send(self, code: int, content_type: str, body: bytes, with_body: bool) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # probes: no access log
            pass

    server = ThreadingHTTPServer((address, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ocrq-monitor", daemon=True).start()
    log.info("metrics and health on http://%s:%d/ (/metrics /healthz /readyz)", address, port)
    return server
