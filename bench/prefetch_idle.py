"""Device idle time between batches, with threaded prefetch on and off, in one run.

"Device" is whatever the engine runs on: the GPU for hunyuan, the CPU for rapid. The queue is
kept full (every job is submitted at once); the batcher stamps each batch's start and end, and
idle = the gaps between one batch's end and the next one's start, over the wall time from the
first batch's start to the last one's end.

Prefetch off = as many task threads as one batch holds (a Celery worker with concurrency =
max_batch): every thread waits on the running batch, so the next batch's images are fetched,
decoded and preprocessed only after it returns. Prefetch on = twice that (and the default cap
of two batches' worth of decoded images): the next batch is made ready while this one runs.

    python bench/prefetch_idle.py --engine rapid --data ../shared/data/ocr-eval \\
        --out bench/results/prefetch_idle
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: bench.* is importable
    sys.path.insert(0, str(REPO))

from bench.scoring import load_manifest  # noqa: E402
from ocrq.core.contract import ImageRef, JobRequest  # noqa: E402
from ocrq.core.db import get_engine  # noqa: E402
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.core.store import JobStore  # noqa: E402
from ocrq.worker.runtime import build_runtime  # noqa: E402


def synthetic_workload(sizes_tsv: Path, folder: Path, count: int) -> list[Path]:
    """Drawn text images at the eval set's sizes (for machines without the data, e.g. a GPU).

    JPEG like the originals, so decoding costs what it costs on real scans.
    """
    from PIL import Image, ImageDraw

    rows = [
        line.split("\t")
        for line in sizes_tsv.read_text().splitlines()
        if line and not line.startswith("#") and not line.startswith("dataset")
    ]
    rows.sort(key=lambda r: zlib.crc32("".join(r).encode()))
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        _, w, h = rows[i % len(rows)]
        image = Image.new("RGB", (int(w), int(h)), "white")
        draw = ImageDraw.Draw(image)
        for y in range(8, int(h) - 20, 40):
            draw.text((8, y), f"LINE {y} OF IMAGE {i} TOTAL 12.50", fill="black")
        path = folder / f"synth{i:04d}.jpg"
        image.save(path, quality=90)
        paths.append(path)
    return paths


def workload(data: Path, count: int) -> list[Path]:
    """Eval images in manifest order, repeated to `count`: a mix of crops, photos, receipts."""
    entries = [e.image_path for e in load_manifest(data)]
    entries = [p for p in entries if p.suffix.lower() in (".jpg", ".png", ".jpeg")]
    # Interleave kinds so every batch mixes sizes, as a real queue would.
    entries.sort(key=lambda p: zlib.crc32(p.name.encode()))
    return [entries[i % len(entries)] for i in range(count)]


def measure(settings: Settings, paths: list[Path], db_url: str) -> dict[str, Any]:
    runtime = build_runtime(settings, store=JobStore(get_engine(db_url)), worker_name="bench")
    runtime.batcher.records.clear()
    try:
        # Warm-up batch, not counted.
        with ThreadPoolExecutor(settings.concurrency) as pool:
            reqs = [JobRequest(image=ImageRef(path=str(p))) for p in paths[: settings.max_batch]]
            list(pool.map(runtime.runner.process, reqs))
        runtime.batcher.records.clear()
        t0 = time.monotonic()
        with ThreadPoolExecutor(settings.concurrency) as pool:
            reqs = [JobRequest(image=ImageRef(path=str(p))) for p in paths]
            outcomes = list(pool.map(runtime.runner.process, reqs))
        wall = time.monotonic() - t0
        records = sorted(runtime.batcher.records, key=lambda r: r.started)
    finally:
        runtime.close()
    busy = sum(r.ended - r.started for r in records)
    span = records[-1].ended - records[0].started
    gaps = [b.started - a.ended for a, b in itertools.pairwise(records)]
    return {
        "images": len(paths),
        "done": sum(o.status == "done" for o in outcomes),
        "batches": len(records),
        "mean_batch": round(len(paths) / len(records), 2),
        "wall_s": round(wall, 2),
        "span_s": round(span, 2),
        "busy_s": round(busy, 2),
        "idle_fraction": round(1 - busy / span, 4),
        "max_gap_ms": round(1000 * max(gaps, default=0.0), 1),
        "images_per_s": round(len(paths) / wall, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="rapid")
    ap.add_argument("--data", type=Path, default=Path("../shared/data/ocr-eval"))
    ap.add_argument("--count", type=int, default=96)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--budget-gib", type=float, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefetch_idle"))
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--sizes",
        type=Path,
        default=None,
        help="draw images at the sizes in this TSV instead of reading --data",
    )
    ap.add_argument("--model", default=None, help="OCRQ_MODEL for the hunyuan engine")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    args = ap.parse_args()
    results = {}
    extra: dict[str, Any] = {}
    if args.model:
        extra["model"] = args.model
    if args.max_new_tokens:
        extra["max_new_tokens"] = args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        if args.sizes:
            paths = synthetic_workload(args.sizes, Path(tmp) / "images", args.count)
            root = Path(tmp).resolve()
        else:
            paths = workload(args.data, args.count)
            root = args.data.resolve()
        db_url = f"sqlite:///{tmp}/bench.sqlite"
        JobStore(get_engine(db_url)).create_tables()
        for mode, threads in (("off", args.max_batch), ("on", 2 * args.max_batch)):
            settings = Settings(
                engine=args.engine,
                max_batch=args.max_batch,
                concurrency=threads,
                allowed_roots=[root],
                **extra,
                batch_wait_ms=20,
                **({"memory_budget_gib": args.budget_gib} if args.budget_gib else {}),
            )
            results[mode] = measure(settings, paths, db_url)
            print(mode, results[mode], flush=True)
    report = {
        "engine": args.engine,
        "hardware": f"{platform.processor() or platform.machine()}, {_cpus()} CPUs",
        "settings": {
            "max_batch": args.max_batch,
            "count": args.count,
            "threads": {"off": args.max_batch, "on": 2 * args.max_batch},
        },
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"prefetch_idle_{args.engine}{args.tag}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    rows = [
        "| prefetch | images | batches | wall s | busy s | idle % | max gap ms | images/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        rows.append(
            f"| {mode} | {r['images']} | {r['batches']} | {r['wall_s']} | {r['busy_s']} | "
            f"{100 * r['idle_fraction']:.1f} | {r['max_gap_ms']} | {r['images_per_s']} |"
        )
    (args.out / f"{stem}.md").write_text(
        f"# Device idle between batches: engine {args.engine}\n\nHardware: {report['hardware']}."
        f" Settings: {report['settings']}.\nCommand: `python bench/prefetch_idle.py --engine "
        f"{args.engine}`\n\n" + "\n".join(rows) + "\n"
    )


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    main()
