"""Issue 16's probe, kept: every hostile case it tried, sent together to one real capped worker.

The part tests (test_intake_security, test_messages, test_rapid_bounds, ...) check each fix on
its own. This module checks that they hold together, the way the probe found the holes: one
`ocrq worker` (engine rapid) under an address-space cap gets every case in one mixed run, so
hostile jobs share batches, task threads and the broker connection with good ones. Each case
names how it is sent (a producer's `send_task` kwargs, or bytes pushed onto the queue's Redis
list the way kombu stores messages), the final row status it must end in (or "rejected": one
log line, and no row but, for a bad job id, a failed one under the task id) and a short, stable
fragment of its error. One pytest item per case reads the shared run's results, so a regression
names its case.

Targets are loopback only: a "secret" image server on 127.0.0.1 stands for what a job must
never read; a "public" one on 127.0.0.3, the only address the worker's allowlist lets through,
stands for the internet (its redirects to loopback must be refused all the same).

Findings that cannot be sent as a job stay with their part tests: API bodies, auth and 422s
(test_api), deploy files (test_deploy_files), workers killed mid-job, the redelivery cap and
heartbeats (test_messages, test_liveness). About 30 s here (2 cores).
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, Signature
from PIL import Image
from sqlalchemy import func, select

from bench.rapid_memory import long_line, long_line_text, text_page, thin, words
from bench.scoring import cer
from ocrq.core.contract import NAME_REFUSED
from ocrq.core.db import get_engine, ocr_jobs
from ocrq.core.samples import draw_text_image
from ocrq.core.store import REUSED_ID, JobStore, now
from ocrq.intake.fetch import NOT_FETCHED
from ocrq.worker.envelope import REFUSED_HEADER
from tests.badfiles import png_bomb, write_bad_files
from tests.conftest import FIGURES
from tests.servers import free_port
from tests.test_faults import WORDS
from tests.test_intake_security import EPS, PUBLIC, SECRET, LoopServer, png, transparent_text
from tests.test_messages import malformed_cases, task_message
from tests.test_rapid_bounds import CappedWorker

GiB = 1024**3
MiB = 1024**2
CAP = 6 * GiB  # the worker's address space (prlimit --as)
MAX_IMAGE_BYTES = 4 * MiB  # the worker's OCRQ_MAX_IMAGE_BYTES: oversized inputs stay cheap
URL_DEADLINE_S = 3  # the worker's OCRQ_URL_DEADLINE_S: a slow loris is cut after this
PUBLIC_HOST = "127.0.0.3"  # the only internal address the worker's allowlist lets through
PASSWORD = "pw-probe-9911"  # a URL credential: never stored, shown or logged
SECRET_WORDS = ("SECRET", "4711")  # the text of the image only a refused read could return
URL_REFUSED = NOT_FETCHED  # "URL not fetched (not allowed, ...): "
PATH_REFUSED = "image not found or outside allowed roots"
PATH_ERROR = PATH_REFUSED + ": {} (path images must be regular files under OCRQ_ALLOWED_ROOTS)"
INVALID = "invalid job request"
REJECTED_MESSAGE = "rejected a malformed message"
REJECTED_ID = "rejected a request without a valid job id"
MEMORY_FAILURES = ("MemoryError", "bad_alloc", "Failed to allocate", "std::")


# --- how cases are sent ----------------------------------------------------------------------


@dataclass
class Sent:
    """What a case put on the queue, in order, and how to find its outcome."""

    # ("task", kwargs) via send_task, ("task", (kwargs, send_task options)), or ("raw", bytes)
    # LPUSHed
    messages: list[tuple[str, Any]]
    job_id: str | None = None  # the canonical id its row must have (None: no row expected)
    marker: str | None = None  # what the log line of a rejected message carries
    # The Celery task id it is sent under (else a fresh one): a request whose job id is
    # unusable fails under its task id, the id send_task returned (issue 27).
    task_id: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # whatever the case's check needs


class Ctx:
    """Where a case's input lives: the allowed root, a folder outside it, the two servers."""

    def __init__(self, root: Path, outside: Path, secret: LoopServer, public: LoopServer):
        self.root, self.outside, self.secret, self.public = root, outside, secret, public
        self.secret_file = outside / "secret.png"
        self.secret_file.write_bytes(SECRET)
        self.bad = write_bad_files(root / "bad")
        self.race = Race(root, outside)
        self.queue = ""  # the worker's queue, set by the run

    def page(self) -> str:
        """The 39.6 MP page, drawn once for all the jobs that read it."""
        path = self.root / "page.png"
        if not path.exists():
            text_page(PAGE_SIZE, 96, every=12).save(path)
        return str(path)

    def file(self, name: str, data: bytes | Image.Image) -> str:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, Image.Image):
            data.save(path, "PNG")
        else:
            path.write_bytes(data)
        return str(path)

    def text_file(self, name: str, text: str) -> str:
        return self.file(f"{name}.png", text_image(text))


class Race:
    """A folder inside the root swapped for a symlink to an outside one, again and again, while
    jobs read a file in it: each read sees the inside file or is refused, never the outside one
    (the probe got the outside image's text in 13 of 300 rows)."""

    TEXT = "NOVEMBER OSCAR 818"

    def __init__(self, root: Path, outside: Path) -> None:
        self.inside, self.parked = root / "race", root / "race.real"
        self.inside.mkdir()
        text_image(self.TEXT).save(self.inside / "img.png")
        (outside / "race").mkdir()
        (outside / "race" / "img.png").write_bytes(SECRET)
        self.target = outside / "race"
        self.flips = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flip, daemon=True)

    def _flip(self) -> None:
        while not self._stop.is_set():
            os.rename(self.inside, self.parked)
            os.symlink(self.target, self.inside)
            time.sleep(0.001)
            os.unlink(self.inside)
            os.rename(self.parked, self.inside)
            self.flips += 1
            time.sleep(0.001)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def text_image(text: str) -> Image.Image:
    return draw_text_image([text], size=32, margin=8)


def new_id() -> str:
    return str(uuid.uuid4())


def job(image: Any, task: Any = "text", **extra: Any) -> Sent:
    """One send_task job with a fresh canonical id."""
    job_id = new_id()
    kwargs = {"image": image, "task": task, "job_id": job_id, **extra}
    return Sent([("task", kwargs)], job_id)


def raw_job(kwargs: dict[str, Any]) -> Sent:
    """A well-formed task message pushed as bytes (JSON escapes keep NULs and surrogates)."""
    job_id = new_id()
    return Sent([("raw", task_message({**kwargs, "job_id": job_id}))], job_id)


def path_job(path: str | Path) -> Sent:
    return job({"path": str(path)})


def b64_text(text: str, variant: str) -> str:
    return b64(png(text_image(text)), variant)


def b64(data: bytes, variant: str = "plain") -> str:
    plain = base64.b64encode(data).decode()
    if variant == "mime":
        return base64.encodebytes(data).decode()
    if variant == "data_url":
        return "data:image/png;base64," + plain
    if variant == "urlsafe":
        safe = base64.urlsafe_b64encode(data).decode().rstrip("=")
        assert safe != plain.rstrip("="), "no +/ in this image's base64: not a URL-safe case"
        return safe
    return plain


# --- the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    send: Callable[[Ctx], Sent]
    status: str  # done | failed | rejected (no row; one log line) | raced (done or refused)
    fragment: str  # failed: in the error; done: the text read; rejected: in the log line
    check: Callable[[dict[str, Any], Sent, ProbeRun], None] | None = None


def link_out(ctx: Ctx) -> Sent:
    link = ctx.root / "link-out.png"
    link.symlink_to(ctx.secret_file)
    return path_job(link)


def folder_link_out(ctx: Ctx) -> Sent:
    link = ctx.root / "dir-out"
    link.symlink_to(ctx.outside, target_is_directory=True)
    return path_job(link / "secret.png")


def fifo(ctx: Ctx) -> Sent:
    path = ctx.root / "fifo.png"
    os.mkfifo(path)
    return path_job(path)


def url_with_credentials(ctx: Ctx) -> Sent:
    url = ctx.public.url("/creds.png").replace("//", f"//alice:{PASSWORD}@")
    return job({"url": url + "?token=tok-probe-77&page=2"})


def refused_with_credentials(ctx: Ctx) -> Sent:
    return job({"url": ctx.secret.url().replace("//", f"//bob:{PASSWORD}@")})


def spellings(ctx: Ctx) -> Sent:
    """One UUID in four spellings, the same image: one row under the canonical form."""
    canonical = uuid.uuid4()
    image = {"path": ctx.text_file("spelled", "JULIET KILO 515")}
    ids = [str(canonical).upper(), f"{{{canonical}}}", f"urn:uuid:{canonical}", canonical.hex]
    messages = [("task", {"image": image, "job_id": spelled}) for spelled in ids]
    return Sent(messages, str(canonical))


def reused_id(ctx: Ctx) -> Sent:
    """The same job id, two different images: one of them, consistently, never a mix."""
    job_id = new_id()
    first = ctx.text_file("reused-first", "GOLF BRAVO 142")
    second = ctx.text_file("reused-second", "OSCAR PAPA 717")
    messages = [("task", {"image": {"path": p}, "job_id": job_id}) for p in (first, second)]
    texts = {first: "GOLF BRAVO 142", second: "OSCAR PAPA 717"}
    return Sent(messages, job_id, info={"texts": texts})


def with_options(text: str, **options: Any) -> Callable[[Ctx], Sent]:
    """A good image sent with send_task options (eta, countdown, link, chain, headers)."""

    def send(ctx: Ctx) -> Sent:
        sent = job({"path": ctx.text_file(f"opt-{uuid.uuid4().hex[:6]}", text)})
        linked = new_id()  # the job a link would enqueue: it must never get a row
        link = Signature("ocrq.recognize", kwargs={"image": {"path": "/x.png"}, "job_id": linked},
                         options={"queue": ctx.queue})  # fmt: skip
        made = {k: (link if v == "LINK" else [link] if v == "LINKS" else v)
                for k, v in options.items()}  # fmt: skip
        ((kind, kwargs),) = sent.messages
        return Sent([(kind, (kwargs, made))], sent.job_id, info={"linked": linked})

    return send


def check_not_linked(row: dict[str, Any], sent: Sent, run: ProbeRun) -> None:
    assert run.store.get([sent.info["linked"]]) == {}  # the linked job was never sent


def check_named(row: dict[str, Any], sent: Sent, run: ProbeRun) -> None:
    assert row["source"].startswith("b64:") and row["reference"] is None, row


def check_spellings(row: dict[str, Any], sent: Sent, run: ProbeRun) -> None:
    """Delivered together, the copies are one job: run once, never taken for dead attempts
    (before: run three times, and the fourth copy failed it as "gave up after 3 attempts")."""
    assert row["text"] == "JULIET KILO 515", row
    assert f"job {sent.job_id} refused" not in run.log
    digits = func.replace(func.lower(ocr_jobs.c.id), "-", "")
    hex_id = uuid.UUID(sent.job_id or "").hex
    with run.store.engine.connect() as conn:
        ids = conn.execute(select(ocr_jobs.c.id).where(digits.like(f"%{hex_id}%"))).scalars()
        assert list(ids) == [sent.job_id]  # no row under any other spelling


def check_reused(row: dict[str, Any], sent: Sent, run: ProbeRun) -> None:
    texts = sent.info["texts"]
    assert row["source"] in texts, row
    assert row["text"] == texts[row["source"]], row  # the row's image and text agree
    assert f"job {sent.job_id} refused: {REUSED_ID}" in run.log


def check_credentials(row: dict[str, Any], sent: Sent, run: ProbeRun) -> None:
    assert row["source"] == (
        f"http://***@{PUBLIC_HOST}:{run.ctx.public.port}/creds.png?token=***&page=2"
    ), row["source"]
    basic = "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    assert basic in run.ctx.public.auth  # the credentials still did their job


def check_page(row: dict[str, Any], sent: Sent, run: ProbeRun) -> None:
    truth = "\n".join(PAGE_LINES)
    assert len(row["text"].split("\n")) >= len(PAGE_LINES) - 1, row["text"][:500]
    assert cer(row["text"], truth) <= 0.05, row["text"][:500]
    assert (row["width"], row["height"]) == PAGE_SIZE


def check_line(row: dict[str, Any], sent: Sent, run: ProbeRun) -> None:
    assert cer(row["text"], long_line_text()) <= 0.02, row["text"][:300]


def check_deadline(row: dict[str, Any], sent: Sent, run: ProbeRun) -> None:
    held = (row["finished_at"] - row["started_at"]).total_seconds()
    assert URL_DEADLINE_S - 0.5 < held < URL_DEADLINE_S + 3, held


def check_redirect(row: dict[str, Any], sent: Sent, run: ProbeRun) -> None:
    assert any(hit.startswith("/redirect") for hit in run.ctx.public.hits)


# The probe's 39.6 MP page (under the 40 MP cap): text_page's lines, one slot in 12 drawn.
PAGE_SIZE = (5300, 7470)
PAGE_LINES = [
    words(int(PAGE_SIZE[0] / (0.55 * 96)) // 5, i)[: int(PAGE_SIZE[0] / (0.55 * 96))]
    for i, _ in enumerate(range(96, PAGE_SIZE[1] - int(96 * 1.6), int(96 * 1.6)))
    if i % 12 == 0
]


def malformed(kind: str) -> Callable[[Ctx], Sent]:
    def send(ctx: Ctx) -> Sent:
        marker = f"probe{uuid.uuid4().hex[:10]}"
        message = malformed_cases(marker)[kind]
        if kind == "deep_nesting":  # its log line shows the decoder's error, not the marker
            marker = "not a JSON message (RecursionError)"
        return Sent([("raw", message)], marker=marker)

    return send


def bad_id(value: str) -> Callable[[Ctx], Sent]:
    def send(ctx: Ctx) -> Sent:
        marker = f"nope{uuid.uuid4().hex[:8]}"
        image = {"path": ctx.text_file("bad-id", "ECHO FOXTROT 313")}
        return Sent(
            [("task", {"image": image, "job_id": value.format(marker)})],
            marker=marker,
            task_id=new_id(),
        )

    return send


def url(path: str, host: str | None = None, server: str = "secret") -> Callable[[Ctx], Sent]:
    return lambda ctx: job({"url": getattr(ctx, server).url(path, host=host)})


def redirect_to(target: Callable[[Ctx], str]) -> Callable[[Ctx], Sent]:
    return lambda ctx: job({"url": ctx.public.url(f"/redirect?to={target(ctx)}")})


HOSTILE: list[Case] = [
    # Sizes: refused on the header, or bounded in the engine.
    Case("png_1x100000", lambda c: path_job(c.file("thin.png", thin((1, 100_000)))),
         "failed", "image too large: 1x100000"),
    Case("strip_1x3000", lambda c: path_job(c.file("strip.png", thin((1, 3000)))),
         "failed", "too elongated: 1x3000"),
    Case("strip_1x1000", lambda c: path_job(c.file("strip1000.png", thin((1, 1000)))),
         "failed", "too elongated: 1x1000"),
    # The probe's eight 39.6 MP pages at once (under the 40 MP cap): read, within the cap.
    *(Case(f"page_39mp_{i}", lambda c: path_job(c.page()), "done", "", check_page)
      for i in range(8)),
    Case("line_13340x124", lambda c: path_job(c.file("line.png", long_line())),
         "done", "", check_line),
    Case("pixels_over_cap", lambda c: path_job(c.file("big.png", Image.new("1", (7000, 6000), 1))),
         "failed", "possible decompression bomb"),
    Case("header_bomb", lambda c: path_job(c.bad["bomb"][0]), "failed", "decompression bomb"),
    Case("header_wide", lambda c: path_job(c.file("wide.png", png_bomb(30_000, 300))),
         "failed", "OCRQ_MAX_IMAGE_SIDE"),
    Case("file_over_bytes", lambda c: path_job(c.file("huge.png", b"\x89PNG" + bytes(5 * MiB))),
         "failed", f"image too large: {5 * MiB + 4} bytes > limit"),
    # URLs: loopback in every spelling, through a redirect, closed, slow, with credentials.
    Case("url_127.0.0.1", url("/secret.png"), "failed", URL_REFUSED),
    Case("url_localhost", url("/secret.png", "localhost"), "failed", URL_REFUSED),
    Case("url_LOCALHOST", url("/secret.png", "LOCALHOST"), "failed", URL_REFUSED),
    Case("url_2130706433", url("/secret.png", "2130706433"), "failed", URL_REFUSED),
    Case("url_0x7f000001", url("/secret.png", "0x7f000001"), "failed", URL_REFUSED),
    Case("url_017700000001", url("/secret.png", "017700000001"), "failed", URL_REFUSED),
    Case("url_127.1", url("/secret.png", "127.1"), "failed", URL_REFUSED),
    Case("url_0", url("/secret.png", "0"), "failed", URL_REFUSED),
    Case("url_ipv6_mapped", url("/secret.png", "[::ffff:127.0.0.1]"), "failed", URL_REFUSED),
    Case("url_ipv6_loopback", url("/secret.png", "[::1]"), "failed", URL_REFUSED),
    Case("redirect_to_loopback", redirect_to(lambda c: c.secret.url()), "failed", URL_REFUSED,
         check_redirect),
    Case("redirect_to_2130706433", redirect_to(lambda c: c.secret.url(host="2130706433")),
         "failed", URL_REFUSED, check_redirect),
    Case("redirect_allowed", redirect_to(lambda c: c.public.url("/hop.png")), "done", "PUBLIC"),
    Case("redirect_loop", url("/loop", server="public"), "failed", URL_REFUSED),
    Case("url_closed_port", lambda c: job({"url": f"http://{PUBLIC_HOST}:{free_port()}/x.png"}),
         "failed", URL_REFUSED),
    # Slow servers: one task thread each (8 of them), each freed at the total deadline.
    *(Case(f"url_slow_loris_{i}", url(f"/drip?{i}", server="public"), "failed", URL_REFUSED,
           check_deadline) for i in range(7)),
    Case("url_silent", url("/silent", server="public"), "failed", URL_REFUSED, check_deadline),
    Case("url_404", url("/missing", server="public"), "failed", "URL answered HTTP 404"),
    Case("url_public", url("/pub.png", server="public"), "done", "PUBLIC"),
    Case("url_upper_scheme", lambda c: job({"url": "HTTP" + c.public.url("/up.png")[4:]}),
         "done", "PUBLIC"),
    Case("url_credentials", url_with_credentials, "done", "PUBLIC", check_credentials),
    Case("url_credentials_refused", refused_with_credentials, "failed", URL_REFUSED + "http://***@"),
    Case("url_file_scheme", lambda c: job({"url": f"file://{c.secret_file}"}), "failed", "URL"),
    # Paths: outside the roots in every way, special files.
    Case("path_traversal", lambda c: path_job(f"{c.root}/../outside/secret.png"),
         "failed", PATH_REFUSED),
    Case("path_absolute_outside", lambda c: path_job(c.secret_file), "failed", PATH_REFUSED),
    Case("path_relative", lambda c: path_job("etc/passwd"), "failed", PATH_REFUSED),
    Case("symlink_out", link_out, "failed", PATH_REFUSED),
    Case("symlinked_folder_out", folder_link_out, "failed", PATH_REFUSED),
    Case("path_proc_environ", lambda c: path_job("/proc/self/environ"), "failed", PATH_REFUSED),
    Case("path_proc_mem", lambda c: path_job("/proc/self/mem"), "failed", PATH_REFUSED),
    Case("path_dev_zero", lambda c: path_job("/dev/zero"), "failed", PATH_REFUSED),
    Case("path_dev_urandom", lambda c: path_job("/dev/urandom"), "failed", PATH_REFUSED),
    Case("path_etc_passwd", lambda c: path_job("/etc/passwd"), "failed", PATH_REFUSED),
    Case("path_missing", lambda c: path_job(c.root / "nope.png"), "failed", PATH_REFUSED),
    Case("path_fifo", fifo, "failed", "not a regular file"),
    Case("path_directory", lambda c: path_job(c.bad["empty"][0].parent), "failed",
         "not a regular file"),
    # Contents: formats and damaged files.
    Case("eps_file", lambda c: path_job(c.file("x.eps", EPS)), "failed",
         "unsupported image format: EPS"),
    Case("eps_b64", lambda c: job({"b64": b64(EPS)}), "failed", "unsupported image format: EPS"),
    Case("file_empty", lambda c: path_job(c.bad["empty"][0]), "failed", "empty image"),
    Case("file_corrupt", lambda c: path_job(c.bad["corrupt"][0]), "failed", "not an image"),
    Case("file_truncated", lambda c: path_job(c.bad["truncated"][0]), "failed",
         "corrupt or truncated"),
    Case("file_not_image", lambda c: path_job(c.bad["notimage"][0]), "failed", "not an image"),
    Case("rgba_on_transparent", lambda c: path_job(c.file("rgba.png", transparent_text("RGBA"))),
         "done", "HELLO TRANSPARENT"),
    Case("la_on_transparent", lambda c: path_job(c.file("la.png", transparent_text("LA"))),
         "done", "HELLO TRANSPARENT"),
    # Inline base64: what producers send is accepted; what is broken or too big is refused.
    Case("b64_plain", lambda c: job({"b64": b64_text("ALPHA BRAVO 101", "plain")}),
         "done", "ALPHA BRAVO 101"),
    Case("b64_line_breaks", lambda c: job({"b64": b64_text("CHARLIE DELTA 202", "mime")}),
         "done", "CHARLIE DELTA 202"),
    Case("b64_data_url", lambda c: job({"b64": b64_text("ECHO GOLF 303", "data_url")}),
         "done", "ECHO GOLF 303"),
    Case("b64_urlsafe", lambda c: job({"b64": b64_text("HOTEL INDIA 404", "urlsafe")}),
         "done", "HOTEL INDIA 404"),
    # A producer's name is not a reference (issue 31): refused, recorded as what it really is.
    Case("b64_named_as_a_path", lambda c: job({"b64": b64_text("MIKE NOVEMBER 9", "plain"),
                                                "name": str(c.secret_file)}),
         "failed", NAME_REFUSED, check_named),
    Case("b64_invalid", lambda c: job({"b64": "@@not base64@@"}), "failed", "invalid base64"),
    Case("b64_data_not_base64", lambda c: job({"b64": "data:image/png,iVBORw0KGgo"}),
         "failed", "invalid base64"),
    Case("b64_oversized", lambda c: job({"b64": "A" * (MAX_IMAGE_BYTES * 3 // 2)}),
         "failed", "inline image too large"),
    # Unstorable text: NUL bytes and lone surrogates (once: no row at all).
    Case("nul_in_task", lambda c: job({"path": "/x.png"}, "text\x00more"), "failed", INVALID),
    Case("nul_in_path", lambda c: job({"path": "/img\x00.png"}), "failed", INVALID),
    Case("nul_in_url", lambda c: job({"url": "http://example.invalid/\x00x.png"}), "failed",
         INVALID),
    Case("surrogate_in_path", lambda c: raw_job({"image": {"path": "/img\ud800.png"}}),
         "failed", INVALID),
    Case("surrogate_in_task", lambda c: raw_job({"image": {"path": "/x.png"}, "task": "p \udfff"}),
         "failed", INVALID),
    Case("surrogate_in_url", lambda c: raw_job({"image": {"url": "http://h/\udc80.png"}}),
         "failed", INVALID),
    # Job ids.
    Case("job_id_spellings", spellings, "done", "JULIET KILO 515", check_spellings),
    Case("job_id_reused", reused_id, "done", "", check_reused),
    Case("job_id_not_uuid", bad_id("{}"), "rejected", REJECTED_ID),
    Case("job_id_nul", bad_id("{}\x00"), "rejected", REJECTED_ID),
    # Send options (issue 31): an ETA beyond OCRQ_MAX_ETA_S (the visibility timeout) was held
    # and delivered again every timeout, forever; links made the worker enqueue more tasks.
    Case("eta_year_9999", with_options("KILO ONE 1", eta=dt.datetime(9999, 1, 1, tzinfo=dt.UTC)),
         "failed", "more than OCRQ_MAX_ETA_S"),
    Case("countdown_far", with_options("KILO TWO 2", countdown=10**8), "failed",
         "more than OCRQ_MAX_ETA_S"),
    Case("countdown_near", with_options("KILO THREE 3", countdown=1), "done", "KILO THREE 3"),
    Case("link_callback", with_options("LIMA ONE 1", link="LINK"), "failed",
         "OCRQ_LINK_TASKS", check_not_linked),
    Case("link_errback", with_options("LIMA TWO 2", link_error="LINK"), "failed",
         "OCRQ_LINK_TASKS", check_not_linked),
    Case("chain", with_options("LIMA THREE 3", chain="LINKS"), "failed", "runs no workflows",
         check_not_linked),
    Case("refusal_header_spoofed", with_options("LIMA FOUR 4", headers={REFUSED_HEADER: "no"}),
         "done", "LIMA FOUR 4"),
    # Malformed kwargs: a failed row each.
    Case("kwargs_image_missing", lambda c: job(None), "failed", INVALID),
    Case("kwargs_image_list", lambda c: job([str(c.secret_file)]), "failed", INVALID),
    Case("kwargs_image_two_sources", lambda c: job({"path": "/a.png", "url": "http://h/a.png"}),
         "failed", "exactly one"),
    Case("kwargs_image_unknown_key", lambda c: job({"file": "/a.png"}), "failed", INVALID),
    Case("kwargs_task_dict", lambda c: job({"path": "/a.png"}, {"prompt": "x"}), "failed",
         INVALID),
    Case("kwargs_task_too_long", lambda c: job({"path": "/a.png"}, "x" * 5000), "failed",
         INVALID),
    # Malformed broker messages: no row, one log line, the worker lives on.
    Case("raw_garbage", malformed("garbage"), "rejected", REJECTED_MESSAGE),
    Case("raw_json_list", malformed("json_list"), "rejected", REJECTED_MESSAGE),
    Case("raw_body_not_base64", malformed("bad_base64"), "rejected", REJECTED_MESSAGE),
    Case("raw_body_json_string", malformed("body_json_string"), "rejected", REJECTED_MESSAGE),
    Case("raw_body_not_json", malformed("body_not_json"), "rejected", REJECTED_MESSAGE),
    Case("raw_pickle", malformed("pickle_body"), "rejected", REJECTED_MESSAGE),
    Case("raw_unknown_task", malformed("unknown_task"), "rejected", REJECTED_MESSAGE),
    Case("raw_kwargs_not_dict", malformed("kwargs_not_dict"), "rejected", REJECTED_MESSAGE),
    Case("raw_deep_nesting", malformed("deep_nesting"), "rejected", REJECTED_MESSAGE),
]  # fmt: skip

RACE = [
    Case(f"path_race_{i:02d}", lambda c: path_job(c.race.inside / "img.png"), "raced", Race.TEXT)
    for i in range(16)
]

GOOD_TEXTS = [f"{WORDS[i % 16]} {WORDS[(i * 5 + 3) % 16]} {100 + i * 7}" for i in range(24)]
GOOD = [
    Case(f"good_{i:02d}", lambda c, t=t, i=i: path_job(c.text_file(f"good{i:02d}", t)), "done", t)
    for i, t in enumerate(GOOD_TEXTS)
]


def interleaved() -> list[Case]:
    """Hostile cases with a good job after every few: they share batches and task threads."""
    out: list[Case] = []
    good = iter(GOOD)
    middle = len(HOSTILE) // 2  # the path race runs while other jobs come and go
    for i, case in enumerate([*HOSTILE[:middle], *RACE, *HOSTILE[middle:]]):
        out.append(case)
        if i % 4 == 3:
            out.extend(g for g in [next(good, None)] if g is not None)
    out.extend(good)
    return out


CASES = interleaved()


# --- the run ----------------------------------------------------------------------------------


@dataclass
class ProbeRun:
    ctx: Ctx
    sent: dict[str, Sent]
    rows: dict[str, dict[str, Any]]  # by canonical job id, read after the queue drained
    log: str
    store: JobStore
    seconds: float
    alive: bool
    vm_peak: int  # the worker's largest address space (VmPeak)
    rss_peak: int  # and resident set (VmHWM)
    queue_left: int  # messages still listed or unacked for the probe's queue
    late_receipts: int  # tasks received after every row was final (something looping)
    stray_ids: list[str]  # rows written during the run that belong to no case
    race_flips: int  # folder <-> symlink swaps made while the jobs ran


def status_bytes(pid: int, name: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def queue_left(r: redis.Redis, queue: str) -> int:
    unacked = sum(f'"{queue}"'.encode() in v for v in r.hgetall("unacked").values())
    return r.llen(queue) + unacked


def receipts(log: str) -> int:
    return len(re.findall(r"Task ocrq\.recognize\[[^\]]+\] received", log))


@pytest.fixture(scope="module")
def run(
    service_env: dict[str, str],
    broker_url: str,
    module_database: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ProbeRun]:
    database_url = module_database  # its sweep would re-run rows other tests left queued
    base = tmp_path_factory.mktemp("probe")
    (root := base / "root").mkdir()
    (outside := base / "outside").mkdir()
    queue = f"ocr-probe-{uuid.uuid4().hex[:6]}"
    env = {
        **service_env,
        "OCRQ_DATABASE_URL": database_url,
        "OCRQ_QUEUE": queue,
        "OCRQ_ALLOWED_ROOTS": str(root),
        "OCRQ_URL_ALLOW_NETWORKS": f"{PUBLIC_HOST}/32",
        "OCRQ_URL_DEADLINE_S": str(URL_DEADLINE_S),
        "OCRQ_MAX_IMAGE_BYTES": str(MAX_IMAGE_BYTES),
        "OCRQ_MEMORY_BUDGET_GIB": "2.5",
        "MALLOC_ARENA_MAX": "2",
    }
    secret = LoopServer("127.0.0.1", SECRET)
    public = LoopServer(PUBLIC_HOST, PUBLIC)
    ctx = Ctx(root, outside, secret, public)
    ctx.queue = queue
    worker = CappedWorker(env, base / "ocrq.worker.log", CAP, "--no-supervise", "--concurrency",
    "8")
    r = redis.Redis.from_url(broker_url)
    store = JobStore(get_engine(database_url))
    try:
        sent = {case.name: case.send(ctx) for case in CASES}  # while the worker starts
        worker.wait_ready()
        app = Celery(broker=broker_url)
        started, t0 = now(), time.monotonic()
        ctx.race.start()
        with app.producer_or_acquire() as producer:
            for case in CASES:
                for kind, payload in sent[case.name].messages:
                    if kind == "raw":
                        r.lpush(queue, payload)
                    else:
                        task_id = sent[case.name].task_id or new_id()
                        kwargs, options = payload if isinstance(payload, tuple) else (payload, {})
                        app.send_task("ocrq.recognize", kwargs=kwargs, queue=queue,
                                      task_id=task_id, producer=producer, **options)  # fmt: skip
        ids = [s.job_id for s in sent.values() if s.job_id]
        vm_peak = rss_peak = 0
        deadline = time.monotonic() + 170
        while time.monotonic() < deadline and worker.alive():
            vm_peak = max(vm_peak, status_bytes(worker.proc.pid, "VmPeak"))
            rss_peak = max(rss_peak, status_bytes(worker.proc.pid, "VmHWM"))
            rows = store.get(ids)
            if len(rows) == len(ids) and all(
                row["status"] in ("done", "failed") for row in rows.values()
            ):
                break
            time.sleep(0.5)
        seconds = time.monotonic() - t0
        ctx.race.stop()
        drain = time.monotonic() + 15
        while queue_left(r, queue) and time.monotonic() < drain:
            time.sleep(0.2)
        settled = receipts(worker.text())
        time.sleep(3)  # anything looping would be received again by now
        log = worker.text()
        vm_peak = max(vm_peak, status_bytes(worker.proc.pid, "VmPeak"))
        rss_peak = max(rss_peak, status_bytes(worker.proc.pid, "VmHWM"))
        with store.engine.connect() as conn:
            written = conn.execute(
                select(ocr_jobs.c.id).where(ocr_jobs.c.created_at >= started)
            ).scalars()
            under_task_ids = {s.task_id for s in sent.values() if s.task_id}
            stray = sorted(set(written) - set(ids) - under_task_ids)
        yield ProbeRun(
            ctx=ctx,
            sent=sent,
            rows=store.get(ids),
            log=log,
            store=store,
            seconds=seconds,
            alive=worker.alive(),
            vm_peak=vm_peak,
            rss_peak=rss_peak,
            queue_left=queue_left(r, queue),
            late_receipts=receipts(log) - settled,
            stray_ids=stray,
            race_flips=ctx.race.flips,
        )
    finally:
        ctx.race.stop()
        worker.stop()
        secret.close()
        public.close()
        r.delete(queue)


# --- one item per case ------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case: Case, run: ProbeRun) -> None:
    sent = run.sent[case.name]
    if case.status == "rejected":
        assert sent.job_id is None and sent.marker
        lines = [line for line in run.log.splitlines() if sent.marker in line]
        assert len(lines) == 1, lines  # logged once: not redelivered, not looping
        assert case.fragment in lines[0] and "WARNING" in lines[0], lines[0]
        if sent.task_id:  # a bad job id: failed under the task id, the id the producer has
            row = run.store.get([sent.task_id]).get(sent.task_id)
            assert row is not None and row["status"] == "failed", row
            assert "job_id" in row["error"], row
        return
    assert sent.job_id is not None
    row = run.rows.get(sent.job_id)
    assert row is not None, f"{case.name}: no row for {sent.job_id}"
    if case.status == "raced":  # either outcome is right; only the outside file is wrong
        assert row["status"] in ("done", "failed"), row
        if row["status"] == "done":
            assert row["text"] == case.fragment, row
        else:
            assert row["error"] == PATH_ERROR.format(row["source"]), row
        return
    assert row["status"] == case.status, row
    if case.status == "failed":
        error = row["error"] or ""
        assert case.fragment in error, error
        assert row["text"] is None
        assert not any(m in error for m in MEMORY_FAILURES), error
        # One message per kind whatever the target: no port scanning, no probing the host.
        if case.fragment.startswith(URL_REFUSED):
            assert error == URL_REFUSED + row["source"], error
        if case.fragment == PATH_REFUSED:
            assert error == PATH_ERROR.format(row["source"]), error
    else:
        assert row["error"] is None, row
        if case.check is None:
            assert row["text"] == case.fragment, row["text"]
        else:
            assert case.fragment in row["text"], row["text"]
    if case.check is not None:
        case.check(row, sent, run)
    assert row["attempts"] == 1, row  # run once: nothing redelivered


# --- the run as a whole -----------------------------------------------------------------------


def test_figures(run: ProbeRun) -> None:
    rows = run.rows.values()
    expected = [s.job_id for s in run.sent.values() if s.job_id]
    final = [r for r in rows if r["status"] in ("done", "failed")]
    rejected = [c for c in CASES if c.status == "rejected"]
    figures = {
        "cases": len(CASES),
        "done": sum(r["status"] == "done" for r in rows),
        "failed": sum(r["status"] == "failed" for r in rows),
        "rejected": len(rejected),
        "lost": len(expected) - len(final),
        "duplicated": len(expected) - len(set(expected)) + len(run.stray_ids),
        "seconds": round(run.seconds, 1),
        "peak_rss_gib": round(run.rss_peak / GiB, 2),
        "peak_vm_gib": round(run.vm_peak / GiB, 2),
        "cap_gib": CAP // GiB,
    }
    line = "[probe] " + " ".join(f"{k}={v}" for k, v in figures.items())
    for case in CASES:  # the table, as the run filled it (shown with -s)
        row = run.rows.get(run.sent[case.name].job_id or "") or {}
        outcome = row.get("error") or row.get("text") or case.status
        print(f"  {case.name:28} {row.get('status', 'rejected'):8} {outcome[:80]!r}")
    print("\n" + line)
    FIGURES.append(line)
    assert figures["lost"] == 0 and figures["duplicated"] == 0, (figures, run.stray_ids)
    assert figures["done"] + figures["failed"] + figures["rejected"] == len(CASES)


def test_hostile_and_good_jobs_shared_batches(run: ProbeRun) -> None:
    """The mix really mixed: good jobs ran in batches with images from hostile cases."""
    good = {run.sent[c.name].job_id for c in GOOD}
    batches: dict[str, set[str]] = {}
    for job_id, row in run.rows.items():
        if row["batch_id"]:
            batches.setdefault(row["batch_id"], set()).add(job_id)
    mixed = [ids for ids in batches.values() if ids & good and ids - good]
    assert mixed, batches
    assert run.race_flips > 100  # the path race really ran while jobs read the folder


def test_worker_alive_and_below_the_cap(run: ProbeRun) -> None:
    assert run.alive, run.log[-3000:]
    assert 0 < run.vm_peak < CAP and 0 < run.rss_peak < CAP // 2
    for bad in ("Unrecoverable", "Traceback", "CRITICAL", *MEMORY_FAILURES):
        assert bad not in run.log, bad
    # One worker process from start to end: nothing crashed and came back.
    assert run.log.count(" ready.") == 1


def test_nothing_secret_comes_back(run: ProbeRun) -> None:
    """The secret image was never read, by any route; credentials never stored or logged."""
    assert run.ctx.secret.hits == []
    for row in run.rows.values():
        shown = " ".join(str(row[k]) for k in ("text", "error", "source", "task"))
        for secret_text in (*SECRET_WORDS, PASSWORD, "tok-probe-77"):
            assert secret_text not in shown, (secret_text, row)
    basic = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    for secret_text in (PASSWORD, "tok-probe-77", basic):
        assert secret_text not in run.log


def test_queue_empty_and_nothing_loops(run: ProbeRun) -> None:
    assert run.queue_left == 0
    assert run.late_receipts == 0
    rejected = [c for c in CASES if c.fragment == REJECTED_MESSAGE]
    assert run.log.count(REJECTED_MESSAGE) == len(rejected)
