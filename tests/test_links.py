"""The link rule (ocrq/worker/links.py) alone, and the api's refusals of callback fields; the
whole paths run through a real worker in tests/test_cancel_deadlines.py."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from ocrq.api.http import create_app
from ocrq.core.settings import Settings
from ocrq.worker.links import MAX_LINKS, link_refusal

ALLOWED = ["myapp.*", "billing.notify"]
QUEUES = ["myapp-callbacks"]


def sig(name: object, **options: object) -> dict[str, object]:
    """A plain signature as Celery writes it: `signature(name, queue="myapp-callbacks")`."""
    return {
        "task": name, "args": [], "kwargs": {}, "options": {"queue": QUEUES[0], **options},
        "subtask_type": None, "immutable": False,
    }  # fmt: skip


def disguised(kind: str, *inner: dict[str, object]) -> dict[str, object]:
    """A group/chain/chord under an allowed name: Celery rebuilds it by `subtask_type`."""
    return {**sig("myapp.done"), "subtask_type": kind, "kwargs": {"tasks": list(inner)}}


@pytest.mark.parametrize(
    ("embed", "refused"),
    [
        ({}, None),
        ({"callbacks": [sig("myapp.done")], "errbacks": [sig("billing.notify")]}, None),
        ({"callbacks": [sig("other.done")]}, "link to 'other.done' is not allowed"),
        ({"errbacks": [sig("ocrq.recognize")]}, "link to 'ocrq.recognize'"),
        ({"callbacks": [sig("celery.accumulate")]}, "link to 'celery.accumulate'"),
        ({"callbacks": [sig(None)]}, "a link without a task name"),
        ({"callbacks": ["myapp.done"]}, "a link without a task name"),
        ({"chain": [sig("myapp.done")]}, "carries a Celery chain"),
        ({"chord": sig("myapp.done")}, "carries a Celery chord"),
        ({"callbacks": [sig("myapp.x")] * (MAX_LINKS + 1)}, f"at most {MAX_LINKS}"),
        # Not plain, or sent elsewhere (issue 52): each would have made the worker send more.
        ({"callbacks": [disguised("group", sig("billing.refund_all"))]}, "a Celery group"),
        ({"errbacks": [disguised("chain", sig("myapp.a"))]}, "a Celery chain"),
        ({"callbacks": [disguised("chord", sig("myapp.a"))]}, "a Celery chord"),
        ({"callbacks": [{**sig("myapp.done"), "chord_size": 3}]}, "not a plain signature"),
        ({"callbacks": [{**sig("myapp.done"), "tasks": []}]}, "carries tasks"),
        ({"callbacks": [sig("myapp.done", queue="victimq")]}, "the queue 'victimq'"),
        ({"callbacks": [{**sig("myapp.done"), "options": {}}]}, "names no queue"),
        ({"callbacks": [sig("myapp.done", exchange="x")]}, "options exchange"),
        ({"callbacks": [sig("myapp.done", routing_key="victimq")]}, "options routing_key"),
        ({"callbacks": [sig("myapp.done", link=sig("myapp.more"))]}, "options link"),
        ({"callbacks": [sig("myapp.done", countdown=5, priority=3)]}, None),
        ({"callbacks": [{**sig("myapp.done"), "options": "x"}]}, "is not a signature"),
    ],
)
def test_link_rule(embed: dict[str, object], refused: str | None) -> None:
    reason = link_refusal(embed, ALLOWED, QUEUES)
    assert (reason is None) if refused is None else (reason is not None and refused in reason)


def test_no_pattern_allows_any_link_by_default() -> None:
    assert link_refusal({"callbacks": [sig("myapp.done")]}, [], QUEUES) is not None
    assert link_refusal({"callbacks": [sig("myapp.done")]}, ALLOWED, []) is not None
    # "*" still never reaches ocrq's or Celery's own tasks.
    assert link_refusal({"callbacks": [sig("celery.group")]}, ["*"], ["*"]) is not None


def test_api_checks_callback_fields(broker_url: str, database_url: str) -> None:
    queue = f"ocr-links-{uuid.uuid4().hex[:6]}"
    token = "t0ken-links-0123456789abcdef"
    auth = {"Authorization": f"Bearer {token}"}
    job = {"image": {"path": "/a.png"}, "callback_url": "https://example.com/hook"}
    plain = Settings(
        broker_url=broker_url, database_url=database_url, queue=queue, api_token=token
    )
    with TestClient(create_app(plain)) as api:
        r = api.post("/jobs", json=job, headers=auth)
        assert r.status_code == 422 and "OCRQ_WEBHOOK_SECRET" in r.text
    signed = plain.model_copy(update={"webhook_secret": "s3cret"})
    with TestClient(create_app(signed)) as api:
        bad = api.post("/jobs", json={**job, "callback_url": "file:///etc/passwd"}, headers=auth)
        assert bad.status_code == 422 and "http or https" in bad.text
        # A batch's webhook has the same rule (one validator for both).
        bad_batch = api.post(
            "/jobs/batch", json={"jobs": [job], "callback_url": "ftp://example.com"}, headers=auth
        )
        assert bad_batch.status_code == 422 and "http or https" in bad_batch.text
        ok = api.post(
            "/jobs", json={**job, "expires_at": "2030-01-01T00:00:00"}, headers=auth
        ).json()
        row = api.get(f"/jobs/{ok['job_id']}", headers=auth).json()
        assert row["expires_at"].startswith("2030-01-01T00:00:00")  # no zone: UTC
        assert row["callback_url"] == "https://example.com/hook"
