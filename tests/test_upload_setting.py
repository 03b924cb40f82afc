"""Uploads take one setting, OCRQ_UPLOAD_DIR, on the api and on the workers (issue 27, item 8).

Uploads used to be accepted with 202 and then fail on a worker without the api's upload folder
with "outside allowed roots", which told nobody what to set. Here a real api (uvicorn, as the
deploy files start it) and a real `ocrq worker` share one folder: with only OCRQ_UPLOAD_DIR set
on both (no OCRQ_ALLOWED_ROOTS on the worker) an upload is read; a worker without it fails the
job with a message that names the setting; paths that the worker cannot open otherwise keep
the message that says nothing about whether a file exists.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import httpx
import pytest

from ocrq.core.contract import ImageRef
from ocrq.core.settings import Settings
from ocrq.intake import images
from tests.conftest import WorkerProcess
from tests.test_api import Uvicorn

TOKEN = "test-token-" + uuid.uuid4().hex


def _env(service_env: dict[str, str], upload_dir: Path | None, roots: bool) -> dict[str, str]:
    env = {
        k: v
        for k, v in service_env.items()
        if not k.startswith(("OCRQ_API_", "OCRQ_UPLOAD_DIR"))
        and (roots or k != "OCRQ_ALLOWED_ROOTS")
    }
    env["OCRQ_QUEUE"] = f"ocr-upload-{uuid.uuid4().hex[:6]}"
    if upload_dir is not None:
        env["OCRQ_UPLOAD_DIR"] = str(upload_dir)
    return env


def _upload_and_wait(
    worker_env: dict[str, str], api_env: dict[str, str], data: bytes, tmp_path: Path
) -> dict[str, object]:
    """Start the worker and the api, upload `data` as multipart, return the job's final row."""
    worker = WorkerProcess(worker_env, tmp_path / "worker.log", "--concurrency", "2")
    api = None
    try:
        worker.wait_ready()
        api = Uvicorn({**api_env, "OCRQ_API_TOKEN": TOKEN}, tmp_path / "api.log", raw=True)
        api.wait_up()
        with httpx.Client(
            base_url=f"http://127.0.0.1:{api.port}",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=90,
        ) as client:
            accepted = client.post("/jobs", files={"file": ("a.png", data, "image/png")})
            assert accepted.status_code == 202, accepted.text
            row = client.get(f"/jobs/{accepted.json()['job_id']}", params={"wait": 60}).json()
        assert row["status"] in ("done", "failed"), (row, worker.text()[-3000:])
        return row
    finally:
        if api is not None:
            api.stop()
        worker.stop()


def test_an_upload_goes_through_with_only_the_upload_dir(
    service_env: dict[str, str], text_images: dict[str, Path], tmp_path: Path
) -> None:
    uploads = tmp_path / "uploads"  # made by the api on the first upload
    env = _env(service_env, uploads, roots=False)
    assert "OCRQ_ALLOWED_ROOTS" not in env
    data = text_images["hello"].read_bytes()
    row = _upload_and_wait(env, env, data, tmp_path)
    assert row["status"] == "done", row
    assert "HELLO" in str(row["text"]).upper()
    digest = hashlib.sha256(data).hexdigest()
    assert row["path"] == str(uploads.resolve() / digest[:2] / digest)


def test_a_worker_without_the_upload_dir_fails_the_job_naming_it(
    service_env: dict[str, str], text_images: dict[str, Path], tmp_path: Path
) -> None:
    uploads = tmp_path / "uploads"
    api_env = _env(service_env, uploads, roots=True)
    # The worker as compose and Kubernetes used to run it: its image roots, no upload folder.
    worker_env = {**_env(service_env, None, roots=True), "OCRQ_QUEUE": api_env["OCRQ_QUEUE"]}
    row = _upload_and_wait(worker_env, api_env, text_images["invoice"].read_bytes(), tmp_path)
    assert row["status"] == "failed", row
    error = str(row["error"])
    assert "OCRQ_UPLOAD_DIR is not set" in error and str(uploads.resolve()) in error, error
    assert "outside allowed roots" not in error


@pytest.fixture
def upload_file(tmp_path: Path) -> Path:
    data = b"not even an image"
    digest = hashlib.sha256(data).hexdigest()
    path = tmp_path / "api-uploads" / digest[:2] / digest
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return path


def test_the_message_says_which_side_of_the_upload_setting_is_wrong(
    upload_file: Path, tmp_path: Path
) -> None:
    folder = upload_file.parent.parent
    elsewhere = tmp_path / "worker-uploads"
    other = Settings(upload_dir=elsewhere)
    with pytest.raises(images.ImageError) as mismatch:
        images.read_bytes(ImageRef(path=str(upload_file)), other)
    assert f"worker's OCRQ_UPLOAD_DIR is {elsewhere.resolve()}" in str(mismatch.value)
    assert str(folder) in str(mismatch.value)
    # The setting right but the volume not shared: this worker's folder lacks the file.
    digest = "ab" + "0" * 62
    with pytest.raises(images.ImageError, match=r"not found in OCRQ_UPLOAD_DIR .*volume mounted"):
        images.read_bytes(ImageRef(path=str(elsewhere / "ab" / digest)), other)
    # The same worker reads it once its folder is the api's.
    mine = Settings(upload_dir=folder)
    assert images.read_bytes(ImageRef(path=str(upload_file)), mine) == upload_file.read_bytes()
    # Other paths keep the message that does not tell a missing file from a refused one.
    for path in (tmp_path / "missing.png", Path("/etc/passwd")):
        with pytest.raises(images.ImageError, match="not found or outside allowed roots"):
            images.read_bytes(ImageRef(path=str(path)), other)
