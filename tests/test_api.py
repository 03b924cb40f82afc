"""The HTTP api's safe defaults: bearer auth, body and field limits, 422s that echo nothing.

FastAPI's TestClient for the rules, a real uvicorn process for what only a server shows: that it
refuses to start unconfigured, and that a chunked body over the limit is cut off while it is
still arriving. Real Redis and PostgreSQL behind it (conftest fixtures).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from ocrq.api.http import create_app
from ocrq.core.settings import Settings
from tests.conftest import BIN, FIGURES
from tests.servers import free_port

TOKEN = "test-token-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT = 1024 * 1024  # a small body limit, so the tests move little data


@pytest.fixture(scope="module")
def queue() -> str:
    """Jobs these tests enqueue go to a queue no worker reads."""
    return f"ocr-api-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def settings(broker_url: str, database_url: str, queue: str) -> Settings:
    return Settings(
        broker_url=broker_url,
        database_url=database_url,
        queue=queue,
        api_token=TOKEN,
        api_max_body_bytes=LIMIT,
    )


@pytest.fixture(scope="module")
def api(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as client:
        yield client


def test_every_endpoint_but_healthz_needs_the_token(api: TestClient, image_root: Path) -> None:
    job = {"image": {"path": str(image_root / "a.png")}}
    assert api.get("/healthz").json() == {"status": "ok"}
    # The root says where things are, without the token (it was a 401, a 404 with it).
    index = api.get("/")
    assert index.status_code == 200 and index.json()["docs"] == "/docs", index.text
    assert api.post("/jobs", json=job).status_code == 401
    assert api.post("/jobs", json=job, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert api.post("/jobs", json=job, headers={"Authorization": TOKEN}).status_code == 401
    missing = api.get(f"/jobs/{uuid.uuid4()}")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    for path in ("/docs", "/openapi.json", "/nope"):
        assert api.get(path).status_code == 401
    created = api.post("/jobs", json=job, headers=AUTH)
    assert created.status_code == 202
    job_id = created.json()["job_id"]
    row = api.get(f"/jobs/{job_id}", headers=AUTH).json()
    assert row["job_id"] == job_id and row["status"] == "queued"
    assert api.get(f"/jobs/{job_id.upper()}", headers=AUTH).json()["job_id"] == job_id
    assert api.get("/jobs/not-a-uuid", headers=AUTH).status_code == 404
    assert api.get("/openapi.json", headers=AUTH).status_code == 200  # docs behind the token


def test_body_over_the_limit_is_413(api: TestClient) -> None:
    big = {"image": {"b64": "A" * LIMIT}}
    assert api.post("/jobs", json=big, headers=AUTH).status_code == 413
    # A body without Content-Length (chunked) is counted while it is read.
    chunks = (b'{"image": {"b64": "' + b"A" * 4096 for _ in range(LIMIT // 4096 + 8))
    assert api.post("/jobs", content=chunks, headers=AUTH).status_code == 413
    fits = {"image": {"b64": "A" * (LIMIT // 2)}}
    assert api.post("/jobs", json=fits, headers=AUTH).status_code == 202


def test_422_names_fields_and_echoes_nothing(broker_url: str, database_url: str) -> None:
    """With the production default body limit a 10 MB task is read, refused by its length,
    and the answer is a few hundred bytes, not the task sent back."""
    app = create_app(Settings(broker_url=broker_url, database_url=database_url, api_token=TOKEN))
    marker = "SECRET-" + uuid.uuid4().hex
    with TestClient(app) as api:
        task = marker + "x" * 10_000_000
        r = api.post("/jobs", json={"image": {"path": "/a.png"}, "task": task}, headers=AUTH)
        assert r.status_code == 422 and len(r.content) < 2000
        assert marker not in r.text and "input" not in r.json()["detail"][0]
        assert r.json()["detail"][0]["loc"] == ["body", "task"]
        assert "4000" in r.json()["detail"][0]["msg"]
        r = api.post(
            "/jobs", json={"image": {"path": marker, "url": "http://" + marker}}, headers=AUTH
        )
        assert r.status_code == 422 and marker not in r.text
        assert "exactly one" in r.text
        key = marker * 5
        r = api.post("/jobs", json={"image": {"path": "/a.png", key: 1}}, headers=AUTH)
        assert r.status_code == 422 and key not in r.text  # a client's key is cut short
        many = {"image": {f"k{i}": i for i in range(500)}}
        body = api.post("/jobs", json=many, headers=AUTH).json()
        assert len(body["detail"]) == 20 and body["more_errors"] > 0
        r = api.post("/jobs", content=b'{"image": ' + marker.encode(), headers=AUTH)
        assert r.status_code == 422 and marker not in r.text
        for bad in ({"path": "/a\x00b.png"}, {"path": "/" + "a" * 9000}):
            assert api.post("/jobs", json={"image": bad}, headers=AUTH).status_code == 422
        # An empty image says so, not that a field is missing.
        empties = {"b64": "image is empty (0 bytes)", "path": "image path is empty"}
        for key, said in empties.items():
            r = api.post("/jobs", json={"image": {key: ""}}, headers=AUTH)
            assert r.status_code == 422 and said in r.text and "exactly one" not in r.text, r.text


def test_app_without_lifespan_fails_closed(broker_url: str, database_url: str) -> None:
    """Mounted by something that skips the startup check, an unconfigured app still serves
    nothing but /healthz."""
    app = create_app(Settings(broker_url=broker_url, database_url=database_url))
    api = TestClient(app)  # not entered: no lifespan
    assert api.get("/healthz").status_code == 200
    assert api.post("/jobs", json={"image": {"path": "/a.png"}}).status_code == 503


class Uvicorn:
    """The api as a user starts it: `ocrq api` (or, `raw`, uvicorn itself, as the deploy
    files do)."""

    def __init__(self, env: dict[str, str], log: Path, raw: bool = False) -> None:
        self.port = free_port()
        self.log = log
        launcher = [str(BIN / "uvicorn"), "ocrq.api.http:app"] if raw else [str(BIN / "ocrq"),
                                                                           "api"]
        self.proc = subprocess.Popen(
            [*launcher, "--host", "127.0.0.1", "--port", str(self.port)],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def wait_up(self, timeout: float = 60) -> Uvicorn:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError(self.log.read_text())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def api_env(service_env: dict[str, str], queue: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in service_env.items() if not k.startswith("OCRQ_API_")}
    return {**env, "OCRQ_QUEUE": queue, **extra}


@pytest.mark.parametrize(("token", "raw"), [(None, False), ("Zq7-tiny", False), (None, True)])
def test_uvicorn_refuses_to_start_without_a_token(
    token: str | None, raw: bool, service_env: dict[str, str], queue: str, tmp_path: Path
) -> None:
    env = api_env(service_env, queue, **({"OCRQ_API_TOKEN": token} if token else {}))
    server = Uvicorn(env, tmp_path / "ocrq.api.log", raw=raw)
    try:
        code = server.proc.wait(60)
    finally:
        if server.proc.poll() is None:
            server.stop()
    log = server.log.read_text()
    assert code != 0, log
    assert "ocrq api cannot start: OCRQ_API_TOKEN" in log
    assert token is None or token not in log  # never printed
    assert "16 characters" in log and "openssl rand -hex 32" in log, log  # how to make one
    if not raw:  # `ocrq api`: one line and the settings' exit code, as every other command
        assert code == 78, log
        assert "Traceback" not in log and len(log.strip().splitlines()) == 1, log


def test_uvicorn_without_auth_only_when_told(
    service_env: dict[str, str], queue: str, tmp_path: Path
) -> None:
    env = api_env(service_env, queue, OCRQ_API_ALLOW_NO_AUTH="true")
    server = Uvicorn(env, tmp_path / "ocrq.api.log").wait_up()
    try:
        r = httpx.post(
            f"http://127.0.0.1:{server.port}/jobs", json={"image": {"path": "/a.png"}}, timeout=10
        )
    finally:
        server.stop()
    assert r.status_code == 202 and uuid.UUID(r.json()["job_id"])


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    sock.settimeout(10)
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_uvicorn_cuts_off_a_chunked_body_over_the_limit(
    service_env: dict[str, str], queue: str, tmp_path: Path
) -> None:
    """A client streams an endless chunked body: the server answers 413 once it has taken in
    just over the limit and closes, instead of buffering what the client keeps sending."""
    env = api_env(service_env, queue, OCRQ_API_TOKEN=TOKEN, OCRQ_API_MAX_BODY_BYTES=str(LIMIT))
    server = Uvicorn(env, tmp_path / "ocrq.api.log").wait_up()
    try:
        # Unauthenticated, with a 10 GB Content-Length and no body: answered from the headers.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(
                b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 10000000000\r\n\r\n"
            )
            head = _read_response(sock)
        assert head.startswith((b"HTTP/1.1 401", b"HTTP/1.1 413")), head

        sent = 0
        chunk = b"A" * 65536
        frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        opening = b'{"image": {"b64": "'
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(
                b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {TOKEN}\r\n".encode()
                + b"Transfer-Encoding: chunked\r\n\r\n"
                + f"{len(opening):x}\r\n".encode()
                + opening
                + b"\r\n"
            )
            sock.settimeout(0.05)
            response = b""
            while sent < 200 * LIMIT:  # 200 MiB if nothing stopped it
                try:
                    sock.sendall(frame)
                    sent += len(chunk)
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    break
                try:
                    response = sock.recv(65536)
                    if response:
                        break
                except TimeoutError:
                    pass
            if not response:
                response = _read_response(sock)
    finally:
        server.stop()
    FIGURES.append(f"[api-chunked-413] bytes sent before the 413: {sent} (limit {LIMIT})")
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert sent < 8 * LIMIT, f"server took {sent} bytes before answering"


def test_post_and_get_through_uvicorn(
    service_env: dict[str, str], queue: str, tmp_path: Path
) -> None:
    env = api_env(service_env, queue, OCRQ_API_TOKEN=TOKEN)
    server = Uvicorn(env, tmp_path / "ocrq.api.log").wait_up()
    base = f"http://127.0.0.1:{server.port}"
    try:
        created = httpx.post(
            f"{base}/jobs", json={"image": {"url": "https://example.org/a.png"}}, headers=AUTH
        )
        job_id = created.json()["job_id"]
        row = httpx.get(f"{base}/jobs/{job_id}", headers=AUTH).json()
        denied = httpx.get(f"{base}/jobs/{job_id}")
    finally:
        server.stop()
    assert created.status_code == 202 and row["status"] == "queued"
    assert denied.status_code == 401 and "example.org" not in denied.text
    assert json.loads(denied.text) == {"detail": "missing or wrong bearer token"}


def test_ocrq_api_opens_its_docs_on_loopback_only(
    service_env: dict[str, str], queue: str, tmp_path: Path
) -> None:
    """`ocrq api` on 127.0.0.1: /docs and its assets open in a browser without the token, the
    api itself does not; OCRQ_API_DOCS=token keeps the docs behind it too."""
    token = "T" * 40
    for docs_setting, docs_open in ((None, True), ("token", False)):
        extra = {"OCRQ_API_TOKEN": token, **({"OCRQ_API_DOCS": docs_setting}
                                             if docs_setting else {})}
        server = Uvicorn(api_env(service_env, queue, **extra), tmp_path / f"{docs_setting}.log")
        try:
            base = f"http://127.0.0.1:{server.wait_up().port}"
            page = httpx.get(f"{base}/docs", timeout=10)
            assert (page.status_code == 200) == docs_open, (docs_setting, page.status_code)
            assert httpx.get(f"{base}/jobs/{uuid.uuid4()}", timeout=10).status_code == 401
        finally:
            server.stop()


def test_openapi_describes_every_route_behind_the_token(
    service_env: dict[str, str], queue: str, tmp_path: Path
) -> None:
    """The served schema marks each route behind the token with the bearer scheme (the
    `/documents` routes lacked it) and says what `POST /documents` takes (it declared no
    body); a client built from the schema then works: its upload is accepted."""
    from ocrq.core.samples import draw_text_image
    from tests.pdfs import image_pdf

    server = Uvicorn(api_env(service_env, queue, OCRQ_API_TOKEN=TOKEN), tmp_path / "api.log")
    pdf = image_pdf([draw_text_image(["HELLO WORLD"])], tmp_path / "one.pdf").read_bytes()
    try:
        base = f"http://127.0.0.1:{server.wait_up().port}"
        schema = httpx.get(f"{base}/openapi.json", headers=AUTH, timeout=10).json()
        denied = httpx.post(f"{base}/documents", content=pdf, timeout=10)
        upload = httpx.post(
            f"{base}/documents",
            content=pdf,
            headers={**AUTH, "Content-Type": "application/pdf"},
            timeout=10,
        )
    finally:
        server.stop()
    schemes = schema["components"]["securitySchemes"]
    bearer = [name for name, s in schemes.items() if s == {"type": "http", "scheme": "bearer"}]
    assert len(bearer) == 1, schemes
    operations = {
        (path, method): op for path, ops in schema["paths"].items() for method, op in ops.items()
    }
    assert {("/documents", "post"), ("/documents/{document_id}", "get")} <= set(operations)
    for (path, method), op in operations.items():
        secured = {bearer[0]: []} in op.get("security", [])
        assert secured == (path not in ("/healthz", "/readyz")), (path, method, op)
    body = operations[("/documents", "post")]["requestBody"]
    assert body["required"] is True
    for media in ("application/pdf", "image/tiff"):
        assert body["content"][media]["schema"] == {"type": "string", "format": "binary"}
    accepted = operations[("/documents", "post")]["responses"]["202"]["content"]
    ref = accepted["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    required = set(schema["components"]["schemas"][ref]["required"])
    assert denied.status_code == 401
    assert upload.status_code == 202 and required <= set(upload.json()), upload.text
    assert upload.json()["document_id"] == upload.json()["job_id"]


def test_invalid_base64_is_a_422_and_nothing_is_queued(
    service_env: dict[str, str], broker_url: str, tmp_path: Path
) -> None:
    """Inline bytes that are not base64 were recorded and sent, and failed only in the worker:
    through `ocrq api` they are a 422 naming `image.b64`, with no row and no message, alone or
    in a batch. Every form a worker decodes (MIME-wrapped, a data: URL, URL-safe, unpadded)
    is still accepted."""
    import base64

    import redis

    queue = f"ocr-b64-{uuid.uuid4().hex[:6]}"
    server = Uvicorn(api_env(service_env, queue, OCRQ_API_TOKEN=TOKEN), tmp_path / "api.log")
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4).decode()
    urlsafe = base64.urlsafe_b64encode(b"\xfb\xff" + bytes(range(200))).decode().rstrip("=")
    good = [png, "\n".join(png[i : i + 76] for i in range(0, len(png), 76)),
            "data:image/png;base64," + png, urlsafe]
    bad = ["@@not base64@@", "data:image/png,iVBORw0KGgo", png[:-5] + "!" + png[-4:], "A"]
    ids = [str(uuid.uuid4()) for _ in bad]
    try:
        base = f"http://127.0.0.1:{server.wait_up().port}"
        with httpx.Client(base_url=base, headers=AUTH, timeout=30) as api:
            refused = [
                api.post("/jobs", json={"image": {"b64": text}, "job_id": job_id})
                for text, job_id in zip(bad, ids, strict=True)
            ]
            batch = api.post("/jobs/batch", json={"jobs": [
                {"image": {"b64": png}, "job_id": str(uuid.uuid4())},
                {"image": {"b64": bad[0]}, "job_id": ids[0]},
            ]})
            unknown = [api.get(f"/jobs/{job_id}").status_code for job_id in ids]
            left = redis.Redis.from_url(broker_url).llen(queue)
            accepted = [api.post("/jobs", json={"image": {"b64": text}}) for text in good]
    finally:
        server.stop()
    for r in refused:
        assert r.status_code == 422, r.text
        (error,) = r.json()["detail"]
        assert error["loc"] == ["body", "image"], error
        assert "image.b64: invalid base64 image" in error["msg"], error
    assert batch.status_code == 422 and "image.b64" in batch.text, batch.text
    assert batch.json()["detail"][0]["loc"] == ["body", "jobs", 1, "image"], batch.text
    assert unknown == [404] * len(ids) and left == 0  # no row, no message
    assert [r.status_code for r in accepted] == [202] * len(good), [r.text for r in accepted]
