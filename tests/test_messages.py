"""Hostile, malformed and poison messages against real worker processes (issue 16, messages).

Raw messages are pushed with redis-py straight onto the queue's list, bypassing Celery's
producer, the way kombu's Redis transport stores them: a JSON envelope with `body`,
`content-encoding`, `content-type`, `headers` and `properties` (`body_encoding: base64`,
`delivery_tag`, `delivery_info`). Before the fix each malformed kind ended in Celery's
"Unrecoverable error" (the worker process died) or a multi-line traceback, and a JSON-string
body came back after every restart.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from ocrq.api.client import Client
from ocrq.core.contract import ImageRef
from ocrq.core.samples import draw_text_image
from ocrq.core.settings import Settings
from ocrq.core.store import REUSED_ID, JobStore
from ocrq.worker import envelope as envelope_checks
from tests.conftest import WorkerProcess
from tests.test_service import _store, _wait_rows

QUEUE = "ocr"


def envelope(
    body: bytes | str,
    headers: dict[str, Any] | None = None,
    *,
    encode: bool = True,
    content_type: str = "application/json",
    **props: Any,
) -> dict[str, Any]:
    """A message as kombu's Redis transport stores it."""
    raw = body.encode() if isinstance(body, str) else body
    return {
        "body": base64.b64encode(raw).decode() if encode else body,
        "content-encoding": "utf-8",
        "content-type": content_type,
        "headers": headers if headers is not None else {},
        "properties": {
            "correlation_id": str(uuid.uuid4()),
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": QUEUE},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
            **props,
        },
    }


def task_headers(task_id: str | None = None, name: str = "ocrq.recognize") -> dict[str, Any]:
    task_id = task_id or str(uuid.uuid4())
    return {
        "lang": "py",
        "task": name,
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "group": None,
        "retries": 0,
        "argsrepr": "()",
        "kwargsrepr": "{}",
        "origin": "probe",
    }


def malformed_cases(marker: str) -> dict[str, bytes]:
    """name -> the raw bytes LPUSHed; each carries `marker` so its log line can be found."""
    job = str(uuid.uuid4())
    cases: dict[str, Any] = {
        "garbage": f"\x00\xff not json at all {marker}".encode("utf-8", "surrogateescape"),
        "json_list": [1, 2, 3, marker],
        "json_string": marker,
        "no_properties": {"body": marker},
        "no_delivery_tag": {**envelope(marker), "properties": {"body_encoding": "base64"}},
        "bad_base64": envelope(f"!!{marker}!!", encode=False),
        "body_json_string": envelope(json.dumps(marker), task_headers(job)),
        "body_not_json": envelope(f"{{{{{marker}", task_headers(str(uuid.uuid4()))),
        "body_short_list": envelope(json.dumps([[], {"m": marker}]), task_headers()),
        "body_string_no_headers": envelope(json.dumps(marker)),
        "headers_list": {**envelope(json.dumps([[], {}, {}])), "headers": [marker]},
        "unknown_task": envelope(json.dumps([[], {}, {}]), task_headers(name=f"x.{marker}")),
        "pickle_body": envelope(
            b"\x80\x04\x95" + marker.encode(),
            task_headers(),
            content_type="application/x-python-serialize",
        ),
        "kwargs_not_dict": envelope(json.dumps([[], [marker], {}]), task_headers()),
        "bad_object_hook": envelope(
            json.dumps([[], {"x": {"__type__": "datetime", "__value__": marker}}, {}]),
            task_headers(),
        ),
        "deep_nesting": ("[" * 200_000 + json.dumps(marker)).encode(),
        "eta_garbage": envelope(json.dumps([[], {}, {}]), {**task_headers(), "eta": marker}),
        "expires_garbage": envelope(
            json.dumps([[], {}, {}]), {**task_headers(), "expires": marker}
        ),
        "timelimit_garbage": envelope(
            json.dumps([[], {}, {}]), {**task_headers(), "timelimit": marker}
        ),
        "id_not_string": envelope(json.dumps([[], {}, {}]), {**task_headers(), "id": [marker]}),
    }
    return {
        name: value if isinstance(value, bytes) else json.dumps(value).encode()
        for name, value in cases.items()
    }


def task_message(kwargs: dict[str, Any], task_id: str | None = None) -> bytes:
    """A well-formed task message as raw bytes; JSON escapes keep lone surrogates intact."""
    body = json.dumps([[], kwargs, {"callbacks": None, "errbacks": None, "chain": None}])
    return json.dumps(envelope(body, task_headers(task_id))).encode()


def worker_pids(worker: WorkerProcess) -> list[str]:
    return re.findall(r"started worker process pid (\d+)", worker.text())


# Unacked entries other modules left in the shared test database (a worker killed with -9
# leaves its reserved messages there until the visibility timeout): not this module's doing.
STALE_UNACKED: set[bytes] = set()


@pytest.fixture(scope="module", autouse=True)
def _stale_unacked(broker_url: str) -> None:
    STALE_UNACKED.clear()
    STALE_UNACKED.update(redis.Redis.from_url(broker_url).hkeys("unacked"))


def drained(r: redis.Redis, timeout: float = 10) -> bool:
    """Nothing left in the queue and nothing unacked (acks follow the row by a moment)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.llen(QUEUE) == 0 and set(r.hkeys("unacked")) <= STALE_UNACKED:
            return True
        time.sleep(0.1)
    return False


def _logged(worker: WorkerProcess, line: str, timeout: float = 30) -> bool:
    """Whether `line` reaches the worker's log within `timeout` (a condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if line in worker.text():
            return True
        time.sleep(0.1)
    return False


def _logged_more(worker: WorkerProcess, line: str, before: int, timeout: float = 30) -> bool:
    """Whether `line` appears in the worker's log more than `before` times within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.text().count(line) > before:
            return True
        time.sleep(0.1)
    return False


def send(broker_url: str, image: dict[str, str], job_id: str, task: str = "text") -> None:
    Celery(broker=broker_url).send_task(
        "ocrq.recognize",
        kwargs={"image": image, "task": task, "job_id": job_id},
        queue=QUEUE,
        task_id=str(uuid.uuid4()),
    )


REJECTED = "rejected a malformed message"


@pytest.mark.parametrize("case", sorted(malformed_cases("x")))
def test_malformed_message_rejected_once(
    case: str,
    worker: WorkerProcess,
    broker_url: str,
    database_url: str,
    text_images: dict[str, Path],
) -> None:
    """The worker survives, the message is gone (not redelivered), one WARNING line says why."""
    r = redis.Redis.from_url(broker_url)
    marker = f"probe{uuid.uuid4().hex[:10]}"
    pids = worker_pids(worker)
    before = worker.text()
    r.lpush(QUEUE, malformed_cases(marker)[case])
    good = str(uuid.uuid4())  # a good job behind it, served by the same process
    send(broker_url, {"path": str(text_images["word"])}, good)
    assert _wait_rows(database_url, [good], timeout=60)[good]["status"] == "done"
    assert drained(r)
    time.sleep(0.3)
    new = worker.text()[len(before) :]
    assert worker.alive() and worker_pids(worker) == pids, new
    lines = [line for line in new.splitlines() if REJECTED in line]
    assert len(lines) == 1, new
    assert "WARNING" in lines[0] and len(lines[0]) < 600 and lines[0].isascii(), lines[0]
    for bad in ("Traceback", "ERROR", "CRITICAL", "Unrecoverable"):
        assert bad not in new, new
    # The reason is the message's own: not a crash caught late.
    assert "while the worker took it" not in lines[0]


def test_protocol_1_producer_still_served(
    worker: WorkerProcess, broker_url: str, database_url: str, text_images: dict[str, Path]
) -> None:
    """The checks refuse what is malformed, not older producers: Celery's protocol 1 passes."""
    before = worker.text()
    app = Celery(broker=broker_url)
    app.conf.task_protocol = 1
    job = str(uuid.uuid4())
    app.send_task(
        "ocrq.recognize",
        kwargs={"image": {"path": str(text_images["hello"])}, "job_id": job},
        queue=QUEUE,
    )
    assert _wait_rows(database_url, [job], timeout=60)[job]["status"] == "done"
    assert REJECTED not in worker.text()[len(before) :]


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("task", "text\x00more", "NUL"),
        ("path", "/img\x00.png", "NUL"),
        ("url", "http://example.invalid/\x00x.png", "NUL"),
        ("path", "/img\ud800.png", "nicode"),
        ("task", "prompt \udfff", "nicode"),
    ],
)
def test_unstorable_text_fails_with_a_row(
    field: str,
    value: str,
    fragment: str,
    worker: WorkerProcess,
    broker_url: str,
    database_url: str,
) -> None:
    """Before: no row at all (the INSERT failed, the message was acked). Now: a failed row
    whose source and task are escaped, and a clear error."""
    job = str(uuid.uuid4())
    kwargs: dict[str, Any] = {"image": {"path": "/img.png"}, "task": "text", "job_id": job}
    if field == "task":
        kwargs["task"] = value
    else:
        kwargs["image"] = {field: value}
    redis.Redis.from_url(broker_url).lpush(QUEUE, task_message(kwargs))
    row = _wait_rows(database_url, [job], timeout=60)[job]
    assert row["status"] == "failed", row
    assert "invalid job request" in row["error"] and fragment in row["error"], row["error"]
    stored = row["task"] if field == "task" else row["source"]
    assert "\\x00" in stored or "\\ud" in stored, stored
    assert worker.alive()


def test_job_id_spellings_make_one_row(
    worker: WorkerProcess, broker_url: str, database_url: str, text_images: dict[str, Path]
) -> None:
    """One UUID, five spellings: one row, under the canonical lowercase dashed form."""
    job = uuid.uuid4()
    spellings = [str(job).upper(), f"{{{job}}}", f"urn:uuid:{job}", job.hex, str(job)]
    image = {"path": str(text_images["hello"])}
    for spelling in spellings:  # one after another: each later one finds the row done
        send(broker_url, image, spelling)
        assert _wait_rows(database_url, [str(job)], timeout=60)[str(job)]["status"] == "done"
    from sqlalchemy import func, select

    from ocrq.core.db import ocr_jobs

    store = _store(database_url)
    with store.engine.connect() as conn:
        ids = (
            conn.execute(
                select(ocr_jobs.c.id).where(func.lower(ocr_jobs.c.id).like(f"%{job.hex[:8]}%"))
            )
            .scalars()
            .all()
        )
    assert ids == [str(job)]
    assert store.get([str(job)])[str(job)]["attempts"] == 1
    # Readers accept any spelling too.
    client = Client(Settings(broker_url=broker_url, database_url=database_url))
    assert client.status([f"{{{str(job).upper()}}}"])[0]["status"] == "done"


def test_unusable_job_id_rejected_with_one_line(
    worker: WorkerProcess, broker_url: str, database_url: str, text_images: dict[str, Path]
) -> None:
    marker = f"nope{uuid.uuid4().hex[:8]}"
    before = worker.text()
    send(broker_url, {"path": str(text_images["hello"])}, f"{marker}\x00")
    deadline = time.monotonic() + 30
    while marker not in worker.text()[len(before) :] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert drained(redis.Redis.from_url(broker_url))
    new = worker.text()[len(before) :]
    lines = [line for line in new.splitlines() if marker in line]
    warnings = [line for line in lines if "WARNING" in line]
    assert len(warnings) == 1 and "without a valid job id" in warnings[0], new
    assert "\x00" not in new and "Traceback" not in new, new
    # Celery reports the task failed (Flower shows it), in one line without a traceback.
    assert re.search(r"ocrq.recognize\[[0-9a-f-]+\] raised expected: JobFailed", new), new


def test_reused_job_id_refused_both_orders(
    worker: WorkerProcess, broker_url: str, database_url: str, text_images: dict[str, Path]
) -> None:
    """A job id names one image: the same content again is a redelivery, another is refused
    without touching the row."""
    client = Client(Settings(broker_url=broker_url, database_url=database_url))
    store = _store(database_url)
    hello, word = ({"path": str(text_images[k])} for k in ("hello", "word"))

    # Order 1: `ocrq submit` (queued row + message) runs; the same content again is a no-op,
    # another image under that id fails its own message and leaves the done row as it was.
    job = client.submit(hello)
    first = _wait_rows(database_url, [job], timeout=60)[job]
    assert first["status"] == "done" and "HELLO" in first["text"].upper()
    send(broker_url, hello, job)
    send(broker_url, word, job)
    assert drained(redis.Redis.from_url(broker_url))
    # Popped is not yet claimed (kombu pops, then marks unacked): wait for the refusal itself.
    assert _logged(worker, f"job {job} refused: {REUSED_ID}")
    after = store.get([job])[job]
    assert {k: after[k] for k in ("status", "text", "source", "finished_at", "attempts")} == {
        k: first[k] for k in ("status", "text", "source", "finished_at", "attempts")
    }
    assert f"job {job} refused: {REUSED_ID}" in worker.text()

    # Order 2: a queued row (as `ocrq submit` records it), a different image arrives first:
    # refused, the row still queued; then its own message runs it.
    job = str(uuid.uuid4())
    store.enqueue(job, "text", ImageRef(**hello).describe())
    send(broker_url, word, job)
    assert drained(redis.Redis.from_url(broker_url))
    assert _logged(worker, f"job {job} refused: {REUSED_ID}")
    row = store.get([job])[job]
    assert (row["status"], row["attempts"], row["error"]) == ("queued", 0, None)
    send(broker_url, hello, job)
    row = _wait_rows(database_url, [job], timeout=60)[job]
    assert row["status"] == "done" and "HELLO" in row["text"].upper()
    assert row["source"] == str(text_images["hello"])
    # The task too is part of what a job id names.
    refusals = worker.text().count(f"job {job} refused: ")
    send(broker_url, hello, job, task="spotting")
    assert drained(redis.Redis.from_url(broker_url))
    assert _logged_more(worker, f"job {job} refused: ", refusals)
    assert store.get([job])[job]["finished_at"] == row["finished_at"]


def slow_image(folder: Path, lines: int) -> Path:
    """A dense page the CPU engine needs seconds for."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"dense{lines}.png"
    text = [
        f"LINE {i} THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG 0123456789" for i in range(lines)
    ]
    draw_text_image(text, size=28).save(path)
    return path


@pytest.fixture()
def own_queue_env(service_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """A queue of its own, so that the module's worker does not take these messages."""
    queue = f"ocr-{uuid.uuid4().hex[:6]}"
    yield {**service_env, "OCRQ_QUEUE": queue}
    redis.Redis.from_url(service_env["OCRQ_BROKER_URL"]).delete(queue)


def test_redelivery_cap_after_sigkill(
    own_queue_env: dict[str, str],
    broker_url: str,
    database_url: str,
    image_root: Path,
    tmp_path: Path,
) -> None:
    """A job whose worker is SIGKILLed under it every time is failed after OCRQ_MAX_ATTEMPTS,
    not redelivered forever; its message is gone."""
    cap = 3
    env = {**own_queue_env, "OCRQ_VISIBILITY_TIMEOUT_S": "3", "OCRQ_MAX_ATTEMPTS": str(cap)}
    queue = env["OCRQ_QUEUE"]
    store = JobStore(_store(database_url).engine)
    path = slow_image(image_root / "poison", 12)
    job = str(uuid.uuid4())
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "2").wait_ready()
    t0 = time.monotonic()
    try:
        Celery(broker=broker_url).send_task(
            "ocrq.recognize",
            kwargs={"image": {"path": str(path)}, "job_id": job},
            queue=queue,
        )
        for attempt in range(1, cap + 1):
            deadline = time.monotonic() + 45
            while time.monotonic() < deadline:
                row = store.get([job]).get(job)
                if row and row["status"] == "running" and row["attempts"] == attempt:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"attempt {attempt} never started:\n{worker.text()[-3000:]}")
            os.kill(int(worker_pids(worker)[-1]), signal.SIGKILL)  # mid-job
        row = _wait_rows(database_url, [job], timeout=60)[job]
        seconds = time.monotonic() - t0
        r = redis.Redis.from_url(broker_url)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            r.llen(queue) or any(queue.encode() in v for v in r.hgetall("unacked").values())
        ):
            time.sleep(0.1)
        left = r.llen(queue) + sum(queue.encode() in v for v in r.hgetall("unacked").values())
    finally:
        worker.stop()
    assert row["status"] == "failed", row
    assert row["error"] == (
        f"gave up after {cap} attempts: the worker died while processing it (possible poison input)"
    )
    assert row["attempts"] == cap and row["text"] is None
    assert left == 0
    assert len(worker_pids(worker)) == cap + 1
    print(f"\n[redelivery-cap] attempts={cap} seconds={seconds:.1f}")


def test_job_timeout_fails_the_job_not_the_batch(
    own_queue_env: dict[str, str],
    broker_url: str,
    database_url: str,
    image_root: Path,
    text_images: dict[str, Path],
    tmp_path: Path,
) -> None:
    env = {**own_queue_env, "OCRQ_JOB_TIMEOUT_S": "1"}
    queue = env["OCRQ_QUEUE"]
    # 40 lines: seconds through the CPU engine even on an idle machine (8 lines once took
    # 0.89 s, inside the 1 s timeout, and the job was done instead of timed out).
    path = slow_image(image_root / "slow", 40)
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "2").wait_ready()
    app = Celery(broker=broker_url)
    slow, good = str(uuid.uuid4()), str(uuid.uuid4())
    try:
        t0 = time.monotonic()
        app.send_task(
            "ocrq.recognize", kwargs={"image": {"path": str(path)}, "job_id": slow}, queue=queue
        )
        row = _wait_rows(database_url, [slow], timeout=60)[slow]
        failed_after = time.monotonic() - t0
        # The batch itself ran on and finished; its late result did not touch the row.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and " 1 images in " not in worker.text():
            time.sleep(0.2)
        assert " 1 images in " in worker.text(), worker.text()[-3000:]
        assert _store(database_url).get([slow])[slow] == row
        app.send_task(
            "ocrq.recognize",
            kwargs={"image": {"path": str(text_images["word"])}, "job_id": good},
            queue=queue,
        )
        done = _wait_rows(database_url, [good], timeout=60)[good]
        assert worker.alive()
    finally:
        worker.stop()
    assert row["status"] == "failed", row
    assert row["error"].startswith("timed out after 1 s"), row["error"]
    assert row["width"] and row["sha256"]  # the image was read; the wait was cut
    assert failed_after < 20
    assert done["status"] == "done"


# --- send options that must fail the job (issue 31) --------------------------------------------

NOW = dt.datetime(2026, 12, 2, tzinfo=dt.UTC)
LINK = {"task": "ocrq.recognize", "args": [], "kwargs": {}, "options": {"queue": "ocr"}}


def proto2(embed: dict[str, Any], **headers: Any) -> dict[str, Any]:
    body = json.dumps([[], {"image": {"path": "/a.png"}}, embed])
    return envelope(body, {**task_headers(), **headers})


@pytest.mark.parametrize(
    ("embed", "eta", "refused"),
    [
        ({}, None, False),
        ({"callbacks": None, "errbacks": None, "chain": None, "chord": None}, None, False),
        ({}, (NOW + dt.timedelta(seconds=3599)).isoformat(), False),
        ({}, (NOW + dt.timedelta(seconds=3601)).isoformat(), True),
        ({}, "9999-01-01T00:00:00", True),  # no zone: taken as UTC
        ({"callbacks": [LINK]}, None, True),
        ({"errbacks": [LINK]}, None, True),
        ({"chain": [LINK]}, None, True),
        ({"chord": LINK}, None, True),
    ],
)
def test_far_etas_and_links_are_refused(
    embed: dict[str, Any], eta: str | None, refused: bool
) -> None:
    payload = proto2(embed, eta=eta)
    reason = envelope_checks.task_refusal(payload, 3600, NOW)
    assert (reason is not None) == refused, reason
    if reason is None:
        return
    rewritten = envelope_checks.refused(payload, reason)
    assert rewritten is not None
    assert envelope_checks.message_problem(rewritten, {"ocrq.recognize"}) is None  # still sound
    headers = rewritten["headers"]
    assert headers["eta"] is None and headers[envelope_checks.REFUSED_HEADER] == reason
    _, kwargs, links = json.loads(base64.b64decode(rewritten["body"]))
    assert kwargs == {"image": {"path": "/a.png"}}  # the job itself travels on
    assert all(links[key] is None for key in envelope_checks.LINKS)
    assert envelope_checks.task_refusal(rewritten, 3600, NOW) is None


def test_protocol_1_with_links_is_refused_without_a_rewrite() -> None:
    body = json.dumps({"task": "ocrq.recognize", "id": str(uuid.uuid4()), "args": [],
                       "kwargs": {}, "callbacks": [LINK]})  # fmt: skip
    payload = envelope(body, {})
    reason = envelope_checks.task_refusal(payload, 3600, NOW)
    assert reason is not None and "'ocrq.recognize' is not allowed" in reason
    assert envelope_checks.refused(payload, reason) is None  # rejected by the broker instead
