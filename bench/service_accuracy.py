"""Accuracy through the whole service: `ocrq worker` + `ocrq submit --wait`, Redis, PostgreSQL.

Every image of the shared evaluation set goes in as its own job, exactly as a user would send
it; the texts scored are the ones read back from PostgreSQL by `ocrq submit --wait --json`.

    bash scripts/services.sh   # Redis + PostgreSQL on localhost
    .venv/bin/python bench/service_accuracy.py --data ../shared/data/ocr-eval --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: bench.* is importable
    sys.path.insert(0, str(REPO))

from bench.scoring import (  # noqa: E402
    cer,
    f1_from_counts,
    ground_truth_text,
    load_manifest,
    normalize_word,
    scene_words,
    token_counts,
    token_f1,
    word_recall,
)

BIN = Path(sys.executable).parent


def score(entries: list, texts: dict[str, str]) -> dict[str, float | int]:
    """The README's measures over the entries, from path -> text read by the service."""
    by_kind: dict[str, list] = {}
    for e in entries:
        by_kind.setdefault(e.kind, []).append(e)
    out: dict[str, float | int] = {}
    words = by_kind.get("svt_word", [])
    if words:
        hits = [
            normalize_word(texts[str(e.image_path)]) == normalize_word(ground_truth_text(e))
            for e in words
        ]
        out["svt_word_accuracy"] = round(sum(hits) / len(hits), 4)
        out["svt_words"] = len(hits)
    receipts = by_kind.get("sroie", [])
    if receipts:
        f1s = [token_f1(texts[str(e.image_path)], ground_truth_text(e))[2] for e in receipts]
        counts = [token_counts(texts[str(e.image_path)], ground_truth_text(e)) for e in receipts]
        pooled = [sum(c[i] for c in counts) for i in range(3)]
        out["sroie_token_f1_mean"] = round(mean(f1s), 4)
        out["sroie_token_f1_micro"] = round(f1_from_counts(*pooled)[2], 4)
        out["sroie_receipts"] = len(f1s)
    scenes = by_kind.get("svt_scene", [])
    if scenes:
        found = [word_recall(texts[str(e.image_path)], scene_words(e)) for e in scenes]
        out["svt_scene_word_recall"] = round(sum(f for f, _ in found) / sum(t for _, t in found), 4)
    pages = by_kind.get("page", [])
    if pages:
        out["page_cer_mean"] = round(
            mean(cer(texts[str(e.image_path)], ground_truth_text(e)) for e in pages), 4
        )
    return out


def worst_task_seconds(worker_log: Path) -> float:
    """Longest `succeeded in Xs` in the worker's log: with the threads pool a task starts when
    its message is delivered and acks when it returns, so this is the worst delivery-to-ack
    time, the figure OCRQ_VISIBILITY_TIMEOUT_S must stay above."""
    found = re.findall(r"succeeded in ([0-9.]+)s", worker_log.read_text(errors="replace"))
    return round(max((float(x) for x in found), default=0.0), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data/ocr-eval"))
    ap.add_argument("--engine", default="rapid")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    data = args.data.resolve()
    entries = load_manifest(data)
    db = f"postgresql+psycopg://postgres@127.0.0.1:5432/ocrq_bench_{uuid.uuid4().hex[:6]}"
    env = {
        **os.environ,
        "OCRQ_DATABASE_URL": db,
        "OCRQ_BROKER_URL": os.environ.get("OCRQ_BROKER_URL", "redis://127.0.0.1:6379/13"),
        "OCRQ_QUEUE": f"ocr-bench-{uuid.uuid4().hex[:6]}",
        "OCRQ_ALLOWED_ROOTS": str(data),
        "OCRQ_ENGINE": args.engine,
    }
    subprocess.run([str(BIN / "ocrq"), "migrate"], env=env, check=True)
    log = open(args.out / f"service_accuracy_{args.engine}.worker.log", "w")  # noqa: SIM115
    worker = subprocess.Popen(
        [str(BIN / "ocrq"), "worker", "--concurrency", str(args.concurrency)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        t0 = time.monotonic()
        proc = subprocess.run(
            [
                str(BIN / "ocrq"),
                "submit",
                *(str(e.image_path) for e in entries),
                "--wait",
                "--json",
                "--timeout",
                "3600",
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        wall = time.monotonic() - t0
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(120)
        log.close()
    worst = worst_task_seconds(args.out / f"service_accuracy_{args.engine}.worker.log")
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    texts = {r["path"]: r["text"] or "" for r in rows}
    statuses = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed")}
    report = {
        "engine": args.engine,
        "path": "ocrq submit --wait -> Redis -> ocrq worker -> PostgreSQL",
        "hardware": f"{platform.machine()}, {os.cpu_count()} CPUs (no GPU)",
        "images": len(rows),
        **statuses,
        "wall_s": round(wall, 1),
        "images_per_s": round(len(rows) / wall, 3),
        "worst_delivery_to_ack_s": worst,
        **score(entries, texts),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"service_accuracy_{args.engine}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"# Accuracy through the service: engine {args.engine}",
        "",
        f"Command: `python bench/service_accuracy.py --engine {args.engine}` "
        f"({report['hardware']}).",
        "",
        "| measure | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in report.items() if k not in ("engine", "hardware")]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
