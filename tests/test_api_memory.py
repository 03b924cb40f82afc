"""The api's memory under many heavy requests at once (issue 52): `ocrq api` as a user runs it,
a real process under an address-space cap (`prlimit --as`), in front of real Redis and
PostgreSQL; no worker reads its queue (the rows a test needs are written as a worker would).

- `GET /jobs/{id}/image` of a 36 MP PNG (a small file): 20 requests at once took the api from
  97 MB to 3.2 GB and answered 500 MemoryError. Decodes are bounded now (viewer.py, Decodes).
- `POST /documents`: 64 slow 48 MiB uploads at once were buffered whole (47 x 500 and 3.78 GB
  of a 4 GiB cap). They stream to disk now, a bounded number at once (uploads.py).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageDraw
from sqlalchemy import create_engine, text

from tests.conftest import FIGURES
from tests.test_api import api_env
from tests.test_api_limits import MB, Api

TOKEN = "memory-token-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}
IMAGE_REQUESTS = 20
# Peak RSS growth allowed: two decodes of a 36 MP image at once (~250 MB each) and the rest;
# unbounded, 20 of them needed over 3 GB.
MAX_IMAGE_GROWTH = 900 * MB
MAX_UPLOADS = 4
IDLE_S = 1.5
PDF_HEAD = b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n"


@pytest.fixture(scope="module")
def upload_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("memory-uploads")


@pytest.fixture(scope="module")
def api(
    service_env: dict[str, str], upload_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Api]:
    env = api_env(
        service_env,
        f"ocr-memory-{uuid.uuid4().hex[:6]}",
        OCRQ_API_TOKEN=TOKEN,
        OCRQ_UPLOAD_DIR=str(upload_dir),
        OCRQ_API_MAX_UPLOADS=str(MAX_UPLOADS),
        OCRQ_API_BODY_IDLE_S=str(IDLE_S),
    )
    server = Api(env, tmp_path_factory.mktemp("api-memory") / "api.log")
    try:
        yield server
    finally:
        server.stop()


def _big_png(path: Path) -> Path:
    """A 7,200 x 5,000 (36 MP) RGB page with a few words: a few hundred KB as PNG."""
    image = Image.new("RGB", (7200, 5000), "white")
    draw = ImageDraw.Draw(image)
    for i in range(20):
        draw.text((200, 200 + i * 230), f"LINE {i} OF A VERY LARGE SCAN", fill="black")
    image.save(path, compress_level=1)
    return path


def _done_rows(api: Api, database_url: str, path: Path, count: int) -> list[str]:
    """`count` jobs of the image, recorded by the api, marked done as a worker would."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    ids = []
    with httpx.Client(base_url=f"http://127.0.0.1:{api.port}", headers=AUTH) as client:
        for _ in range(count):
            answer = client.post("/jobs", json={"image": {"path": str(path)}})
            assert answer.status_code == 202, answer.text
            ids.append(answer.json()["job_id"])
    engine = create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE ocr_jobs SET status = 'done', sha256 = :d, width = 7200, height = 5000, "
                "text = 'x', lines = CAST('[]' AS json), finished_at = now() WHERE id = ANY(:ids)"
            ),
            {"d": digest, "ids": ids},
        )
    engine.dispose()
    return ids


def test_many_requests_for_a_huge_image_stay_bounded(
    api: Api, database_url: str, image_root: Path
) -> None:
    path = _big_png(image_root / "memory-36mp.png")
    assert path.stat().st_size < 2 * MB
    ids = _done_rows(api, database_url, path, 2)  # two decodes at once, the rest share them
    before = api.peak_rss()
    url = f"http://127.0.0.1:{api.port}"

    def get(i: int) -> httpx.Response:
        return httpx.get(f"{url}/jobs/{ids[i % len(ids)]}/image", headers=AUTH, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(IMAGE_REQUESTS) as pool:
        answers = list(pool.map(get, range(IMAGE_REQUESTS)))
    grew = api.peak_rss() - before
    codes = [a.status_code for a in answers]
    FIGURES.append(
        f"[api-image-36mp] {IMAGE_REQUESTS} requests at once over {len(ids)} jobs: "
        f"{codes.count(200)} x 200, {codes.count(503)} x 503, peak RSS +{grew / MB:.0f} MB"
    )
    for answer in answers:  # each drawn, or told plainly to come back
        assert answer.status_code in (200, 503), (answer.status_code, answer.text[:300])
        if answer.status_code == 503:
            assert "Retry-After" in answer.headers
    assert codes.count(200) >= len(ids), codes
    shown = Image.open(io.BytesIO(answers[codes.index(200)].content))
    assert shown.width * shown.height <= 3_000_000
    assert shown.width / shown.height == pytest.approx(7200 / 5000, rel=0.01)  # boxes line up
    assert grew < MAX_IMAGE_GROWTH, f"peak RSS grew {grew / MB:.0f} MB"
    assert api.proc.poll() is None


def _slow_post(
    port: int, path: str, content_type: str, total: int, sent: int, pause: float = 0.0
) -> tuple[int, bytes, dict[str, str], float]:
    """POST a `total`-byte body of which only `sent` bytes go, 256 KiB at a time with `pause`
    between pieces (a body that stops short stalls); (status, answer body, headers, seconds to
    the status line)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Length: {total}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(60)
    started = time.monotonic()
    body = PDF_HEAD + b"\0" * (sent - len(PDF_HEAD))
    try:
        sock.sendall(head)
        for start in range(0, sent, 256 * 1024):
            sock.sendall(body[start : start + 256 * 1024])
            time.sleep(pause)
    except OSError:  # answered and closed before the rest went: what a refusal may do
        pass
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    took = time.monotonic() - started
    sock.close()
    top, _, rest = answer.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return int(lines[0].split()[1]), rest, headers, took


def test_slow_documents_stream_to_disk_a_bounded_number_at_once(api: Api) -> None:
    """3 x MAX_UPLOADS slow 8 MiB documents at once: MAX_UPLOADS are taken in (streamed to the
    upload folder, not held), the rest are told at once to come back (503, Retry-After); the
    process grows by little. Each had been read whole into memory, however many came."""
    size = 8 * 2**20
    before = api.peak_rss()

    def upload(_: int) -> tuple[int, bytes, dict[str, str], float]:
        return _slow_post(api.port, "/documents", "application/pdf", size, size, pause=0.03)

    with concurrent.futures.ThreadPoolExecutor(3 * MAX_UPLOADS) as pool:
        answers = list(pool.map(upload, range(3 * MAX_UPLOADS)))
    grew = api.peak_rss() - before
    codes = [a[0] for a in answers]
    FIGURES.append(
        f"[api-slow-documents] {len(codes)} slow 8 MiB documents at once, "
        f"OCRQ_API_MAX_UPLOADS={MAX_UPLOADS}: {codes.count(202)} x 202, "
        f"{codes.count(503)} x 503, peak RSS +{grew / MB:.0f} MB"
    )
    assert set(codes) <= {202, 503} and codes.count(202) >= MAX_UPLOADS, codes
    assert codes.count(503) >= MAX_UPLOADS, codes  # refused, not queued behind the others
    for status, body, headers, _took in answers:
        if status == 503:
            assert headers.get("retry-after") and b"OCRQ_API_MAX_UPLOADS" in body, body
    assert grew < 60 * MB, f"peak RSS grew {grew / MB:.0f} MB"


@pytest.mark.parametrize(
    ("path", "kind"), [("/documents", "application/pdf"), ("/jobs", "image/png")]
)
def test_a_stalled_upload_is_cut_off_and_its_partial_file_removed(
    api: Api, upload_dir: Path, path: str, kind: str
) -> None:
    """A body that stops after 1 MiB of 4: a 408 once it has paused OCRQ_API_BODY_IDLE_S, the
    connection closed and nothing left in the upload folder (held 150 s and more before)."""
    status, body, _, took = _slow_post(api.port, path, kind, 4 * 2**20, 2**20)
    assert status == 408 and b"OCRQ_API_BODY_IDLE_S" in body, (status, body[:300])
    assert took < IDLE_S + 10, took
    incoming = upload_dir / ".incoming"
    assert not incoming.exists() or not list(incoming.iterdir())
