"""The CPU engine against hostile sizes: its internal sizes stay bounded whatever the image.

A 473-byte 1x100000 PNG once grew a worker to 22 GB: read as one line, it asked the recogniser
for 4.8 million columns. Everything here that could allocate like that runs in a child process
under an address-space cap (`prlimit --as`), so a regression fails the test instead of eating
the host. The images are the ones bench/rapid_memory.py measures.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from celery import Celery
from PIL import Image

from bench.rapid_memory import long_line, long_line_text, strip, text_page, thin, words
from bench.scoring import cer
from ocrq.core.db import get_engine
from ocrq.core.samples import draw_text_image
from ocrq.core.store import JobStore
from ocrq.models.base import OcrResult, PreparedImage
from ocrq.models.rapid import RapidEngine, det_plan
from ocrq.models.rapid.crops import rec_input_width, shrink_to_rec_height, to_bgr
from ocrq.models.rapid.geometry import DET_MAX_PIXELS, DET_MAX_SIDE
from ocrq.models.rapid.spacing import ink_mask
from ocrq.models.rapid.tiles import REC_TILE_COLUMNS, tiles
from tests.conftest import BIN, REPO, WorkerProcess

GiB = 1024**3
MEMORY_FAILURES = ("MemoryError", "bad_alloc", "Failed to allocate", "std::")


@pytest.fixture(scope="module")
def engine() -> RapidEngine:
    eng = RapidEngine()
    eng.load()
    return eng


def result(value: OcrResult | Exception) -> OcrResult:
    assert isinstance(value, OcrResult), f"expected a result, got {value!r}"
    return value


def strip_text(size: tuple[int, int]) -> str:
    """What `bench.rapid_memory.strip` draws, clipped to the strip: the words that fit."""
    w, h = size
    font = max(8, int(min(w, h) / 1.8))
    return words(max(w, h) // (2 * font) + 2, 0)


# ------------------------------------------------------------------------------------ detector


@pytest.mark.parametrize(
    "size",
    [(1, 100000), (100000, 1), (2000, 100000), (100000, 2000), (5300, 7470), (256, 150000),
     (30000, 60), (13340, 124), (400, 100000), (7000, 5700)],
)  # fmt: skip
def test_detector_input_is_capped(size: tuple[int, int]) -> None:
    """Without the caps the library's min-side upscale made 2000x100000 a 736x46000 input."""
    w, h = det_plan(*size).det_input
    assert w * h <= DET_MAX_PIXELS and max(w, h) <= DET_MAX_SIDE, (size, w, h)
    assert w % 32 == 0 and h % 32 == 0


def test_long_strip_is_detected_at_its_own_scale() -> None:
    # A 13340x124 line used to be squeezed to 960x32 for the detector: 3 px tall text.
    plan = det_plan(13340, 124)
    assert plan.det_input[1] >= 124


# ------------------------------------------------------------------------------------ tiles


def test_tiles_cover_a_long_crop_within_the_width_cap() -> None:
    crop = shrink_to_rec_height(to_bgr(long_line()))
    h, w = crop.shape[:2]
    parts = tiles(crop)
    assert len(parts) >= 3
    assert parts[0].start == 0 and parts[-1].stop == w
    ink = ink_mask(crop).sum(axis=0)
    for left, right in itertools.pairwise(parts):
        assert right.start < left.stop  # they overlap: each reads its neighbour's edge whole
        assert left.keep_to == right.keep_from  # and every position belongs to one tile
        assert left.start < left.keep_to < left.stop and right.start < right.keep_from
        assert ink[int(left.keep_to)] == 0  # cut between letters, on a blank column
    for part in parts:
        assert rec_input_width(crop[:, part.start : part.stop]) <= REC_TILE_COLUMNS
    short = crop[:, : REC_TILE_COLUMNS * h // 48]
    assert len(tiles(short)) == 1


# ------------------------------------------------------------------------------------ reading


def test_long_text_line_is_read(engine: RapidEngine) -> None:
    """The probe's 13340x124 line (draw_text_image, 680 characters) came out as '34 q q'."""
    image = long_line()
    assert image.height == 124 and 13000 <= image.width <= 13340
    out = result(engine.run([PreparedImage("line", image, image.size)])[0])
    assert cer(out.text, long_line_text()) <= 0.02, out.text[:300]


NUMBERS = ["114", "134.90", "2026", "Total 114", "2026-0142", "PAID 1 14.00", "11.11", "ROOM 114"]


@pytest.mark.parametrize("font_size", [24, 40])
def test_numbers_keep_their_digits_together(engine: RapidEngine, font_size: int) -> None:
    """A tabular '1' stands in a blank as wide as a word space: '114' was read '1 14' and
    '134.90' '1 34.90'. Crops (read whole) and lines of a page; real spaces stay."""
    batch = []
    for text in NUMBERS:
        crop = draw_text_image([text], size=font_size, margin=4)
        page = draw_text_image(["HEADER LINE", text, "FOOTER"], size=font_size)
        batch += [PreparedImage(text, crop, crop.size), PreparedImage(text, page, page.size)]
    out = engine.run(batch)
    for item, value in zip(batch, out, strict=True):
        lines = result(value).text.split("\n")
        assert item.key in lines, (item.key, lines)


# ------------------------------------------------------------------------------------ hostile


CHILD_CASES = {
    "thin_1x3000": lambda: thin((1, 3000)),
    "thin_1x100000": lambda: thin((1, 100000)),
    "thin_100000x1": lambda: thin((100000, 1)),
    "thin_1x1000": lambda: thin((1, 1000)),
    "strip_30000x60": lambda: strip((30000, 60)),
    "strip_60x30000": lambda: strip((60, 30000)),
    "hello": lambda: draw_text_image(["HELLO WORLD"], margin=4),
}


def child_main(names: list[str]) -> None:
    """Run in a capped child: one batch of the named cases, with the widest recogniser input
    and the peak RSS, as one JSON line on stdout."""
    from ocrq.core import procfs

    eng = RapidEngine()
    eng.load()
    widths: list[int] = []
    session = eng._rec.session

    def spy(x: np.ndarray) -> Any:  # the real session, its input width noted
        widths.append(int(x.shape[-1]))
        return session(x)

    eng._rec.session = spy
    images = [CHILD_CASES[n]() for n in names]
    out = eng.run([PreparedImage(n, im, im.size) for n, im in zip(names, images, strict=True)])
    report = {
        n: {"text": v.text} if isinstance(v, OcrResult) else {"error": f"{type(v).__name__}: {v}"}
        for n, v in zip(names, out, strict=True)
    }
    print(json.dumps({"cases": report, "max_width": max(widths, default=0),
                      "peak": procfs.peak_rss_bytes()}))  # fmt: skip


def run_capped(names: list[str], cap_bytes: int, timeout: float = 420) -> dict[str, Any]:
    code = "import sys; from tests.test_rapid_bounds import child_main; child_main(sys.argv[1:])"
    proc = subprocess.run(
        ["prlimit", f"--as={cap_bytes}", sys.executable, "-c", code, *names],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_engine_bounds_hostile_sizes_under_an_address_space_cap() -> None:
    """One batch of hostile sizes beside a good image, in a child capped at 4 GiB of address
    space: 1-pixel lines too long to read are refused alone, the rest is read through tiles no
    wider than REC_TILE_COLUMNS, the good image is unharmed."""
    names = list(CHILD_CASES)
    started = time.monotonic()
    got = run_capped(names, 4 * GiB)
    cases = got["cases"]
    for name in ("thin_1x3000", "thin_1x100000", "thin_100000x1"):
        assert cases[name]["error"].startswith("LineTooLong:"), cases[name]
        assert "too long and thin to read" in cases[name]["error"]
    assert "text" in cases["thin_1x1000"]  # 48,000 columns: read in tiles, nothing to find
    for name in ("strip_30000x60", "strip_60x30000"):
        read = cases[name]["text"]
        truth = strip_text((30000, 60))[: len(read)]
        assert len(read) > 1500 and cer(read, truth[: truth.rfind(" ")]) <= 0.03, read[:200]
    assert cases["hello"]["text"] == "HELLO WORLD"
    assert 0 < got["max_width"] <= REC_TILE_COLUMNS
    assert got["peak"] < 2 * GiB
    assert time.monotonic() - started < 400


# ------------------------------------------------------------------------------------ cost


@pytest.mark.parametrize("case", ["page_400x100000", "page_40mp_text_x1", "line_13340x124"])
def test_cost_model_covers_the_measured_peak(case: str, eval_data_root: Path) -> None:
    """Predicted growth >= measured growth (VmHWM) for the classes the old estimate missed: a
    40 MP page at 0.96 and a 400x100000 page at 0.84-0.87 of what they took."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "rapid_memory.py"), "--data", str(eval_data_root),
         "--one", case],
        capture_output=True, text=True, timeout=420, check=False,
        preexec_fn=lambda: _cap_address_space(6 * GiB),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["errors"] and got["chars_read"] > 0, got
    assert got["predicted_bytes"] >= 1.05 * got["measured_bytes"], got


def _cap_address_space(limit: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


@pytest.fixture(scope="module")
def eval_data_root() -> Path:
    from tests.conftest import EVAL_DATA

    return EVAL_DATA


# ------------------------------------------------------------------------------------ worker


class CappedWorker(WorkerProcess):
    """`ocrq worker` started under `prlimit --as`: a runaway allocation fails, not the host."""

    def __init__(self, env: dict[str, str], log: Path, cap_bytes: int, *args: str) -> None:
        self.log = log
        self._fh = log.open("w")
        self.proc = subprocess.Popen(
            ["prlimit", f"--as={cap_bytes}", str(BIN / "ocrq"), "worker", *args],
            env=env,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_rows(store: JobStore, ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = store.get(ids)
        if len(rows) == len(ids) and all(r["status"] in ("done", "failed") for r in rows.values()):
            return rows
        time.sleep(0.5)
    raise TimeoutError(f"jobs not final after {timeout} s: {store.get(ids)}")


def send(app: Celery, path: Path) -> str:
    job_id = str(uuid.uuid4())
    app.send_task("ocrq.recognize", kwargs={"image": {"path": str(path)}, "job_id": job_id},
                  queue="ocr", task_id=job_id)  # fmt: skip
    return job_id


def test_worker_survives_hostile_sizes_under_an_address_space_cap(
    service_env: dict[str, str],
    broker_url: str,
    database_url: str,
    image_root: Path,
    tmp_path: Path,
) -> None:
    """A real worker capped at 4 GiB of address space gets the probe's 1x100000 PNG, strips that
    pass the intake's limits but stress the engine, and a 39.6 MP page: every job ends in a row,
    done or failed with a clear (not an out-of-memory) error; the worker lives on and reads a
    normal image afterwards."""
    folder = image_root / "hostile"
    folder.mkdir(exist_ok=True)
    images: dict[str, Image.Image] = {
        "thin_1x100000": thin((1, 100000)),
        "thin_1x3000": thin((1, 3000)),
        "strip_30000x60": strip((30000, 60)),
        "page_39mp": text_page((5300, 7470), 96, every=12),
    }
    paths = {}
    for name, image in images.items():
        paths[name] = folder / f"{name}.png"
        image.save(paths[name])
    env = {**service_env, "OCRQ_MEMORY_BUDGET_GIB": "2.5", "MALLOC_ARENA_MAX": "2"}
    cap = 4 * GiB
    worker = CappedWorker(env, tmp_path / "ocrq.worker.log", cap, "--no-supervise",
    "--concurrency", "4")
    store = JobStore(get_engine(database_url))
    app = Celery(broker=broker_url)
    try:
        worker.wait_ready()
        ids = {name: send(app, path) for name, path in paths.items()}
        rows = wait_rows(store, list(ids.values()), timeout=420)
        for name, job_id in ids.items():
            row = rows[job_id]
            assert row["status"] in ("done", "failed"), (name, row)
            if row["status"] == "failed":
                assert row["error"] and not any(m in row["error"] for m in MEMORY_FAILURES), row
        assert rows[ids["thin_1x3000"]]["status"] == "failed"
        assert rows[ids["thin_1x100000"]]["status"] == "failed"
        page = rows[ids["page_39mp"]]
        assert page["status"] == "done", page
        assert len(page["text"].split("\n")) >= 3
        strip_row = rows[ids["strip_30000x60"]]
        if strip_row["status"] == "done":
            assert len(strip_row["text"]) > 1500
        assert worker.alive(), worker.text()[-3000:]

        hello = folder / "hello.png"
        draw_text_image(["HELLO WORLD"], margin=4).save(hello)
        after = send(app, hello)
        row = wait_rows(store, [after], timeout=120)[after]
        assert row["status"] == "done" and row["text"] == "HELLO WORLD", row
        assert worker.alive(), worker.text()[-3000:]
        assert "MemoryError" not in worker.text()
    finally:
        worker.stop()
