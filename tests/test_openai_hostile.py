"""The `openai` engine against a hostile OpenAI-compatible server (issue 31, item 5): a real
`ocrq worker` under `prlimit --as`, real Redis and PostgreSQL, and a small HTTP server started
here that answers each request by its prompt:

- `nul`: a 200 answer whose text holds a NUL and a lone surrogate (PostgreSQL stores neither;
  the job stayed `running` forever while its message was acked);
- `poison`: an answer the database itself refuses to store (a trigger raises on its text): the
  job must still reach a final row;
- `drip`: headers, then a byte every 0.5 s (httpx's timeout is per read: a job was held 219 s);
- `huge`: an endless chunked answer, and `huge-declared`, a 2 GiB Content-Length (a 2 GiB
  answer was read until MemoryError, and its leftover bytes became the next answer);
- anything else: a normal answer naming the prompt, so a swapped or corrupted answer shows.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from sqlalchemy import create_engine, text

from ocrq.api.client import Client
from ocrq.core.db import get_engine
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from tests.conftest import BIN, FIGURES, WorkerProcess
from tests.waiting import Budget

MODEL = "tiny-served"
CAP = 3 * 2**30  # the worker's address space: a 2 GiB answer read whole cannot fit
TIMEOUT_S = 3.0  # OCRQ_OPENAI_TIMEOUT_S: one attempt, first byte sent to last byte read
MAX_ANSWER = 2**20  # OCRQ_OPENAI_MAX_RESPONSE_BYTES
DRIP_S = 0.5
POISON = "POISON-" + uuid.uuid4().hex[:8]


class Hostile:
    """A loopback HTTP/1.1 server (keep-alive, as vLLM's) playing the modes above."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._json(200, {"data": [{"id": MODEL}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][1]["content"][1]["text"]
                owner.prompts.append(prompt)
                mode = prompt.split()[0]
                try:
                    if mode == "drip":
                        self._drip()
                    elif mode == "huge":
                        self._endless()
                    elif mode == "huge-declared":
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(2 * 2**30))
                        self.end_headers()
                        self.wfile.write(b'{"choices": [')
                        self.close_connection = True
                    elif mode == "nul":
                        self._answer("A\x00B\ud800C")
                    elif mode == "poison":
                        self._answer(f"{POISON} text")
                    else:
                        self._answer(f"answer to {prompt}")
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def _answer(self, content: str) -> None:
                # json.dumps escapes NUL and the lone surrogate as \\u0000 and \\ud800: what a
                # server's JSON encoder sends.
                self._json(
                    200,
                    {
                        "choices": [{"message": {"content": content}, "finish_reason": "stop"}],
                        "usage": {"completion_tokens": 3},
                    },
                )

            def _json(self, status: int, reply: dict[str, Any]) -> None:
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _drip(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "100000")
                self.end_headers()
                self.wfile.flush()
                for _ in range(240):  # 120 s at most
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(DRIP_S)
                self.close_connection = True

            def _endless(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                opening = b'{"choices": [{"message": {"content": "'
                self.wfile.write(b"%x\r\n%s\r\n" % (len(opening), opening))
                chunk = b"x" * 2**20
                frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
                for _ in range(4096):  # 4 GiB at most
                    self.wfile.write(frame)
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class CappedWorker(WorkerProcess):
    """`ocrq worker` under `prlimit --as`: a runaway read fails, not the host."""

    def __init__(self, env: dict[str, str], log: Path, *args: str) -> None:
        self.log = log
        self.env = env
        self._fh = log.open("w")
        self.proc = subprocess.Popen(
            ["prlimit", f"--as={CAP}", "--", str(BIN / "ocrq"), "worker", *args],
            env=env,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.fixture(scope="module")
def server() -> Iterator[Hostile]:
    srv = Hostile()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def env(service_env: dict[str, str], server: Hostile) -> dict[str, str]:
    return {
        **service_env,
        "OCRQ_ENGINE": "openai",
        "OCRQ_OPENAI_URL": server.url,
        "OCRQ_MODEL": MODEL,
        "OCRQ_OPENAI_TIMEOUT_S": str(TIMEOUT_S),
        "OCRQ_OPENAI_RETRY_S": "0",  # one attempt: the failure shows at once
        "OCRQ_OPENAI_MAX_RESPONSE_BYTES": str(MAX_ANSWER),
        "OCRQ_OPENAI_CONCURRENCY": "8",
        "OCRQ_BATCH_WAIT_MS": "200",
        "OCRQ_QUEUE": f"ocr-hostile-{uuid.uuid4().hex[:6]}",
    }


@pytest.fixture(scope="module")
def worker(
    env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("openai-hostile") / "worker.log"
    proc = CappedWorker(env, log, "--concurrency", "8").wait_ready(120)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def image(image_root: Path) -> Path:
    path = image_root / "hostile-page.png"
    Image.new("RGB", (64, 48), "white").save(path)
    return path


def _submit(env: dict[str, str], image: Path, *prompts: str) -> dict[str, str]:
    client = Client(
        Settings(
            broker_url=env["OCRQ_BROKER_URL"],
            database_url=env["OCRQ_DATABASE_URL"],
            queue=env["OCRQ_QUEUE"],
        )
    )
    return {p: client.submit({"path": str(image)}, task=p) for p in prompts}


def _final(
    env: dict[str, str], ids: dict[str, str], budget: Budget, timeout: float
) -> dict[str, dict[str, Any]]:
    store = JobStore(get_engine(env["OCRQ_DATABASE_URL"]))

    def rows() -> dict[str, dict[str, Any]] | None:
        got = store.get(list(ids.values()))
        final = len(got) == len(ids) and all(
            r["status"] in ("done", "failed") for r in got.values()
        )
        return {p: got[i] for p, i in ids.items()} if final else None

    def seen() -> str:
        got = store.get(list(ids.values()))
        return str({p: got.get(i, {}).get("status") for p, i in ids.items()})

    return budget.until("every job final", rows, timeout, seen)


def test_unstorable_text_is_cleaned_and_a_refused_result_fails_its_job(
    worker: WorkerProcess, env: dict[str, str], image: Path
) -> None:
    """NUL and a lone surrogate become U+FFFD and the job is done; a result PostgreSQL refuses
    for another reason (a trigger, here) fails its job with why, instead of leaving it running;
    the worker goes on."""
    engine = create_engine(env["OCRQ_DATABASE_URL"])
    with engine.begin() as conn:  # a real database error on one result's UPDATE
        conn.execute(text(f"""
            CREATE FUNCTION refuse_poison() RETURNS trigger AS $$
            BEGIN
                IF NEW.text LIKE '%{POISON}%' THEN
                    RAISE EXCEPTION 'this text is refused by a test trigger';
                END IF;
                RETURN NEW;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER refuse_poison BEFORE UPDATE ON ocr_jobs
                FOR EACH ROW EXECUTE FUNCTION refuse_poison();
        """))  # fmt: skip
    try:
        ids = _submit(env, image, "nul answer", "poison answer", "plain one")
        rows = _final(env, ids, Budget(120, "nul"), 120)
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER refuse_poison ON ocr_jobs"))
            conn.execute(text("DROP FUNCTION refuse_poison()"))
        engine.dispose()
    assert rows["nul answer"]["status"] == "done", rows["nul answer"]
    assert rows["nul answer"]["text"] == "A\ufffdB\ufffdC"
    poison = rows["poison answer"]
    assert poison["status"] == "failed", poison
    assert "result could not be stored" in poison["error"], poison["error"]
    assert "refused by a test trigger" in poison["error"]
    assert rows["plain one"]["status"] == "done"
    assert rows["plain one"]["text"] == "answer to plain one"
    assert worker.alive()


def test_a_dripping_server_fails_its_job_at_the_deadline(
    worker: WorkerProcess, env: dict[str, str], image: Path
) -> None:
    """A byte every 0.5 s would hold the job ~14 h for its declared 100,000 bytes: the attempt
    ends at OCRQ_OPENAI_TIMEOUT_S, and the jobs sent with it are answered meanwhile."""
    started = time.monotonic()
    ids = _submit(env, image, "drip slowly", "plain two", "plain three")
    rows = _final(env, ids, Budget(90, "drip"), 90)
    took = time.monotonic() - started
    drip = rows["drip slowly"]
    held = (drip["finished_at"] - drip["started_at"]).total_seconds()
    FIGURES.append(
        f"[openai-drip] dripping answer failed after {held:.1f} s (deadline {TIMEOUT_S} s)"
    )
    assert drip["status"] == "failed", drip
    assert f"within {TIMEOUT_S:g} s" in drip["error"], drip["error"]
    assert held < TIMEOUT_S + 10, held
    assert took < 60
    for name in ("plain two", "plain three"):
        assert rows[name]["status"] == "done" and rows[name]["text"] == f"answer to {name}"
        # Answered on their own, not when the dripping request gave up (a static batch held
        # them, and the batches behind them, for as long as its slowest request).
        early = (drip["finished_at"] - rows[name]["finished_at"]).total_seconds()
        assert early > TIMEOUT_S / 2, f"{name} finished only {early:.1f} s before the drip job"


def test_a_huge_answer_is_cut_off_and_the_next_answer_is_whole(
    worker: WorkerProcess, env: dict[str, str], image: Path
) -> None:
    """An endless answer is read up to the byte cap, a declared 2 GiB one not at all; both
    fail their jobs, and the answers that follow on the same worker are their own (the
    connection that carried a cut-off answer is never reused)."""
    ids = _submit(env, image, "huge answer", "huge-declared answer")
    rows = _final(env, ids, Budget(90, "huge"), 90)
    after = _submit(env, image, *(f"plain after {i}" for i in range(6)))
    later = _final(env, after, Budget(60, "after"), 60)
    for name in ("huge answer", "huge-declared answer"):
        assert rows[name]["status"] == "failed", rows[name]
        assert f"more than {MAX_ANSWER} bytes" in rows[name]["error"], rows[name]["error"]
    for name, row in later.items():
        assert row["status"] == "done" and row["text"] == f"answer to {name}", row
    assert worker.alive()
