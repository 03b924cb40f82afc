"""`ocrq export` over a large batch: records/s and the process's peak memory per format, and
how long `GET /batches/{id}`'s summary query takes over the same rows.

Rows are made in PostgreSQL itself (generate_series: each a done or failed image job with a
540-character text and one line), in a database this script creates and drops, so what is
timed is the export: the server-side cursor, the formatting, the writing. A flat peak memory
as the row count grows is what says the export streams.

    bash scripts/services.sh
    .venv/bin/python bench/export.py --rows 200000 --out bench/results/export
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from ocrq.core import batches  # noqa: E402

BIN = Path(sys.executable).parent
ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"

FILL = """
INSERT INTO ocr_jobs (id, status, task, source, text, lines, created_at, started_at,
                      finished_at, attempts, batch)
SELECT gen_random_uuid()::text,
       CASE WHEN i % 50 = 0 THEN 'failed' ELSE 'done' END, 'text',
       '/srv/img/scan-' || i || '.png', repeat('INVOICE 2026 TOTAL 134.90 ', 20),
       '[{"text": "INVOICE 2026", "box": [1, 2, 3, 4], "score": 0.9}]'::jsonb,
       now() - interval '1 hour' + i * interval '10 ms', now() - interval '1 hour',
       now() - interval '1 hour' + i * interval '12 ms', 1, 'big'
FROM generate_series(1, :rows) AS i
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/export")
    args = ap.parse_args()
    name = f"ocrq_bench_export_{uuid.uuid4().hex[:8]}"
    url = make_url(ADMIN).set(database=name).render_as_string(hide_password=False)
    env = {**os.environ, "OCRQ_DATABASE_URL": url, "PYTHONPATH": str(REPO)}
    admin = create_engine(ADMIN, isolation_level="AUTOCOMMIT")
    results: list[dict] = []
    try:
        subprocess.run([str(BIN / "ocrq"), "migrate"], env=env, check=True)
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text(FILL), {"rows": args.rows})
        batches.summary(engine, "big")  # warm
        started = time.perf_counter()
        summary = batches.summary(engine, "big")
        summary_ms = (time.perf_counter() - started) * 1000
        assert summary is not None
        engine.dispose()
        scratch = Path(tempfile.mkdtemp(prefix="ocrq-export-"))
        for fmt in ("jsonl", "csv", "md"):
            out = scratch / f"out.{fmt}"
            # Each export in a process of its own, under `time -f %M`: its own peak RSS.
            started = time.perf_counter()
            proc = subprocess.run(
                ["/usr/bin/time", "-f", "peak_kib=%M", str(BIN / "ocrq"), "export",
                 "--batch", "big", "--format", fmt, "--out", str(out)],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            seconds = time.perf_counter() - started
            peak = int(proc.stderr.rsplit("peak_kib=", 1)[1].split()[0])
            files = list(out.rglob("*")) if out.is_dir() else [out]
            size = sum(f.stat().st_size for f in files)
            results.append(
                {
                    "format": fmt,
                    "rows": args.rows,
                    "seconds": round(seconds, 2),
                    "records_per_s": round(args.rows / seconds),
                    "peak_rss_mib": round(peak / 1024, 1),
                    "output_mib": round(size / 2**20, 1),
                }
            )
            print(results[-1], flush=True)
            if out.is_dir():
                shutil.rmtree(out)
            else:
                out.unlink()
        shutil.rmtree(scratch)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    meta = {
        "command": " ".join(["bench/export.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "python": platform.python_version(),
        "summary_ms": round(summary_ms, 1),
        "summary_jobs": summary.jobs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta, "results": results}
    (args.out / "export_cpu.json").write_text(json.dumps(report, indent=1))
    lines = [
        "# `ocrq export` over one large batch",
        "",
        f"Command: `{meta['command']}` on {meta['machine']}, Python {meta['python']}, PostgreSQL "
        "on the same machine. Each export is a separate `ocrq export --batch big` process; its "
        "peak RSS is `/usr/bin/time -f %M`'s. The progress bar was on stderr (not a terminal).",
        "",
        "| format | rows | s | records/s | peak RSS MiB | output MiB |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['format']} | {r['rows']} | {r['seconds']} | {r['records_per_s']} | "
            f"{r['peak_rss_mib']} | {r['output_mib']} |"
            for r in results
        ),
        "",
        f"`GET /batches/big`'s summary query over the same {args.rows} rows (one grouped scan of "
        f"the batch's index): {meta['summary_ms']} ms ({summary.jobs}).",
        "",
        "Reading: the peak memory stays that of the Python process with its imports while the "
        "output is several times larger: rows come 500 per round trip from the server-side "
        "cursor and are written as they come. md writes one file per done job, so its time is "
        "mostly the file system's, and its peak a little higher: it keeps the names it gave, "
        "so that no file overwrites another.",
    ]
    (args.out / "export_cpu.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
