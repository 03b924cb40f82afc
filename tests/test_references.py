"""Re-sends name the image exactly as it was submitted, never its display name (issue 31, item 6).

The probe: a b64 job whose producer set `image.name` to another file's path was stored under
that name, and when its worker died the stall sweep rebuilt it from the row as `{"path": name}`:
it ran as the other file and stored that file's text. A URL job with a token was re-sent from
its redacted source (`token=***`) and failed. Now the row keeps `reference` (the image as
submitted) apart from `source` (the display), re-sends use `reference` alone, and a producer
cannot name a job at all.

One real worker (engine rapid, under `prlimit --as`) with a fast stall sweep; a worker that
died is a heartbeat row long stale whose jobs are `running` (claimed through the store, as its
task threads did), their messages gone with it. The URL server listens on 127.0.0.3, the one
internal address the worker's allowlist lets through (the intake refuses loopback otherwise).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import update

from ocrq.api.client import Client
from ocrq.core import workers_table
from ocrq.core.contract import NAME_REFUSED, ImageRef
from ocrq.core.db import get_engine, ocr_jobs, ocr_workers
from ocrq.core.samples import draw_text_image
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from tests.test_intake_security import LoopServer, png
from tests.test_liveness import LIVENESS
from tests.test_rapid_bounds import CappedWorker
from tests.waiting import Budget

CAP = 4 * 1024**3
HOST = "127.0.0.3"
TOKEN = "tok-resend-4242"  # a test URL's query token
ALPHA, BRAVO, URL_TEXT = "ALPHA KILO 101", "BRAVO LIMA 202", "CHARLIE MIKE 303"


@dataclass
class Rig:
    worker: CappedWorker
    store: JobStore
    app: Celery
    queue: str
    settings: Settings  # a producer's, sending to the worker's queue
    server: LoopServer
    other: Path  # the file a spoofed name points at


@pytest.fixture(scope="module")
def rig(
    service_env: dict[str, str], database_url: str, image_root: Path, tmp_path_factory: Any
) -> Iterator[Rig]:
    queue = f"ocr-ref-{uuid.uuid4().hex[:6]}"
    env = {
        **service_env,
        **LIVENESS,
        "OCRQ_QUEUE": queue,
        "OCRQ_URL_ALLOW_NETWORKS": f"{HOST}/32",
        "MALLOC_ARENA_MAX": "2",
    }
    other = image_root / f"other-{uuid.uuid4().hex[:6]}.png"
    draw_text_image([BRAVO], size=32, margin=8).save(other)
    server = LoopServer(HOST, png(draw_text_image([URL_TEXT], size=32, margin=8)))
    log = tmp_path_factory.mktemp("refs") / "worker.log"
    worker = CappedWorker(env, log, CAP, "--no-supervise", "--concurrency", "2")
    try:
        worker.wait_ready(120)
        settings = Settings(
            broker_url=env["OCRQ_BROKER_URL"], database_url=database_url, queue=queue
        )
        yield Rig(
            worker,
            JobStore(get_engine(database_url)),
            Celery(broker=env["OCRQ_BROKER_URL"]),
            queue,
            settings,
            server,
            other,
        )
    finally:
        worker.stop()
        server.close()


def final(rig: Rig, budget: Budget, job_id: str, what: str) -> dict[str, Any]:
    return budget.until(
        what,
        lambda: (
            row
            if (row := rig.store.get([job_id]).get(job_id)) and row["status"] in ("done", "failed")
            else None
        ),
        120,
        lambda: f"row {rig.store.get([job_id]).get(job_id)}; log {rig.worker.text()[-1500:]}",
    )


def died_under(rig: Rig, job_id: str, image: dict[str, Any], dead: str = "") -> str:
    """A worker claimed the job and died: its row is `running` under a heartbeat long stale."""
    dead = dead or f"dead-{uuid.uuid4().hex[:6]}@nowhere/1"
    workers_table.beat(rig.store.engine, dead)
    with rig.store.engine.begin() as conn:
        conn.execute(
            update(ocr_workers)
            .where(ocr_workers.c.name == dead)
            .values(heartbeat_at=workers_table.EPOCH)
        )
    ref = ImageRef.model_validate(image)
    assert rig.store.claim(job_id, "text", ref.describe(), dead, reference=ref.reference()).run
    return dead


def b64_of(text: str) -> str:
    return base64.b64encode(png(draw_text_image([text], size=32, margin=8))).decode()


def test_a_producer_cannot_name_a_job(rig: Rig) -> None:
    """A b64 job named after another file fails with a clear error, recorded under what it
    really is; the other file is never read. The api and the python producer refuse it too."""
    budget = Budget(150, "spoofed-name")
    job_id = str(uuid.uuid4())
    image = {"b64": b64_of(ALPHA), "name": str(rig.other)}
    rig.app.send_task(
        "ocrq.recognize",
        kwargs={"image": image, "job_id": job_id},
        queue=rig.queue,
        task_id=job_id,
    )
    row = final(rig, budget, job_id, "the named b64 job's row final")
    assert row["status"] == "failed" and row["error"] == NAME_REFUSED, row
    assert row["source"].startswith("b64:") and row["text"] is None, row
    assert row["reference"] is None  # inline: nothing a re-send could rebuild
    with pytest.raises(ValueError, match=r"image\.name"):
        Client(rig.settings).submit(image)


def test_the_sweep_never_rebuilds_an_inline_job_from_its_name(rig: Rig) -> None:
    """The probe's case: an inline job's row reads like another file's path (a name recorded
    before this fix) and its worker died. The sweep re-sends nothing for it, and neither does
    `ocrq requeue`; when its own message comes back it runs as itself. A path job of the same
    dead worker shows that the sweep did run over them: one UPDATE flips all of its rows."""
    budget = Budget(200, "inline-sweep")
    legacy = str(uuid.uuid4())  # its row names the other file, with no reference
    inline = str(uuid.uuid4())  # a b64 job of today
    control = str(uuid.uuid4())  # a path job: re-sent by the same sweep
    dead = died_under(rig, legacy, {"b64": b64_of(ALPHA), "name": str(rig.other)})
    assert rig.store.get([legacy])[legacy]["source"] == str(rig.other)
    image = {"b64": b64_of(ALPHA)}
    died_under(rig, inline, image, dead)
    died_under(rig, control, {"path": str(rig.other)}, dead)
    row = final(rig, budget, control, "the dead worker's path job re-sent by the sweep")
    assert row["status"] == "done" and row["text"] == BRAVO, row
    rows = rig.store.get([legacy, inline])
    assert [(r["status"], r["worker"]) for r in rows.values()] == [("running", dead)] * 2, rows
    with rig.store.engine.begin() as conn:  # and `ocrq requeue` leaves queued ones alone
        conn.execute(
            update(ocr_jobs).where(ocr_jobs.c.id.in_([legacy, inline])).values(status="queued")
        )
    assert not {legacy, inline} & set(Client(rig.settings).requeue(older_than_s=0))
    # The inline job's own message (what the visibility timeout brings back) runs it as itself.
    rig.app.send_task(
        "ocrq.recognize",
        kwargs={"image": image, "job_id": inline},
        queue=rig.queue,
        task_id=inline,
    )
    row = final(rig, budget, inline, "the inline job's own message ran")
    assert row["status"] == "done" and row["text"] == ALPHA, row
    assert rig.store.get([legacy])[legacy]["status"] == "queued"  # never run as the other file


def test_the_sweep_and_requeue_resend_a_url_with_its_token(rig: Rig) -> None:
    """A URL job with a token whose worker died is re-sent by the live worker's sweep with the
    real URL (the server sees the token) and done; one never sent is re-sent so by `ocrq
    requeue`. The rows show the URL redacted all along."""
    budget = Budget(250, "url-resend")
    url = f"{rig.server.url('/swept.png', host=HOST)}?token={TOKEN}&page=2"
    elsewhere = Settings(
        broker_url=rig.settings.broker_url,
        database_url=rig.settings.database_url,
        queue=f"nowhere-{uuid.uuid4().hex[:6]}",  # no worker: the message is as good as lost
    )
    swept = Client(elsewhere).submit({"url": url})
    died_under(rig, swept, {"url": url})
    row = final(rig, budget, swept, "the swept URL job done")
    assert row["status"] == "done" and row["text"] == URL_TEXT, row
    assert row["attempts"] == 2 and row["source"].endswith("?token=***&page=2"), row
    assert f"/swept.png?token={TOKEN}&page=2" in rig.server.hits

    requeued_url = url.replace("/swept.png", "/requeued.png")
    queued = Client(elsewhere).submit({"url": requeued_url})
    # `ocrq requeue` leaves a message that still waits in a queue alone: lose this one for real.
    assert redis.Redis.from_url(rig.settings.broker_url).delete(elsewhere.queue) == 1
    assert queued in Client(rig.settings).requeue(older_than_s=0)
    row = final(rig, budget, queued, "the requeued URL job done")
    assert row["status"] == "done" and row["text"] == URL_TEXT, row
    assert f"/requeued.png?token={TOKEN}&page=2" in rig.server.hits
    assert TOKEN not in rig.worker.text()
