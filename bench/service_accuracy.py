"""Accuracy through the whole service: `ocrq worker` + `ocrq submit --wait`, Redis, PostgreSQL.

Every image of the shared evaluation set goes in as its own job, exactly as a user would send
it; the texts scored are the ones read back from PostgreSQL by `ocrq submit --wait --json`.

    bash scripts/services.sh   # Redis + PostgreSQL on localhost
    .venv/bin/python bench/service_accuracy.py --data ../shared/data/ocr-eval \\
        --out bench/results/service_accuracy

With real HunyuanOCR weights, one command measures what following the training code's
image-token numerics is worth on your own checkpoint and images (two passes, side by side):

    OCRQ_MODEL=/path/to/HunyuanOCR .venv/bin/python bench/service_accuracy.py \
        --engine hunyuan --ab-numerics --data YOUR_EVAL_DIR --out /tmp/ab
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


def run_service(args: argparse.Namespace, entries: list, data: Path, stem: str,
                extra_env: dict[str, str]) -> dict:
    """One pass of every entry through a fresh worker, database and queue; the report."""
    db = f"postgresql+psycopg://postgres@127.0.0.1:5432/ocrq_bench_{uuid.uuid4().hex[:6]}"
    env = {
        **os.environ,
        "OCRQ_DATABASE_URL": db,
        "OCRQ_BROKER_URL": os.environ.get("OCRQ_BROKER_URL", "redis://127.0.0.1:6379/13"),
        "OCRQ_QUEUE": f"ocr-bench-{uuid.uuid4().hex[:6]}",
        "OCRQ_ALLOWED_ROOTS": str(data),
        "OCRQ_ENGINE": args.engine,
        **extra_env,
    }
    subprocess.run([str(BIN / "ocrq"), "migrate"], env=env, check=True)
    log_path = args.out / f"{stem}.worker.log"
    log = open(log_path, "w")  # noqa: SIM115
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
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    texts = {r["path"]: r["text"] or "" for r in rows}
    statuses = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed")}
    return {
        "engine": args.engine,
        **extra_env,
        "path": "ocrq submit --wait -> Redis -> ocrq worker -> PostgreSQL",
        "hardware": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "images": len(rows),
        **statuses,
        "wall_s": round(wall, 1),
        "images_per_s": round(len(rows) / wall, 3),
        "worst_delivery_to_ack_s": worst_task_seconds(log_path),
        **score(entries, texts),
        "texts": texts,
    }


def write_report(out: Path, stem: str, title: str, command: str, reports: list[dict]) -> None:
    """JSON of every pass and a table with one column per pass (texts only in the JSON)."""
    (out / f"{stem}.json").write_text(json.dumps(reports if len(reports) > 1 else reports[0],
                                                 indent=2, ensure_ascii=False))
    keys = [k for k in reports[0] if k not in ("engine", "hardware", "texts", "path")]
    lines = [f"# {title}", "", f"Command: `{command}` ({reports[0]['hardware']}).", ""]
    if len(reports) == 1:
        lines += ["| measure | value |", "|---|---|"]
        lines += [f"| {k} | {reports[0][k]} |" for k in keys]
    else:
        lines += ["| measure | " + " | ".join(r["label"] for r in reports) + " |",
                  "|---|" + "---|" * len(reports)]
        lines += [f"| {k} | " + " | ".join(str(r.get(k)) for r in reports) + " |"
                  for k in keys if k != "label"]
        a, b = reports[0]["texts"], reports[1]["texts"]
        same = sum(a[p] == b.get(p) for p in a)
        lines += ["", f"Texts identical in both passes: {same} of {len(a)} images."]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data/ocr-eval"))
    ap.add_argument("--engine", default="rapid")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None, help="the first N images of the manifest")
    ap.add_argument(
        "--ab-numerics",
        action="store_true",
        help="hunyuan: two passes, HunyuanOCR's image-token numerics as trained and as "
        "transformers has them (OCRQ_HUNYUAN_ROPE / OCRQ_HUNYUAN_VIT_POSITIONS), side by side",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/service_accuracy"))
    args = ap.parse_args()
    data = args.data.resolve()
    entries = load_manifest(data)[: args.limit]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"service_accuracy_{args.engine}"
    if not args.ab_numerics:
        report = run_service(args, entries, data, stem, {})
        write_report(args.out, stem, f"Accuracy through the service: engine {args.engine}",
                     f"python bench/service_accuracy.py --engine {args.engine}", [report])
        print(json.dumps({k: v for k, v in report.items() if k != "texts"}, indent=2))
        return
    if args.engine != "hunyuan":
        raise SystemExit("--ab-numerics compares HunyuanOCR's numerics: use --engine hunyuan")
    reports = []
    for mode in ("trained", "transformers"):
        env = {"OCRQ_HUNYUAN_ROPE": mode, "OCRQ_HUNYUAN_VIT_POSITIONS": mode}
        report = run_service(args, entries, data, f"{stem}_numerics_{mode}", env)
        reports.append({"label": mode, **report})
    write_report(
        args.out,
        f"{stem}_numerics",
        "HunyuanOCR's numerics as trained vs as transformers has them, through the service",
        f"python bench/service_accuracy.py --engine hunyuan --ab-numerics (OCRQ_MODEL="
        f"{os.environ.get('OCRQ_MODEL', 'tencent/HunyuanOCR')})",
        reports,
    )
    print(json.dumps([{k: v for k, v in r.items() if k != "texts"} for r in reports], indent=2))


if __name__ == "__main__":
    main()
