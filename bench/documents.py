"""Pages/s for a PDF through the service against the same pages submitted as images.

A 50-page image PDF is made from the shared evaluation pages (receipts and book pages, each
page rendering back to exactly its image's pixels at 144 dpi), then one real `ocrq worker`
(CPU engine) reads it twice: the 50 pages as 50 image jobs, and the PDF as one document (one
splitting job, 50 page jobs that render their own page). Also timed alone: rendering every page
in this process (PDFium, one lock), so it can be set against the OCR time per page.

    bash scripts/services.sh
    .venv/bin/python bench/documents.py --data ../shared/data/ocr-eval --out bench/results/documents
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from PIL import Image  # noqa: E402

from bench.scoring import load_manifest  # noqa: E402

BIN = Path(sys.executable).parent
DPI = 144


def page_images(data: Path, count: int) -> list[Path]:
    pages = [e.image_path for e in load_manifest(data) if e.kind in ("sroie", "page")]
    return [Path(pages[i % len(pages)]) for i in range(count)]


def make_pdf(paths: list[Path], out: Path) -> Path:
    import pypdfium2 as pdfium

    pdf = pdfium.PdfDocument.new()
    for path in paths:
        rgb = Image.open(path).convert("RGB")
        w, h = rgb.size[0] * 72 / DPI, rgb.size[1] * 72 / DPI
        page = pdf.new_page(w, h)
        obj = pdfium.PdfImage.new(pdf)
        obj.set_bitmap(pdfium.PdfBitmap.from_pil(rgb))
        obj.set_matrix(pdfium.PdfMatrix().scale(w, h))
        page.insert_obj(obj)
        page.gen_content()
        page.close()
    pdf.save(str(out))
    pdf.close()
    return out


def render_only(pdf: Path, pages: int) -> float:
    """Seconds to render every page once, as page jobs do (lazily from the file, one lock)."""
    from ocrq.core.settings import Settings
    from ocrq.intake.documents import Document, render_pdf_page

    settings = Settings(pdf_dpi=DPI)
    t0 = time.perf_counter()
    for n in range(1, pages + 1):
        with Document("pdf", pdf.open("rb"), str(pdf)) as doc:
            render_pdf_page(doc, n, settings, None)
    return time.perf_counter() - t0


def timed_wait(env: dict[str, str], ids: list[str], label: str) -> float:
    from ocrq.api.client import Client
    from ocrq.core.settings import Settings

    settings = Settings(broker_url=env["OCRQ_BROKER_URL"], database_url=env["OCRQ_DATABASE_URL"])
    client = Client(settings)
    rows = client.wait(ids, timeout=3600, poll_s=0.1)
    bad = [r for r in rows if r["status"] != "done"]
    if bad:
        raise SystemExit(f"{label}: {len(bad)} not done: {bad[:2]}")
    return time.monotonic()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "ocr-eval")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "documents")
    ap.add_argument("--pages", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--broker", default="redis://127.0.0.1:6379/3")
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432")
    ap.add_argument("--note", default="")
    args = ap.parse_args()

    from ocrq.api.client import Client
    from ocrq.core.settings import Settings

    # A timeout's SIGTERM still runs the `finally` that stops the worker this script started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"ocrq-bench-docs-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True)
    paths = page_images(args.data, args.pages)
    pdf = make_pdf(paths, work / "fifty.pdf")
    render_s = render_only(pdf, args.pages)
    db = f"{args.pg}/ocrq_bench_{uuid.uuid4().hex[:8]}"
    queue = f"ocr-bench-{uuid.uuid4().hex[:6]}"
    env = {
        **os.environ,
        "OCRQ_BROKER_URL": args.broker,
        "OCRQ_DATABASE_URL": db,
        "OCRQ_ALLOWED_ROOTS": os.pathsep.join([str(work), str(args.data.resolve())]),
        "OCRQ_ENGINE": "rapid",
        "OCRQ_QUEUE": queue,
        "OCRQ_PDF_DPI": str(DPI),
    }
    subprocess.run([str(BIN / "ocrq"), "migrate"], env=env, check=True, timeout=120)
    log = (work / "worker.log").open("w")
    worker = subprocess.Popen(
        [str(BIN / "ocrq"), "worker", "--concurrency", str(args.concurrency)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while " ready." not in (work / "worker.log").read_text(errors="replace"):
            if time.monotonic() > deadline or worker.poll() is not None:
                raise SystemExit((work / "worker.log").read_text()[-3000:])
            time.sleep(0.2)
        client = Client(Settings(broker_url=args.broker, database_url=db, queue=queue))
        # Warm-up: a few images so neither run pays the first batches' start-up.
        timed_wait(env, [client.submit({"path": str(p.resolve())}) for p in paths[:4]], "warm-up")
        t0 = time.monotonic()
        ids = [client.submit({"path": str(p.resolve())}) for p in paths]
        images_s = timed_wait(env, ids, "images") - t0
        t0 = time.monotonic()
        document_id = client.submit({"path": str(pdf)})
        document_s = timed_wait(env, [document_id], "document") - t0
        doc = client.status([document_id])[0]
        images_rows = {r["job_id"]: r for r in client.status(ids)}
        same = sum(
            p["text"] == images_rows[i]["text"]
            for p, i in zip(doc["page_results"], ids, strict=True)
        )
    finally:
        os.killpg(worker.pid, 15)
        worker.wait(60)
    result = {
        "pages": args.pages,
        "dpi": DPI,
        "concurrency": args.concurrency,
        "images_seconds": round(images_s, 2),
        "images_pages_per_s": round(args.pages / images_s, 3),
        "document_seconds": round(document_s, 2),
        "document_pages_per_s": round(args.pages / document_s, 3),
        "render_only_seconds": round(render_s, 2),
        "render_ms_per_page": round(1000 * render_s / args.pages, 1),
        "pages_with_same_text_as_image": same,
        "pdf_bytes": pdf.stat().st_size,
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.machine()}",
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "note": args.note,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "documents_rapid.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(
        [
            f"| {args.pages} image jobs | {images_s:.1f} | {args.pages / images_s:.2f} |",
            f"| 1 document ({args.pages} page jobs) | {document_s:.1f} "
            f"| {args.pages / document_s:.2f} |",
            f"| rendering alone (one process, PDFium) | {render_s:.1f} "
            f"| {args.pages / render_s:.1f} |",
        ]
    )
    md = f"""# Documents through the service (CPU engine)

{args.pages}-page image PDF made from the eval set's receipts and book pages (rendering back to
each image's own pixels at {DPI} dpi), against the same {args.pages} pages submitted as images;
one `ocrq worker --concurrency {args.concurrency}` (rapid), Redis and PostgreSQL on localhost.

| run | seconds | pages/s |
|---|---|---|
{rows}

Rendering: {result["render_ms_per_page"]} ms a page. Pages whose document text equals the image
job's text: {same} of {args.pages}.

Machine: {result["machine"]}. {args.note}

Command: `{result["command"]}`
"""
    (args.out / "documents_rapid.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
