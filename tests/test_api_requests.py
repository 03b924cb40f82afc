"""What the api makes of requests a producer got slightly wrong (issue 52): a misspelt query
parameter, a NUL in a batch name, an oversized retry body, a batch whose job id was reused.

Each is answered with a 4xx that says what is wrong and changes nothing; the app runs in
FastAPI's TestClient in front of real Redis and PostgreSQL, no worker reads its queue.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from rich.console import Console
from sqlalchemy import create_engine, text

from ocrq.api.http import create_app
from ocrq.core import export
from ocrq.core.db import get_engine
from ocrq.core.samples import draw_text_image
from ocrq.core.settings import Settings
from ocrq.job_table import print_detail
from tests.pdfs import image_pdf

TOKEN = "requests-token-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def settings(
    broker_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Settings:
    return Settings(
        broker_url=broker_url,
        database_url=database_url,
        upload_dir=tmp_path_factory.mktemp("requests-uploads"),
        queue=f"ocr-requests-{uuid.uuid4().hex[:6]}",
        api_token=TOKEN,
        webhook_secret="requests-secret-" + uuid.uuid4().hex,
    )


@pytest.fixture(scope="module")
def api(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), headers=AUTH) as client:
        yield client


def _unknown(answer: object, name: str) -> None:
    assert getattr(answer, "status_code", None) == 422, getattr(answer, "text", answer)
    (problem,) = answer.json()["detail"]  # type: ignore[attr-defined]
    assert problem["loc"] == ["query", name] and problem["type"] == "extra_forbidden", problem
    assert "unknown query parameter" in problem["msg"]


def test_a_misspelt_query_parameter_is_a_422_on_every_route(
    api: TestClient, image_root: Path
) -> None:
    job = api.post("/jobs", json={"image": {"path": str(image_root / "q.png")}, "batch": "q"})
    job_id = job.json()["job_id"]
    # `?stauts=failed` listed every job; the right spelling still filters.
    _unknown(api.get("/jobs", params={"stauts": "failed"}), "stauts")
    assert api.get("/jobs", params={"status": "failed", "batch": "q"}).json()["jobs"] == []
    assert api.get("/jobs", params={"batch": "q"}).status_code == 200
    _unknown(api.get(f"/jobs/{job_id}", params={"wiat": 5}), "wiat")
    assert api.get(f"/jobs/{job_id}", params={"wait": 0}).status_code == 200
    _unknown(api.get(f"/jobs/{job_id}/image", params={"x": 1}), "x")
    _unknown(api.get("/batches/q", params={"stauts": "failed"}), "stauts")
    _unknown(api.delete(f"/batches/{uuid.uuid4()}", params={"force": 1}), "force")
    _unknown(api.delete(f"/jobs/{uuid.uuid4()}", params={"force": 1}), "force")
    _unknown(api.get(f"/documents/{uuid.uuid4()}", params={"pages": 1}), "pages")
    _unknown(api.post("/jobs/lookup", json={"job_ids": [job_id]}, params={"wait": 1}), "wait")
    _unknown(api.post("/jobs/batch", json={"jobs": []}, params={"batch": "b"}), "batch")
    _unknown(api.post("/jobs/retry", json={"batch": "q"}, params={"all": 1}), "all")
    _unknown(api.get("/healthz", params={"verbose": 1}), "verbose")
    _unknown(api.get("/readyz", params={"verbose": 1}), "verbose")
    # The page of the viewer holds no data and takes what a browser adds to its address.
    assert api.get(f"/view/{job_id}", params={"utm_source": "mail"}).status_code == 200


NUL_BATCH = "bad\x00batch"


def test_a_nul_in_a_batch_name_is_a_422(api: TestClient) -> None:
    """A NUL cannot be stored in (or looked up in) PostgreSQL text: each of these was a 500."""
    answers = {
        "GET /batches": api.get("/batches/bad%00batch"),
        "DELETE /batches": api.delete("/batches/bad%00batch"),
        "GET /jobs?batch": api.get("/jobs", params={"batch": NUL_BATCH}),
        "POST /jobs/retry": api.post("/jobs/retry", json={"batch": NUL_BATCH}),
        "POST /jobs/batch": api.post(
            "/jobs/batch", json={"jobs": [{"image": {"path": "/a.png"}}], "batch": NUL_BATCH}
        ),
        "POST /jobs": api.post("/jobs", json={"image": {"path": "/a.png"}, "batch": NUL_BATCH}),
    }
    for route, answer in answers.items():
        assert answer.status_code == 422, (route, answer.status_code, answer.text[:300])
        assert "NUL" in answer.text, (route, answer.text[:300])
    assert api.get("/healthz").status_code == 200


def test_retry_has_a_body_cap_of_its_own(api: TestClient, settings: Settings) -> None:
    """69 MB of `{}` items took 1.82 GB; now a retry body over what a full list of ids needs
    is a 413, before it is parsed (json_budget.py counts its values as it arrives)."""
    many = b'{"job_ids": [' + b",".join([b"{}"] * 200_000) + b"]}"
    answer = api.post("/jobs/retry", content=many, headers={"Content-Type": "application/json"})
    assert answer.status_code == 413, (answer.status_code, answer.text[:300])
    ids = [str(uuid.uuid4()) for _ in range(settings.api_max_batch)]
    full = api.post("/jobs/retry", json={"job_ids": ids})  # a full list of real ids still fits
    assert full.status_code == 200, full.text[:300]
    assert len(full.json()["not_retried"]) == len(ids)


def test_a_refused_batch_leaves_its_webhook_as_it_was(
    api: TestClient, database_url: str
) -> None:
    """A 409 on POST /jobs/batch (a reused job_id) records nothing: neither its jobs nor its
    webhook. It replaced the batch's URL (batch.finished went to the second caller) and left
    a registration behind for a batch that had none."""
    engine = create_engine(database_url)

    def hook(batch: str) -> str | None:
        with engine.connect() as conn:
            return conn.execute(
                text("SELECT url FROM ocr_batch_hooks WHERE batch = :b"), {"b": batch}
            ).scalar()

    taken = str(uuid.uuid4())
    first = api.post(
        "/jobs/batch",
        json={
            "jobs": [{"image": {"path": "/first.png"}, "job_id": taken}],
            "batch": "hooked",
            "callback_url": "https://first.example/hook",
        },
    )
    assert first.status_code == 202, first.text
    assert hook("hooked") == "https://first.example/hook"
    reused = [{"image": {"path": "/other.png"}, "job_id": taken}]
    for batch in ("hooked", "fresh-" + uuid.uuid4().hex):
        second = api.post(
            "/jobs/batch",
            json={"jobs": reused, "batch": batch, "callback_url": "https://second.example/h"},
        )
        assert second.status_code == 409, second.text
    assert hook("hooked") == "https://first.example/hook"
    with engine.connect() as conn:
        left = conn.execute(
            text("SELECT batch FROM ocr_batch_hooks WHERE url = 'https://second.example/h'")
        ).all()
    engine.dispose()
    assert left == []


def test_an_upload_keeps_its_own_name_for_display(
    api: TestClient, settings: Settings, tmp_path: Path
) -> None:
    """Uploads are stored under their SHA-256, and jobs, `ocrq status`, exports and the viewer
    showed only that. The client's file name is kept beside it, for display only: its last
    part, printable characters, never a path the api writes to."""
    png = io.BytesIO()
    draw_text_image(["NAMED"]).save(png, "PNG")
    sent = {
        "multipart": api.post(
            "/jobs", files={"file": ("C:\\scans\\März receipt.png", png.getvalue())}
        ),
        "raw": api.post(
            "/jobs",
            content=png.getvalue() + b"x",  # another file: another stored path
            params={"file_name": "../../etc/passwd\u202e\u0007.png"},
            headers={"Content-Type": "image/png"},
        ),
        "document": api.post(
            "/documents",
            content=image_pdf([draw_text_image(["PAGE"])], tmp_path / "a.pdf").read_bytes(),
            params={"file_name": "Quarterly report.pdf"},
            headers={"Content-Type": "application/pdf"},
        ),
        "json": api.post("/jobs", json={"image": {"path": str(tmp_path / "p.png")}}),
    }
    expected = {
        "multipart": "März receipt.png",
        "raw": "passwd.png",
        "document": "Quarterly report.pdf",
        "json": None,
    }
    rows = {}
    for how, answer in sent.items():
        assert answer.status_code == 202, (how, answer.text)
        row = api.get(f"/jobs/{answer.json()['job_id']}").json()
        assert row["file_name"] == expected[how], (how, row)
        if how != "json":  # stored by content, whatever the name said
            assert row["path"].startswith(str(settings.upload_dir)), row
            assert expected[how] not in row["path"], row
        rows[how] = row
    listed = api.get("/jobs", params={"limit": 10}).json()["jobs"]
    assert {r["file_name"] for r in listed} >= {"März receipt.png", "passwd.png"}
    names = [p.name for p in settings.upload_dir.rglob("*")]  # type: ignore[union-attr]
    assert not any("passwd" in n or "März" in n for n in names), names

    # `ocrq status ID`: the name on a line of its own.
    shown = io.StringIO()
    print_detail(rows["multipart"], Console(file=shown, width=100))
    assert "file" in shown.getvalue() and "März receipt.png" in shown.getvalue()
    # Exports: a column of its own.
    engine = get_engine(settings.database_url)
    records = {r["job_id"]: r for r in export.rows(engine, None, None)}
    engine.dispose()
    assert records[rows["raw"]["job_id"]]["file_name"] == "passwd.png"
    assert "file_name" in export.FIELDS
