"""Reading the broker as the recovery sweep does (ocrq/core/broker_scan.py), and the fault
tests' probe built on it (tests/broker_probe.py), against the session's real Redis."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis

from ocrq.api.client import Client
from ocrq.core.broker_scan import (
    GIVEN_BACK_KEY,
    GIVEN_BACK_TTL_S,
    HOLDERS_KEY,
    BrokerNotes,
    broker_view,
    holder_entry,
)
from ocrq.core.requeue import producer_app
from ocrq.core.settings import Settings
from tests.broker_probe import where


def test_probe_finds_a_waiting_message_and_misses_a_lost_one(
    broker_url: str, database_url: str, text_images: dict[str, Path]
) -> None:
    """A test that times out must say where its stuck message is, not fail in its message."""
    queue = f"ocr-probe-{uuid.uuid4().hex[:6]}"  # no worker consumes it
    settings = Settings(broker_url=broker_url, database_url=database_url, queue=queue)
    waiting = Client(settings).submit({"path": str(text_images["word"])})
    lost = str(uuid.uuid4())
    lines = where(settings, [waiting, lost]).splitlines()
    assert lines[0] == f"{waiting}: in a queue's list"
    assert lines[1].startswith(f"{lost}: nowhere in Redis")
    assert lines[2].startswith("queued rows older than 5 s:")


def test_a_holder_written_just_before_its_unacked_entry_is_kept(
    broker_url: str, database_url: str
) -> None:
    """A worker records the holder, then kombu the `unacked` entry, a round trip apart. A sweep
    reading between the two used to drop the holder as stale, and the message of a worker that
    then died was put back by nobody but the visibility timeout (1 h by default). A holder whose
    message never arrives is still dropped."""
    settings = Settings(broker_url=broker_url, database_url=database_url, queue="ocr-scan")
    r = redis.Redis.from_url(broker_url)
    arriving, never = f"t-{uuid.uuid4().hex}", f"t-{uuid.uuid4().hex}"
    job = str(uuid.uuid4())
    r.hset(HOLDERS_KEY, arriving, holder_entry("w-alive", job))
    r.hset(HOLDERS_KEY, never, holder_entry("w-alive", None))

    message = b'[{"headers": {"id": "%s"}}, "", "ocr-scan"]' % job.encode()
    try:
        with broker_view(producer_app(settings), "ocr-scan") as view:
            assert view is not None
            original = view.client.hkeys

            def hkeys_then_kombu_writes(key: str) -> list[bytes]:  # the race, made certain
                keys = original(key)
                r.hset("unacked", arriving, message)
                return keys

            view.client.hkeys = hkeys_then_kombu_writes  # type: ignore[method-assign]
            held = {h.tag: h for h in view.held()}
        assert held[arriving].worker == "w-alive" and held[arriving].job_id == job
        assert r.hexists(HOLDERS_KEY, arriving)  # kept: a later sweep can restore it
        assert never not in held and not r.hexists(HOLDERS_KEY, never)  # dropped
    finally:
        r.hdel("unacked", arriving)
        r.hdel(HOLDERS_KEY, arriving, never)


def test_a_given_back_note_is_read_once(broker_url: str, database_url: str) -> None:
    """The note a worker leaves when it gives a claimed job's message back (the database away)
    is taken by the next claim that finds the row running: a later one that finds it running
    again is a worker that died, and must not read the old note as a give-back too."""
    settings = Settings(broker_url=broker_url, database_url=database_url, queue="ocr-scan")
    notes = BrokerNotes(producer_app(settings))
    job = str(uuid.uuid4())
    assert notes.given_back(job) is None
    notes.gave_back(job, "w-1")
    ttl = redis.Redis.from_url(broker_url).ttl(GIVEN_BACK_KEY + job)
    assert 0 < ttl <= GIVEN_BACK_TTL_S  # notes of jobs that never come back expire
    assert notes.given_back(job) == "w-1"
    assert notes.given_back(job) is None


def test_a_holder_entry_names_the_job_a_message_runs() -> None:
    """The job id of the kwargs, else the task id, spelt as the task spells them; a body that
    does not decode is named by its task id (ocrq/worker/broker.py)."""
    import json

    from kombu import Message

    from ocrq.worker.broker import delivered_job_id

    def message(body: str, task_id: str | None) -> Message:
        return Message(
            body=body, content_type="application/json", content_encoding="utf-8",
            headers={"id": task_id} if task_id else {},
        )

    job, task = uuid.uuid4(), str(uuid.uuid4())
    sent = message(json.dumps([[], {"job_id": str(job).upper()}, {}]), task)
    assert delivered_job_id(sent) == str(job)
    assert sent.payload == [[], {"job_id": str(job).upper()}, {}]  # memoised for Celery
    assert delivered_job_id(message(json.dumps([[], {}, {}]), task.upper())) == task
    assert delivered_job_id(message("{not json", task)) == task
    assert delivered_job_id(message(json.dumps([[], {"job_id": "nope"}, {}]), "x")) == "x"
    assert delivered_job_id(message("[]", None)) is None


def test_one_job_id_rule_for_the_broker_and_the_task() -> None:
    """The rule both the holder entry and an expired message's row use (ocrq/core/contract.py):
    the kwargs' job_id when given (an empty one is not), else the task id, canonical."""
    from ocrq.core.contract import message_job_id

    job, task = uuid.uuid4(), uuid.uuid4()
    assert message_job_id({"job_id": f"{{{str(job).upper()}}}"}, str(task)) == str(job)
    assert message_job_id({"job_id": ""}, task.hex) == str(task)
    assert message_job_id({}, f"urn:uuid:{task}") == message_job_id(None, str(task)) == str(task)
    with pytest.raises(ValueError):
        message_job_id({"job_id": "nope"}, str(task))
