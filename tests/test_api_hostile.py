"""Hostile request bodies against the real api (`ocrq api` under uvicorn): each is a 4xx with a
short answer, never a 500, and the api serves the next request (issue 31, item 8).

The probe's four 500s: a 100,000-deep JSON body, a deeply nested `image.path`, a `cursor` whose
JSON is nested where GET /jobs expects [time, id], and a NUL in an id of POST /jobs/lookup.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.test_api import TOKEN, Uvicorn, api_env

AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


def cursor_of(value: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


@pytest.fixture(scope="module")
def api(service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    queue = f"ocr-hostile-api-{uuid.uuid4().hex[:6]}"
    env = api_env(service_env, queue, OCRQ_API_TOKEN=TOKEN)
    server = Uvicorn(env, tmp_path_factory.mktemp("api") / "ocrq.api.log").wait_up()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


POSTS = {
    "deep_body": ("/jobs", nested(100_000)),
    "deep_object_body": ("/jobs", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    "deep_image_path": ("/jobs", b'{"image": {"path": ' + nested(100_000) + b"}}"),
    "deep_image_path_5000": ("/jobs", b'{"image": {"path": ' + nested(5_000) + b"}}"),
    "deep_image_path_900": ("/jobs", b'{"image": {"path": ' + nested(900) + b"}}"),  # decodes
    "deep_batch_item": ("/jobs/batch", b'{"jobs": [' + nested(5_000) + b"]}"),
    "deep_lookup_ids": ("/jobs/lookup", b'{"job_ids": ' + nested(5_000) + b"}"),
    "lookup_nul_id": ("/jobs/lookup", json.dumps({"job_ids": ["a\u0000b"]}).encode()),
    "lookup_surrogate_id": ("/jobs/lookup", b'{"job_ids": ["a\\ud800b"]}'),
    "lookup_nul_in_uuid": ("/jobs/lookup", json.dumps({"job_ids": [f"{uuid.uuid4()}\0"]}).encode()),
}  # fmt: skip

CURSORS = {
    "nested": cursor_of([[[["2026-01-01T00:00:00"]]], "x"]),
    "deep": base64.urlsafe_b64encode(nested(3_000)).decode(),
    "nul_id": cursor_of(["2026-01-01T00:00:00+00:00", "a\u0000b"]),
    "nul_time": cursor_of(["2026-01-01\u0000", str(uuid.uuid4())]),
    "not_a_pair": cursor_of({"a": 1}),
}


@pytest.mark.parametrize("case", POSTS)
def test_hostile_post_is_a_4xx(api: str, case: str) -> None:
    path, body = POSTS[case]
    r = httpx.post(api + path, content=body, headers=AUTH, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert len(r.content) < 20_000, len(r.content)  # a short answer, not the input echoed
    assert httpx.get(api + "/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize("case", CURSORS)
def test_hostile_cursor_is_a_422(api: str, case: str) -> None:
    r = httpx.get(api + "/jobs", params={"cursor": CURSORS[case]}, headers=AUTH, timeout=60)
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert "not a cursor from GET /jobs" in r.text


def test_a_nul_in_a_job_path_is_a_404(api: str) -> None:
    r = httpx.get(api + "/jobs/a%00b", headers=AUTH, timeout=30)
    assert r.status_code == 404, (r.status_code, r.text[:300])


def test_lookup_still_answers_real_ids(api: str) -> None:
    """The refusals above are no blanket: a well-formed lookup is answered."""
    job_id = str(uuid.uuid4())
    r = httpx.post(api + "/jobs/lookup", json={"job_ids": [job_id]}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["jobs"][0]["status"] == "unknown", r.text
