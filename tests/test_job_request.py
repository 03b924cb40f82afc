"""JobRequest, the one spelling of a job (issue 28): the api's JobIn takes its fields from it,
messages and rows are made by it, a document's page jobs copy it, re-sends rebuild it from the
row. The walk of `max_new_tokens`: before, it was lost at every edge (no api field, dropped by
`job_kwargs`, not given to a document's pages, no column, so a re-sent job lost its cap).

The first tests need nothing running; the others use a Redis and a migrated database of their
own (tests/test_recovery.py `own_services`: `ocrq requeue` re-sends every lost `queued` row),
and read the messages from the queues, where no worker takes them.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from PIL import Image

from ocrq.api.client import Client
from ocrq.api.http import create_app
from ocrq.api.routes import UPLOAD_FIELDS
from ocrq.api.schemas import JobIn
from ocrq.core.contract import INTERACTIVE, JobRequest, job_kwargs, queue_for
from ocrq.core.db import ocr_jobs
from ocrq.core.documents_store import DocumentStore
from ocrq.core.settings import Settings
from ocrq.core.store import NewJob
from ocrq.intake import documents, splitting
from tests.conftest import BIN
from tests.pdfs import image_pdf
from tests.test_recovery import own_services  # noqa: F401 (a fixture)

TOKEN = "test-token-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}

# Every field set away from its default: what each way a job travels must carry whole.
FULL = {
    "image": {"path": "/data/scan.png", "page": 2},
    "task": "parse",
    "job_id": str(uuid.uuid4()),
    "max_pixels": 250_000,
    "max_new_tokens": 77,
    "priority": INTERACTIVE,
    "batch": "claims-7",
    "retry": 3,
}


def test_every_job_request_field_has_an_api_field_a_column_and_a_message_key() -> None:
    """The api schema and JobRequest cannot drift: JobIn's job fields are JobRequest's, with the
    same types, limits and defaults (its JSON schema says so), save `retry` (ocrq's own) and
    `job_id` (optional at the api); every field is a column and a message key, and a row read
    back is the same job."""
    assert set(FULL) == set(JobRequest.model_fields), "FULL must set every field"
    job_fields = set(JobRequest.model_fields) - set(JobRequest.INTERNAL)
    assert job_fields <= set(JobIn.model_fields)
    assert set(JobIn.model_fields) - job_fields == {"expires_at", "callback_url"}
    want = JobRequest.model_json_schema()["properties"]
    got = JobIn.model_json_schema()["properties"]
    for name in job_fields - {"job_id", "image"}:
        assert got[name] == want[name], name
    assert "retry" not in got  # a producer cannot pick a re-run generation
    # An upload's form fields and a raw body's query parameters: the same job fields.
    assert set(UPLOAD_FIELDS) == job_fields - {"image"}
    spec = create_app(Settings(api_token=TOKEN)).openapi()["paths"]["/jobs"]["post"]
    # ... plus a raw body's own name, shown with the job (display only: not a job field).
    assert {p["name"] for p in spec["parameters"]} == {*UPLOAD_FIELDS, "file_name"}
    request = JobRequest.model_validate(FULL)
    columns = request.columns()
    assert set(columns) <= set(ocr_jobs.c.keys())
    assert set(columns) <= {f.name for f in dataclasses.fields(NewJob)}
    assert JobRequest.from_row(columns) == request
    assert JobRequest.from_row(dataclasses.asdict(NewJob.of(request))) == request
    message = request.message()
    assert message == {**FULL, "image": FULL["image"]}
    assert job_kwargs(FULL["image"], **{k: v for k, v in FULL.items() if k != "image"}) == message
    assert JobRequest.model_validate(message) == request
    bare = JobRequest.model_validate({"image": {"path": "/x.png"}})
    assert set(bare.message()) == {"image", "task", "job_id"}  # defaults left to the worker
    # A row from before migrations/0009: NULL cap and lane are the defaults.
    old = {**bare.columns(), "max_new_tokens": None, "priority": None}
    assert JobRequest.from_row(old) == bare


def test_api_max_new_tokens_is_validated_as_the_worker_does() -> None:
    """The api takes the field, bounded as the worker's JobRequest bounds it (the same limit
    as OCRQ_MAX_NEW_TOKENS), and carries it into the request."""
    ok = JobIn.model_validate({"image": {"path": "/a.png"}, "max_new_tokens": 5})
    assert ok.request().max_new_tokens == 5
    top = JobRequest.model_fields["max_new_tokens"].metadata
    limit = next(m.le for m in top if hasattr(m, "le"))
    assert limit == Settings.model_fields["max_new_tokens"].metadata[-1].le
    for bad in (0, -1, limit + 1, "many"):
        with pytest.raises(ValueError):
            JobIn.model_validate({"image": {"path": "/a.png"}, "max_new_tokens": bad})
    assert JobIn.model_validate({"image": {"path": "/a.png"}, "max_new_tokens": limit})


def _messages(r: redis.Redis, queue: str) -> dict[str, dict[str, Any]]:
    """The kwargs of the messages waiting in a queue (kombu's Redis layout), by job id."""
    out = {}
    for raw in r.lrange(queue, 0, -1):
        _, kwargs, _ = json.loads(base64.b64decode(json.loads(raw)["body"]))
        out[kwargs["job_id"]] = kwargs
    return out


def test_max_new_tokens_and_lane_kept_from_submit_to_every_re_send(
    own_services: tuple[dict[str, str], str],  # noqa: F811
    image_root: Path,
) -> None:
    """Submitted through the api and through the Python producer, a job's cap and lane are in
    its row and its message; a document's page jobs carry its cap in their rows and messages;
    `ocrq requeue` (messages lost) and `ocrq retry` (a failed job) re-send each with its cap,
    into its lane's queue."""
    env, database_url = own_services
    queue = f"ocr-jr-{uuid.uuid4().hex[:6]}"
    fast = queue_for(INTERACTIVE, queue)
    settings = Settings(
        broker_url=env["OCRQ_BROKER_URL"],
        database_url=database_url,
        queue=queue,
        api_token=TOKEN,
        allowed_roots=[image_root],
    )
    r = redis.Redis.from_url(env["OCRQ_BROKER_URL"])
    client = Client(settings)
    folder = image_root / f"jr-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    png = folder / "a.png"
    Image.new("RGB", (64, 32), "white").save(png)

    with TestClient(create_app(settings), headers=AUTH) as api:
        answer = api.post(
            "/jobs",
            json={"image": {"path": str(png)}, "max_new_tokens": 7, "priority": INTERACTIVE},
        )
        assert answer.status_code == 202, answer.text
        by_api = answer.json()["job_id"]
        shown = api.get(f"/jobs/{by_api}").json()
        assert (shown["max_new_tokens"], shown["priority"]) == (7, INTERACTIVE), shown
        refused = api.post("/jobs", json={"image": {"path": str(png)}, "max_new_tokens": 0})
        assert refused.status_code == 422, refused.text
        raw = api.post(
            "/jobs",
            content=png.read_bytes(),
            headers={"Content-Type": "image/png"},
            params={"max_new_tokens": 8},
        )
        assert raw.status_code in (202, 415), raw.text  # 415: this api keeps no uploads
    by_producer = client.submit({"path": str(png)}, max_new_tokens=9, batch="jr")
    rows = client.store.get([by_api, by_producer])
    assert (rows[by_api]["max_new_tokens"], rows[by_api]["priority"]) == (7, INTERACTIVE)
    assert (rows[by_producer]["max_new_tokens"], rows[by_producer]["priority"]) == (9, "bulk")
    assert _messages(r, fast)[by_api]["max_new_tokens"] == 7
    assert _messages(r, queue)[by_producer]["max_new_tokens"] == 9

    # A document's pages: copies of its request (cap, lane, batch) in their rows and messages.
    pdf = image_pdf([Image.new("RGB", (200, 100), "white")] * 2, folder / "two.pdf")
    doc_request = JobRequest.model_validate(
        {"image": {"path": str(pdf)}, "max_new_tokens": 11, "priority": INTERACTIVE, "batch": "d"}
    )
    sent: list[JobRequest] = []
    taken = documents.take(doc_request.image, settings)
    assert isinstance(taken, documents.Document)
    with taken:
        pages = splitting.split(
            doc_request,
            taken,
            settings,
            DocumentStore(client.store.engine),
            client.store,
            lambda _doc, page: sent.append(page),
        )
    assert pages == 2 and len(sent) == 2
    for n, page in enumerate(sent, start=1):
        assert page.image.page == n and page.job_id == splitting.page_job_id(doc_request.job_id, n)
        want = doc_request.model_copy(update={"image": page.image, "job_id": page.job_id})
        assert page == want, page
    page_rows = client.store.get([p.job_id for p in sent])
    kept = {(row["max_new_tokens"], row["priority"], row["batch"]) for row in page_rows.values()}
    assert kept == {(11, INTERACTIVE, "d")}, kept

    # `ocrq requeue`: the messages are lost (the queues emptied); each is rebuilt from its row.
    r.delete(queue, fast)
    cli = subprocess.run(
        [str(BIN / "ocrq"), "requeue", "--older-than", "0"],
        env={**os.environ, **env, "OCRQ_QUEUE": queue},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    resent = set(cli.stdout.split())
    assert {by_api, by_producer, *(p.job_id for p in sent)} <= resent, cli.stdout
    bulk_msgs, fast_msgs = _messages(r, queue), _messages(r, fast)
    assert fast_msgs[by_api]["max_new_tokens"] == 7 and by_api not in bulk_msgs
    assert bulk_msgs[by_producer]["max_new_tokens"] == 9
    assert bulk_msgs[by_producer]["batch"] == "jr"
    for page in sent:
        assert fast_msgs[page.job_id]["max_new_tokens"] == 11, fast_msgs[page.job_id]
        assert fast_msgs[page.job_id]["image"] == page.image.model_dump(exclude_none=True)

    # `ocrq retry` of a failed job: the re-run's message keeps the cap, with its generation.
    r.delete(queue, fast)
    client.store.finish(by_producer, status="failed", error="boom")
    cli = subprocess.run(
        [str(BIN / "ocrq"), "retry", by_producer],
        env={**os.environ, **env, "OCRQ_QUEUE": queue},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    again = _messages(r, queue)[by_producer]
    assert (again["max_new_tokens"], again["retry"], again["batch"]) == (9, 1, "jr"), again
