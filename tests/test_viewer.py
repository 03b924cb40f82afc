"""The results viewer in a real browser (issue 27, item 14): Debian's chromium, headless, driven
by selenium through chromedriver (scripts/browser.sh installs both), against `ocrq api` in front
of real Redis and PostgreSQL and a real `ocrq worker` whose CPU engine did the jobs.

What a user would check by eye is asserted from the page's layout: one box per line, each where
the line's pixels are once the image is scaled to the page, the text beside it, hostile text
shown as text; and the image route reads nothing a job did not. Screenshots go to a temporary
folder, or to $VIEWER_SCREENSHOTS (docs/img/ holds the ones the docs show).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from sqlalchemy import create_engine, text

from ocrq.api.http import create_app
from ocrq.core.samples import draw_text_image
from ocrq.core.settings import Settings
from tests.conftest import WorkerProcess
from tests.pdfs import image_pdf
from tests.test_api import Uvicorn

TOKEN = "viewer-token-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PAGE_S = 60  # a page (and its images) shown in the browser, at most
HOSTILE = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'


@pytest.fixture(scope="module")
def env(service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = {k: v for k, v in service_env.items() if not k.startswith("OCRQ_API_")}
    uploads = str(tmp_path_factory.mktemp("viewer-uploads"))
    return {**base, "OCRQ_QUEUE": f"ocr-viewer-{uuid.uuid4().hex[:6]}", "OCRQ_UPLOAD_DIR": uploads}


@pytest.fixture(scope="module")
def served(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uvicorn]:
    """`ocrq api` on loopback and a worker."""
    folder = tmp_path_factory.mktemp("viewer")
    worker = WorkerProcess(env, folder / "worker.log", "--concurrency", "4").wait_ready()
    uvicorn = Uvicorn({**env, "OCRQ_API_TOKEN": TOKEN}, folder / "api.log").wait_up()
    yield uvicorn
    uvicorn.stop()
    worker.stop()


@pytest.fixture(scope="module")
def server(served: Uvicorn) -> str:
    return f"http://127.0.0.1:{served.port}"


@pytest.fixture(scope="module")
def api(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers=AUTH, timeout=90) as client:
        yield client


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1200,800")
    service = Service(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wanted = os.environ.get("VIEWER_SCREENSHOTS")
    return Path(wanted) if wanted else tmp_path_factory.mktemp("screenshots")


def screenshot(driver: webdriver.Chrome, path: Path, height: int = 800) -> None:
    """A PNG of the window `height` px tall, in 256 colours (small enough for the docs)."""
    driver.set_window_size(1200, height)
    image = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    image.quantize(256).save(path, optimize=True)
    driver.set_window_size(1200, 800)


def done_job(api: httpx.Client, image: dict[str, Any]) -> dict[str, Any]:
    answer = api.post("/jobs", json={"image": image})
    assert answer.status_code == 202, answer.text
    row = api.get(f"/jobs/{answer.json()['job_id']}", params={"wait": 60}).json()
    assert row["status"] == "done", row
    return row


def open_view(driver: webdriver.Chrome, url: str, images: int) -> None:
    driver.get(url)
    WebDriverWait(driver, PAGE_S).until(
        lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready")
    )
    assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true", (
        driver.find_element(By.ID, "notice").text
    )
    WebDriverWait(driver, PAGE_S).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "svg[data-image=loaded]")) == images
    )


def client_rect(driver: webdriver.Chrome, element: Any) -> dict[str, float]:
    return driver.execute_script(
        "const r = arguments[0].getBoundingClientRect();"
        "return {x: r.left, y: r.top, w: r.width, h: r.height};",
        element,
    )


def assert_page_drawn(driver: webdriver.Chrome, section: Any, page: dict[str, Any]) -> None:
    """One box per line, each at the line's box scaled from the row's pixels to the image as
    the page draws it; the image at the row's aspect ratio; every line's text in the list."""
    lines = page["lines"]
    assert lines, page
    boxes = section.find_elements(By.CSS_SELECTOR, "rect.box")
    items = section.find_elements(By.CSS_SELECTOR, "ol.lines li")
    assert len(boxes) == len(lines) == len(items)
    shown = client_rect(driver, section.find_element(By.CSS_SELECTOR, "image.scan"))
    scale = shown["w"] / page["width"]
    assert 0.2 < scale < 5, shown  # drawn at some size, not collapsed or blown up
    assert shown["h"] == pytest.approx(page["height"] * scale, abs=1.0)
    for box, line, item in zip(boxes, lines, items, strict=True):
        x1, y1, x2, y2 = line["box"]
        drawn = client_rect(driver, box)
        assert drawn["x"] == pytest.approx(shown["x"] + x1 * scale, abs=1.5)
        assert drawn["y"] == pytest.approx(shown["y"] + y1 * scale, abs=1.5)
        assert drawn["w"] == pytest.approx((x2 - x1) * scale, abs=1.5)
        assert drawn["h"] == pytest.approx((y2 - y1) * scale, abs=1.5)
        assert item.text.startswith(line["text"])


def test_a_job_is_drawn_over_its_image(
    api: httpx.Client, server: str, browser: webdriver.Chrome, image_root: Path, shots: Path
) -> None:
    path = image_root / "viewer-invoice.png"
    draw_text_image(["INVOICE 2026", "TOTAL 134.90", "PAID IN FULL"]).save(path)
    row = done_job(api, {"path": str(path)})
    assert len(row["lines"]) >= 2 and "INVOICE" in row["text"].upper()
    image = api.get(f"/jobs/{row['job_id']}/image")
    assert image.status_code == 200 and image.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(image.content)).size == (row["width"], row["height"])

    open_view(browser, f"{server}/view/{row['job_id']}#token={TOKEN}", images=1)
    assert "token=" not in browser.current_url  # out of the address bar and the history
    (section,) = browser.find_elements(By.CSS_SELECTOR, "section.page")
    assert_page_drawn(browser, section, row)
    assert "INVOICE" in section.find_element(By.CSS_SELECTOR, "ol.lines").text.upper()
    screenshot(browser, shots / "viewer-job.png")


def test_hostile_text_is_shown_as_text(
    api: httpx.Client, server: str, browser: webdriver.Chrome, image_root: Path, database_url: str
) -> None:
    """A model's output is whatever the image makes it say: here a recognised line is given a
    script (in its row, as an engine could have written it) that must show as plain text."""
    path = image_root / "viewer-hostile.png"
    draw_text_image(["HELLO THERE"]).save(path)
    row = done_job(api, {"path": str(path)})
    lines = [{**row["lines"][0], "text": HOSTILE}, *row["lines"][1:]]
    engine = create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE ocr_jobs SET lines = CAST(:lines AS json), text = :text WHERE id = :id"),
            {"lines": json.dumps(lines), "text": HOSTILE, "id": row["job_id"]},
        )
    engine.dispose()
    open_view(browser, f"{server}/view/{row['job_id']}#token={TOKEN}", images=1)
    (item, *_) = browser.find_elements(By.CSS_SELECTOR, "ol.lines li")
    assert item.text.startswith(HOSTILE)
    assert browser.execute_script("return window.__xss") is None
    assert not browser.find_elements(By.CSS_SELECTOR, "#pages script, #pages img")
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018
    policy = httpx.get(f"{server}/view/{row['job_id']}").headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy


def test_a_documents_pages_are_drawn(
    api: httpx.Client, server: str, browser: webdriver.Chrome, image_root: Path, shots: Path
) -> None:
    pages = [draw_text_image(["PAGE ONE", "FIRST LINE"]), draw_text_image(["PAGE TWO"])]
    pdf = image_pdf(pages, image_root / "viewer-two-pages.pdf")
    document_id = api.post("/jobs", json={"image": {"path": str(pdf)}}).json()["job_id"]
    deadline = time.monotonic() + 90
    while (doc := api.get(f"/documents/{document_id}").json()).get("status") != "done":
        assert doc.get("status", "not split yet") in ("not split yet", "running"), doc
        assert time.monotonic() < deadline, doc
        time.sleep(0.3)
    assert doc["pages"] == 2 and [p["page"] for p in doc["page_results"]] == [1, 2]
    # The document's own job read no image: it says where the pages' are (it said "the job is
    # done: only done jobs have an image to show").
    whole = api.get(f"/jobs/{document_id}/image")
    assert whole.status_code == 404 and f"GET /documents/{document_id}" in whole.text, whole.text

    for url in (f"/view/documents/{document_id}", f"/view/{document_id}"):
        open_view(browser, f"{server}{url}#token={TOKEN}", images=2)
        sections = browser.find_elements(By.CSS_SELECTOR, "section.page")
        assert len(sections) == 2
        for section, page in zip(sections, doc["page_results"], strict=True):
            assert_page_drawn(browser, section, page)
        assert "PAGE TWO" in sections[1].text.upper()
    screenshot(browser, shots / "viewer-document.png", height=1000)


def test_the_page_asks_for_the_token(
    api: httpx.Client, server: str, browser: webdriver.Chrome, image_root: Path
) -> None:
    path = image_root / "viewer-login.png"
    draw_text_image(["WELCOME BACK"]).save(path)
    row = done_job(api, {"path": str(path)})
    browser.get(f"{server}/view/{row['job_id']}")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    form = WebDriverWait(browser, PAGE_S).until(lambda d: d.find_element(By.ID, "login"))
    WebDriverWait(browser, PAGE_S).until(lambda d: form.is_displayed())
    assert not browser.find_elements(By.CSS_SELECTOR, "section.page")  # nothing without it
    browser.find_element(By.ID, "token").send_keys(TOKEN + "\n")
    WebDriverWait(browser, PAGE_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "svg[data-image=loaded]")
    )
    assert len(browser.find_elements(By.CSS_SELECTOR, "rect.box")) == len(row["lines"])


def test_the_api_docs_render_in_a_browser(
    served: Uvicorn, server: str, browser: webdriver.Chrome, shots: Path
) -> None:
    assert f"results viewer: {server}/view/JOB_ID#token=" in served.log.read_text()
    browser.get(f"{server}/docs")  # `ocrq api` on loopback opens them without the token
    WebDriverWait(browser, PAGE_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock")
    )
    paths = {e.text for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert {"/jobs", "/jobs/{job_id}", "/jobs/{job_id}/image", "/documents/{document_id}"} <= {
        p.replace("\u200b", "") for p in paths
    }
    screenshot(browser, shots / "api-docs.png")


def test_the_image_route_reads_only_what_the_job_read(
    api: httpx.Client,
    server: str,
    browser: webdriver.Chrome,
    image_root: Path,
    broker_url: str,
    database_url: str,
    tmp_path: Path,
) -> None:
    path = image_root / "viewer-changed.png"
    draw_text_image(["CHANGED LATER"]).save(path)
    row = done_job(api, {"path": str(path)})
    assert httpx.get(f"{server}/jobs/{row['job_id']}/image").status_code == 401
    assert httpx.get(f"{server}/view/{row['job_id']}").status_code == 200  # the page: no data

    # The api reads with its own roots: one without the image's folder shows nothing.
    elsewhere = Settings(
        broker_url=broker_url,
        database_url=database_url,
        api_token=TOKEN,
        allowed_roots=[tmp_path],
    )
    with TestClient(create_app(elsewhere), headers=AUTH) as other:
        refused = other.get(f"/jobs/{row['job_id']}/image")
        assert refused.status_code == 404 and "OCRQ_ALLOWED_ROOTS" in refused.json()["detail"]

    draw_text_image(["SOMETHING ELSE"]).save(path)  # rewritten since the job read it
    changed = api.get(f"/jobs/{row['job_id']}/image")
    assert changed.status_code == 404 and "changed" in changed.json()["detail"]

    inline = base64.b64encode(path.read_bytes()).decode()
    row = done_job(api, {"b64": inline})
    kept = api.get(f"/jobs/{row['job_id']}/image")
    assert kept.status_code == 404 and "inline" in kept.json()["detail"]
    # In the browser: the boxes on a blank page of the image's size, the text beside them.
    browser.get(f"{server}/view/{row['job_id']}#token={TOKEN}")
    WebDriverWait(browser, PAGE_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "svg[data-image=none]")
    )
    assert len(browser.find_elements(By.CSS_SELECTOR, "rect.box")) == len(row["lines"]) > 0
    assert not browser.find_elements(By.CSS_SELECTOR, "image.scan")
    # Why there is no image is said on the page, above the blank (it was a hover tooltip).
    note = browser.find_element(By.CSS_SELECTOR, ".sheet .no-image")
    assert note.is_displayed() and "inline" in note.text, note.text
    items = browser.find_elements(By.CSS_SELECTOR, "ol.lines li")
    assert len(items) == len(row["lines"])
    assert all(i.text.startswith(x["text"]) for i, x in zip(items, row["lines"], strict=True))
    assert api.get(f"/jobs/{uuid.uuid4()}/image").status_code == 404
    assert api.get("/jobs/not-a-uuid/image").status_code == 404


def test_a_wrong_address_is_a_404_page_that_drops_the_token(
    server: str, browser: webdriver.Chrome
) -> None:
    """Under /view/ but no viewer address: the page as a 404, which takes `#token=` out of the
    address bar as the viewer does (a JSON 404 had left it in the address and the history)."""
    answer = httpx.get(f"{server}/view/no/such/page")
    assert answer.status_code == 404 and "script-src 'self'" in answer.headers[
        "content-security-policy"
    ]
    assert httpx.get(f"{server}/view/static/viewer.js").status_code == 200  # not shadowed
    for url in ("/view/no/such/page", "/view/", "/view/documents/"):
        browser.get(f"{server}{url}#token={TOKEN}")
        WebDriverWait(browser, PAGE_S).until(
            lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready")
        )
        assert "token=" not in browser.current_url, (url, browser.current_url)
        assert "No such page" in browser.find_element(By.ID, "notice").text


def test_an_upload_is_shown_under_its_own_name(
    api: httpx.Client, server: str, browser: webdriver.Chrome
) -> None:
    """An upload is stored under its SHA-256; the page names it as the client did."""
    png = io.BytesIO()
    draw_text_image(["NAMED UPLOAD"]).save(png, "PNG")
    answer = api.post("/jobs", files={"file": ("Receipt March.png", png.getvalue())})
    assert answer.status_code == 202, answer.text
    row = api.get(f"/jobs/{answer.json()['job_id']}", params={"wait": 60}).json()
    assert row["status"] == "done" and row["file_name"] == "Receipt March.png", row
    open_view(browser, f"{server}/view/{row['job_id']}#token={TOKEN}", images=1)
    meta = browser.find_element(By.CSS_SELECTOR, "section.page .meta").text
    assert "Receipt March.png" in meta and row["path"] in meta, meta
    assert "Receipt March.png" in browser.find_element(By.ID, "title").text
