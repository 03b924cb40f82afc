"""Reading order and punctuation of the CPU engine's text on the shared eval set's pages and
receipts: what `text` a user gets, not the boxes.

    python bench/reading_order.py --data ../shared/data/ocr-eval --out bench/results/reading_order

Pages: the character error rate of the whole page's `text` against its transcript (which is in
column order), beside the zoned CER of bench/eval_accuracy.py, which reads each transcribed zone
apart and so cannot see the order of the columns; and the blocks (blank-line separated parts).
Receipts: token F1 (order-free), the CJK punctuation left in the text (full-width forms,
ideographic punctuation, "一"), and the lines in order, so that a later run (`--before`) says
whether a receipt's lines changed beyond its punctuation. Runs on whichever ocrq PYTHONPATH
gives: run it on an older checkout for the before figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.eval_accuracy import Outcome, load_image, zoned_text  # noqa: E402
from bench.scoring import cer, ground_truth_text, load_manifest, page_zones, token_f1  # noqa: E402
from ocrq.models.base import OcrResult, PreparedImage  # noqa: E402
from ocrq.models.rapid import RapidEngine  # noqa: E402


def cjk_punctuation(text: str) -> list[str]:
    """Full-width forms, CJK symbols and punctuation, and 一 (read for a dash), as found."""
    return [
        ch
        for ch in text
        if 0xFF01 <= ord(ch) <= 0xFF5E or 0x3000 <= ord(ch) <= 0x303F or ch == "一"
    ]


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def run(data: Path, label: str | None, models: str = "") -> dict:
    import ocrq

    entries = [e for e in load_manifest(data) if e.kind in ("page", "sroie")]
    engine = RapidEngine(models=models)
    engine.load()
    pages, receipts = [], []
    cpu = {"page": 0.0, "sroie": 0.0}
    for e in entries:
        image = load_image(e.image_path)
        t0 = time.process_time()
        result = engine.run([PreparedImage(e.name, image, image.size)])[0]
        cpu[e.kind] += time.process_time() - t0
        if not isinstance(result, OcrResult):
            raise RuntimeError(f"{e.name}: {result!r}")
        truth = ground_truth_text(e)
        if e.kind == "page":
            zoned = cer(zoned_text(Outcome(e, result)), truth) if page_zones(e) else None
            pages.append(
                {
                    "image": e.name,
                    "whole_cer": round(cer(result.text, truth), 4),
                    "zoned_cer": round(zoned, 4) if zoned is not None else None,
                    "blocks": len([b for b in result.text.split("\n\n") if b.strip()]),
                    "text": result.text,
                }
            )
        else:
            receipts.append(
                {
                    "image": e.name,
                    "token_f1": round(token_f1(result.text, truth)[2], 4),
                    "cjk_punctuation": "".join(cjk_punctuation(result.text)),
                    "blocks": len([b for b in result.text.split("\n\n") if b.strip()]),
                    "lines": [line.text for line in result.lines],
                }
            )
    return {
        "ocrq": str(Path(ocrq.__file__).parent),
        "commit": label or commit(),
        "pages": pages,
        "receipts": receipts,
        "cpu_s": {kind: round(s, 2) for kind, s in cpu.items()},
        "loadavg_1min": round(os.getloadavg()[0], 2),
    }


def same_lines(before: list[str], after: list[str]) -> bool:
    """Whether a receipt's lines are the same, in the same order, but for the punctuation the
    engine now folds."""
    try:
        from ocrq.models.rapid.punctuation import fold_latin
    except ImportError:  # an older checkout: no folding to allow for
        return before == after
    return [fold_latin(t) for t in before] == after


def markdown(report: dict, before: dict | None, command: str) -> str:
    out = [
        "# Reading order and punctuation of engine `rapid` (pages and SROIE receipts)",
        "",
        f"Reproduce: `{command}`",
        "",
        f"This run: `{report['commit']}` ({report['ocrq']}); 1-minute load average "
        f"{report['loadavg_1min']} (2 shared CPUs)."
        + (f" Before: `{before['commit']}`, the same command on that checkout." if before else ""),
        "",
        "Whole CER: the page's `text` against its transcript, whose order is the columns' "
        "(whitespace collapsed, so blank lines cost nothing). Zoned CER: each transcribed zone's "
        "lines apart, in zone order (bench/eval_accuracy.py): blind to the order of the columns.",
        "",
        "## Pages",
        "",
        "| page | whole CER before | whole CER | zoned CER before | zoned CER | blocks |",
        "|---|---|---|---|---|---|",
    ]
    was = {p["image"]: p for p in before["pages"]} if before else {}
    for p in report["pages"]:
        b = was.get(p["image"], {})
        out.append(
            f"| {p['image']} | {b.get('whole_cer', '')} | {p['whole_cer']} | "
            f"{b.get('zoned_cer', '')} | {p['zoned_cer']} | {p['blocks']} |"
        )
    out += [
        "",
        "## SROIE receipts",
        "",
        "| receipt | token F1 before | token F1 | CJK punctuation before | CJK punctuation "
        "| blocks | lines as before (punctuation folded) |",
        "|---|---|---|---|---|---|---|",
    ]
    was = {r["image"]: r for r in before["receipts"]} if before else {}
    for r in report["receipts"]:
        b = was.get(r["image"], {})
        same = same_lines(b["lines"], r["lines"]) if b else ""
        out.append(
            f"| {r['image']} | {b.get('token_f1', '')} | {r['token_f1']} | "
            f"{b.get('cjk_punctuation', '')} | {r['cjk_punctuation']} | {r['blocks']} | {same} |"
        )
    n = len(report["receipts"])
    with_cjk = sum(bool(r["cjk_punctuation"]) for r in report["receipts"])
    f1 = mean(r["token_f1"] for r in report["receipts"]) if n else 0.0
    out += [
        "",
        f"Receipts with CJK punctuation: {with_cjk} of {n}"
        + (
            f" (before: {sum(bool(r['cjk_punctuation']) for r in before['receipts'])})"
            if before
            else ""
        )
        + f"; mean token F1 {f1:.4f}"
        + (f" (before: {mean(r['token_f1'] for r in before['receipts']):.4f})" if before else "")
        + ".",
        "",
        f"CPU seconds in `engine.run` (one image a call): {report['cpu_s']}"
        + (f"; before: {before['cpu_s']}" if before else "")
        + ". The machine is shared: a guide, not a measurement of the ordering, which takes "
        "milliseconds a page.",
        "",
    ]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "ocr-eval")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "reading_order")
    ap.add_argument("--name", default="reading_order_rapid", help="file stem of the results")
    ap.add_argument("--before", type=Path, help="an earlier run's .json to compare with")
    ap.add_argument("--label", help="what this checkout is (default: git describe)")
    ap.add_argument("--models", default="", help="OCRQ_RAPID_MODELS' set (default: the default)")
    args = ap.parse_args(argv)
    command = "python bench/reading_order.py " + shlex.join(
        list(argv) if argv is not None else sys.argv[1:]
    )
    report = run(args.data, args.label, args.models)
    report["command"] = command
    before = json.loads(args.before.read_text()) if args.before else None
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.name
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    stem.with_suffix(".md").write_text(markdown(report, before, command))
    print(f"wrote {stem}.json and {stem}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
