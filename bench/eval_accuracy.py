"""Accuracy and throughput of an OCR engine on the shared evaluation set (ocr-eval).

    python bench/eval_accuracy.py --data ../shared/data/ocr-eval --engine rapid \\
        --out bench/results/eval_accuracy

Runs the engine in batches exactly as a worker would (PIL decode, EXIF transpose, RGB, one
PreparedImage per image, `engine.run(batch)`), then scores with bench/scoring.py: SVT word-crop
accuracy, SROIE token F1 (mean over receipts and pooled), page CER (inside the transcribed zones
where a page has a .uzn file), SVT scene word recall. Writes accuracy_<engine>.json and .md.
Throughput counts `engine.run` time only; decoding is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

from PIL import Image, ImageOps

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.scoring import (  # noqa: E402
    EvalImage,
    cer,
    f1_from_counts,
    ground_truth_text,
    load_manifest,
    normalize_word,
    page_zones,
    scene_words,
    token_counts,
    token_f1,
    word_recall,
)
from ocrq.models.base import Engine, OcrResult, PreparedImage  # noqa: E402

KIND_ORDER = ("svt_word", "sroie", "page", "svt_scene")
# A space between two digits ("1 14"): numbers split by the engine's word gaps show up here.
DIGIT_SPACE_DIGIT = re.compile(r"(?<=\d) (?=\d)")
# CJK punctuation, full-width forms and ideographs: none belongs in an English receipt's text
# (PP-OCRv4 read "（", "：" and "一" for a dash in 11 of the 20; issue 51).
CJK = re.compile(r"[\u2e80-\u9fff\uf900-\ufaff\ufe30-\ufe4f\uff00-\uffef]")
TARGETS = {"svt_word_accuracy": 0.90, "sroie_token_f1_mean": 0.70}


@dataclass
class Outcome:
    """What the engine made of one image."""

    entry: EvalImage
    result: OcrResult | Exception

    @property
    def text(self) -> str:
        return "" if isinstance(self.result, Exception) else self.result.text


@dataclass
class Timing:
    images: int = 0
    engine_s: float = 0.0
    decode_s: float = 0.0

    @property
    def images_per_s(self) -> float:
        return self.images / self.engine_s if self.engine_s else 0.0


@dataclass
class Run:
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)
    timing: dict[str, Timing] = field(default_factory=dict)
    load_s: float = 0.0
    # 1-minute load average before and after: the CPU is shared, and throughput means little
    # without knowing what else ran.
    loadavg: tuple[float, float] = (0.0, 0.0)


# ------------------------------------------------------------------------------------ running


def load_image(path: Path) -> Image.Image:
    """Decode as the worker does: EXIF orientation applied, RGB."""
    with Image.open(path) as raw:
        return ImageOps.exif_transpose(raw).convert("RGB")


def run_engine(
    engine: Engine,
    entries: Sequence[EvalImage],
    batch_size: int,
    progress: Callable[[str], None],
) -> Run:
    """Run every entry through `engine.run` in batches of `batch_size`, kind by kind."""
    run = Run()
    by_kind: dict[str, list[EvalImage]] = {}
    for entry in entries:
        by_kind.setdefault(entry.kind, []).append(entry)
    for kind in sorted(by_kind, key=lambda k: KIND_ORDER.index(k) if k in KIND_ORDER else 99):
        group, timing, outcomes = by_kind[kind], Timing(), []
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            t0 = time.perf_counter()
            images = [load_image(e.image_path) for e in chunk]
            batch = [
                PreparedImage(key=e.name, image=im, original_size=im.size)
                for e, im in zip(chunk, images, strict=True)
            ]
            t1 = time.perf_counter()
            results = engine.run(batch)
            t2 = time.perf_counter()
            timing.decode_s += t1 - t0
            timing.engine_s += t2 - t1
            timing.images += len(chunk)
            outcomes += [Outcome(e, r) for e, r in zip(chunk, results, strict=True)]
            progress(
                f"[{kind}] {timing.images}/{len(group)} images, "
                f"{timing.engine_s:.1f} s in the engine ({timing.images_per_s:.2f} img/s)"
            )
        run.outcomes[kind] = outcomes
        run.timing[kind] = timing
    return run


_WORKER_ENGINE: Engine | None = None


def _worker_start(args: argparse.Namespace) -> None:
    global _WORKER_ENGINE
    _WORKER_ENGINE = make_engine(args)
    _WORKER_ENGINE.load()


def _worker_batch(entries: list[EvalImage], batch_size: int) -> Run:
    assert _WORKER_ENGINE is not None
    return run_engine(_WORKER_ENGINE, entries, batch_size, lambda msg: None)


def run_parallel(
    args: argparse.Namespace, entries: Sequence[EvalImage], progress: Callable[[str], None]
) -> Run:
    """`--jobs`: the batches spread over processes with an engine each, merged into one Run in
    the usual order. For a shared, busy host, where one process gets a small slice of the CPU;
    engine seconds are then the sum over processes of each batch's wall time."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    by_kind: dict[str, list[EvalImage]] = {}
    for entry in entries:
        by_kind.setdefault(entry.kind, []).append(entry)
    kinds = sorted(by_kind, key=lambda k: KIND_ORDER.index(k) if k in KIND_ORDER else 99)
    units = [
        (kind, by_kind[kind][i : i + args.batch_size])
        for kind in kinds
        for i in range(0, len(by_kind[kind]), args.batch_size)
    ]
    run = Run()
    context = multiprocessing.get_context("spawn")  # no onnxruntime threads carried over a fork
    with ProcessPoolExecutor(args.jobs, context, _worker_start, (args,)) as pool:
        futures = [pool.submit(_worker_batch, chunk, args.batch_size) for _, chunk in units]
        for n, ((kind, _), future) in enumerate(zip(units, futures, strict=True), 1):
            part = future.result()
            run.outcomes.setdefault(kind, []).extend(part.outcomes[kind])
            t, p = run.timing.setdefault(kind, Timing()), part.timing[kind]
            t.images, t.engine_s, t.decode_s = (
                t.images + p.images,
                t.engine_s + p.engine_s,
                t.decode_s + p.decode_s,
            )
            progress(f"{n}/{len(units)} batches done ({kind})")
    return run


# ------------------------------------------------------------------------------------ scoring


def zoned_text(outcome: Outcome) -> str:
    """The text read inside a page's transcribed zones, zone by zone (all text if none).

    A line belongs to the zone holding the centre of its box; within a zone lines keep the
    engine's reading order.
    """
    zones = page_zones(outcome.entry)
    if not zones or isinstance(outcome.result, Exception):
        return outcome.text
    parts = []
    for x, y, w, h in zones:
        inside = [
            line.text
            for line in outcome.result.lines
            if x <= (line.box[0] + line.box[2]) / 2 <= x + w
            and y <= (line.box[1] + line.box[3]) / 2 <= y + h
        ]
        parts.append("\n".join(inside))
    return "\n".join(parts)


def score_words(outcomes: list[Outcome]) -> dict:
    hits = [normalize_word(o.text) == normalize_word(ground_truth_text(o.entry)) for o in outcomes]
    misses = [
        {"image": o.entry.name, "read": o.text, "truth": ground_truth_text(o.entry)}
        for o, hit in zip(outcomes, hits, strict=True)
        if not hit
    ]
    return {"n": len(hits), "accuracy": round(sum(hits) / len(hits), 4), "misses": misses}


def score_receipts(outcomes: list[Outcome]) -> dict:
    per_image, counts = [], []
    for o in outcomes:
        truth = ground_truth_text(o.entry)
        p, r, f1 = token_f1(o.text, truth)
        counts.append(token_counts(o.text, truth))
        per_image.append(
            {
                "image": o.entry.name,
                "size": [o.entry.width, o.entry.height],
                "precision": round(p, 4),
                "recall": round(r, 4),
                "f1": round(f1, 4),
            }
        )
    pooled = [sum(c[i] for c in counts) for i in range(3)]
    mp, mr, mf = f1_from_counts(*pooled)
    return {
        "n": len(outcomes),
        "token_f1_mean": round(mean(x["f1"] for x in per_image), 4),
        "micro": {"precision": round(mp, 4), "recall": round(mr, 4), "f1": round(mf, 4)},
        "receipts_with_cjk": sum(1 for o in outcomes if CJK.search(o.text)),
        "cjk_chars": "".join(sorted({c for o in outcomes for c in CJK.findall(o.text)})),
        "digit_space_digit": {
            "read": sum(len(DIGIT_SPACE_DIGIT.findall(o.text)) for o in outcomes),
            "truth": sum(
                len(DIGIT_SPACE_DIGIT.findall(ground_truth_text(o.entry))) for o in outcomes
            ),
        },
        "per_image": per_image,
    }


def score_pages(outcomes: list[Outcome]) -> dict:
    per_page = []
    for o in outcomes:
        truth = ground_truth_text(o.entry)
        zoned = bool(page_zones(o.entry))
        per_page.append(
            {
                "image": o.entry.name,
                "size": [o.entry.width, o.entry.height],
                "zoned": zoned,
                "cer": round(cer(zoned_text(o), truth), 4),
                "token_f1": round(token_f1(o.text, truth)[2], 4),
            }
        )
    return {
        "n": len(per_page),
        "cer_mean": round(mean(p["cer"] for p in per_page), 4),
        "per_page": per_page,
    }


def score_scenes(outcomes: list[Outcome]) -> dict:
    found = [word_recall(o.text, scene_words(o.entry)) for o in outcomes]
    return {
        "n": len(outcomes),
        "words": sum(t for _, t in found),
        "found": sum(f for f, _ in found),
        "word_recall": round(sum(f for f, _ in found) / max(1, sum(t for _, t in found)), 4),
    }


SCORERS: dict[str, Callable[[list[Outcome]], dict]] = {
    "svt_word": score_words,
    "sroie": score_receipts,
    "page": score_pages,
    "svt_scene": score_scenes,
}


# ------------------------------------------------------------------------------------ report


def hardware() -> dict[str, str]:
    """CPU model and count from lscpu, memory, OS: the line every throughput figure needs."""
    info = {"platform": platform.platform(), "python": platform.python_version()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "Hypervisor vendor"):
                info[key.strip()] = value.strip()
    except (OSError, subprocess.SubprocessError):
        info["lscpu"] = "unavailable"
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = f"{pages * page_size / 1024**3:.1f}"
    except (ValueError, OSError):
        pass
    return info


def hardware_line(hw: dict[str, str]) -> str:
    return (
        f"{hw.get('Model name', '?')}, {hw.get('CPU(s)', '?')} CPUs, "
        f"{hw.get('memory_gib', '?')} GiB, {hw['platform']}, Python {hw['python']}"
    )


def build_report(engine: Engine, run: Run, batch_size: int, command: str) -> dict:
    scores = {kind: SCORERS[kind](outs) for kind, outs in run.outcomes.items() if kind in SCORERS}
    errors = {
        kind: [f"{o.entry.name}: {o.result!r}" for o in outs if isinstance(o.result, Exception)]
        for kind, outs in run.outcomes.items()
    }
    total = Timing(
        images=sum(t.images for t in run.timing.values()),
        engine_s=sum(t.engine_s for t in run.timing.values()),
        decode_s=sum(t.decode_s for t in run.timing.values()),
    )
    summary = {
        "svt_word_accuracy": scores.get("svt_word", {}).get("accuracy"),
        "sroie_token_f1_mean": scores.get("sroie", {}).get("token_f1_mean"),
        "sroie_token_f1_micro": scores.get("sroie", {}).get("micro", {}).get("f1"),
        "sroie_digit_space_digit": scores.get("sroie", {}).get("digit_space_digit", {}).get("read"),
        "sroie_receipts_with_cjk": scores.get("sroie", {}).get("receipts_with_cjk"),
        "page_cer_mean": scores.get("page", {}).get("cer_mean"),
        "svt_scene_word_recall": scores.get("svt_scene", {}).get("word_recall"),
        "images_per_s": round(total.images_per_s, 3),
    }
    return {
        "engine": engine.describe(),
        "command": command,
        "batch_size": batch_size,
        "hardware": hardware(),
        "loadavg_1min": {"before": run.loadavg[0], "after": run.loadavg[1]},
        "summary": summary,
        "targets": {k: {"min": v, "met": (summary.get(k) or 0) >= v} for k, v in TARGETS.items()},
        "scores": scores,
        "errors": {k: v for k, v in errors.items() if v},
        "timing": {
            "load_s": round(run.load_s, 2),
            **{
                kind: {
                    "images": t.images,
                    "engine_s": round(t.engine_s, 2),
                    "decode_s": round(t.decode_s, 2),
                    "images_per_s": round(t.images_per_s, 3),
                }
                for kind, t in {**run.timing, "all": total}.items()
            },
        },
    }


def markdown(report: dict) -> str:
    s, scores, timing = report["summary"], report["scores"], report["timing"]
    name = report["engine"].get("engine", "?")
    out = [
        f"# Accuracy of engine `{name}` on the shared eval set (ocr-eval)",
        "",
        f"Reproduce: `{report['command']}`",
        "",
        f"Hardware: {hardware_line(report['hardware'])}.",
        f"Engine: {', '.join(f'{k}={v}' for k, v in report['engine'].items())}.",
        f"Batches of {report['batch_size']} images per `engine.run`.",
        "",
    ]
    before = report.get("before")
    if before:
        out += [
            f"Before: {before['label']} (`{before['file']}`, same data and scoring).",
            "",
            "| measure | before | value | target |",
            "|---|---|---|---|",
        ]
    else:
        out += ["| measure | value | target |", "|---|---|---|"]
    truth_gaps = scores.get("sroie", {}).get("digit_space_digit", {}).get("truth")
    rows = [
        ("SVT word-crop accuracy (normalised exact match)", "svt_word_accuracy", "svt_word"),
        ("SROIE token F1, mean over receipts", "sroie_token_f1_mean", "sroie"),
        ("SROIE token F1, pooled (micro)", "sroie_token_f1_micro", "sroie"),
        (
            f"SROIE digit-space-digit in the text read (ground truth: {truth_gaps})",
            "sroie_digit_space_digit",
            "sroie",
        ),
        (
            "SROIE receipts with CJK characters or punctuation "
            f"({scores.get('sroie', {}).get('cjk_chars') or 'none'})",
            "sroie_receipts_with_cjk",
            "sroie",
        ),
        ("Page CER (in transcribed zones), mean", "page_cer_mean", "page"),
        ("SVT scene word recall (partial labels)", "svt_scene_word_recall", "svt_scene"),
    ]
    for label, key, kind in rows:
        n = scores.get(kind, {}).get("n", 0)
        target = report["targets"].get(key)
        goal = f">= {target['min']} ({'met' if target['met'] else 'MISSED'})" if target else ""
        was = f" {before['summary'].get(key, '')} |" if before else ""
        out.append(f"| {label} (n={n}) |{was} {s.get(key)} | {goal} |")
    out += [
        "",
        "## Throughput (engine.run only; decode apart)",
        "",
        "| images | n | engine s | images/s | decode s |",
        "|---|---|---|---|---|",
    ]
    for kind, t in timing.items():
        if isinstance(t, dict):
            out.append(
                f"| {kind} | {t['images']} | {t['engine_s']} | {t['images_per_s']} "
                f"| {t['decode_s']} |"
            )
    load = report["loadavg_1min"]
    out += [
        "",
        f"Engine load: {timing['load_s']} s. 1-minute load average {load['before']} before and "
        f"{load['after']} after the run on these {report['hardware'].get('CPU(s)', '?')} CPUs: "
        "other processes sharing the machine slow the figures above down.",
        "",
        "Notes: page CER compares the text read inside each transcribed zone of the page's .uzn "
        "(zone order, reading order within a zone) with the transcript, whitespace collapsed; "
        "scene recall counts annotated words found among the whitespace-separated words read "
        "(both normalised to upper-case letters and digits).",
        "",
    ]
    if "sroie" in scores:
        was_f1 = {r["image"]: r["f1"] for r in before["sroie_per_image"]} if before else {}
        head = "| receipt | size | P | R | F1 |" + (" F1 before |" if before else "")
        out += ["## SROIE receipts", "", head, "|---" * (6 if before else 5) + "|"]
        for r in scores["sroie"]["per_image"]:
            size = "x".join(map(str, r["size"]))
            was = f" {was_f1.get(r['image'], '')} |" if before else ""
            out.append(
                f"| {r['image']} | {size} | {r['precision']} | {r['recall']} | {r['f1']} |{was}"
            )
        out.append("")
    if "page" in scores:
        out += ["## Pages", "", "| page | size | zoned | CER | token F1 |", "|---|---|---|---|---|"]
        for p in scores["page"]["per_page"]:
            size = "x".join(map(str, p["size"]))
            out.append(f"| {p['image']} | {size} | {p['zoned']} | {p['cer']} | {p['token_f1']} |")
        out.append("")
    if "svt_word" in scores:
        out += ["## SVT word crops read wrong", "", "| crop | read | truth |", "|---|---|---|"]
        for m in scores["svt_word"]["misses"]:
            read = m["read"].replace("|", "\\|").replace("\n", " / ") or "(nothing)"
            out.append(f"| {m['image']} | {read} | {m['truth']} |")
        out.append("")
    if report["errors"]:
        out += ["## Per-image errors", ""]
        out += [f"- {kind}: {e}" for kind, errs in report["errors"].items() for e in errs]
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------ main


def before_summary(path: Path, label: str) -> dict:
    """The figures of an earlier report, shown beside this run's."""
    earlier = json.loads(path.read_text())
    try:
        shown = str(path.resolve().relative_to(REPO))
    except ValueError:
        shown = str(path)
    return {
        "file": shown,
        "label": label,
        "summary": earlier["summary"],
        "sroie_per_image": earlier.get("scores", {}).get("sroie", {}).get("per_image", []),
    }


def make_engine(args: argparse.Namespace) -> Engine:
    if args.engine == "rapid":
        from ocrq.models.rapid import RapidEngine

        return RapidEngine(
            rec_batch_size=args.rec_batch_size,
            text_score=args.text_score,
            intra_op_threads=args.threads,
            models=args.models or "",
        )
    from ocrq.core.settings import Settings
    from ocrq.models.registry import create_engine

    return create_engine(args.engine, Settings())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "ocr-eval")
    ap.add_argument("--engine", default="rapid")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "eval_accuracy")
    ap.add_argument("--batch-size", type=int, default=8, help="images per engine.run")
    ap.add_argument(
        "--only", nargs="*", choices=KIND_ORDER, help="score only these kinds (default: all)"
    )
    ap.add_argument(
        "--jobs", type=int, default=1, help="processes, one kind each (a busy shared host)"
    )
    ap.add_argument("--before", type=Path, help="an earlier accuracy_*.json to compare with")
    ap.add_argument("--before-label", default="the earlier run", help="what --before was")
    rapid = ap.add_argument_group("rapid engine")
    rapid.add_argument("--rec-batch-size", type=int, default=16)
    rapid.add_argument("--text-score", type=float, default=0.5)
    rapid.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    rapid.add_argument(
        "--models",
        help="model set (OCRQ_RAPID_MODELS; default: the engine's default); named in the file",
    )
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python bench/eval_accuracy.py " + shlex.join(
        list(argv) if argv is not None else sys.argv[1:]
    )
    entries = load_manifest(args.data)
    if args.only:
        entries = [e for e in entries if e.kind in args.only]

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    load_before = os.getloadavg()[0]
    engine = make_engine(args)
    t0 = time.perf_counter()
    engine.load()
    load_s = time.perf_counter() - t0
    progress(f"engine {args.engine} loaded in {load_s:.1f} s; {len(entries)} images")
    if args.jobs > 1:
        run = run_parallel(args, entries, progress)
    else:
        run = run_engine(engine, entries, args.batch_size, progress)
    run.load_s = load_s
    run.loadavg = (round(load_before, 2), round(os.getloadavg()[0], 2))
    report = build_report(engine, run, args.batch_size, command)
    if args.before:
        report["before"] = before_summary(args.before, args.before_label)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (f"accuracy_{args.engine}" + (f"_{args.models}" if args.models else ""))
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(json.dumps(report["summary"], indent=2))
    progress(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
