"""CPU cost of engine rapid's model sets, paired on the same images in one run (issue 51).

    python bench/rapid_models.py --data ../shared/data/ocr-eval --out bench/results/rapid_models

Both sets are loaded in this one process with one onnxruntime thread each, so CPU seconds are
the models' work and not a thread pool's spinning, and a busy host slows both alike. Each image
is read alone (`engine.run([image])`, as a worker with one job in hand would), by every set in
turn, which set goes first alternating from image to image and round to round; CPU = process
CPU time (all threads) across the call. Reported per kind: mean CPU-s per image for each set,
the ratio of the means (the issue's goal: <= 1.15 for receipts and pages), and the per-image
ratios' median and range.
The texts are kept for a side check: how many receipts read CJK characters or punctuation.
Accuracy is bench/eval_accuracy.py's job.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import mean, median

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.eval_accuracy import CJK, KIND_ORDER, hardware, hardware_line, load_image  # noqa: E402
from bench.scoring import load_manifest  # noqa: E402
from ocrq.models.base import OcrResult, PreparedImage  # noqa: E402

KIND_NAMES = {"svt_word": "word crop", "sroie": "receipt", "page": "page", "svt_scene": "scene"}


def measure(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    """Run the pairs; after each image, `save` the figures so far (a long run on a busy host
    leaves what it measured)."""
    from ocrq.models.rapid import RapidEngine

    entries = [e for e in load_manifest(args.data) if e.kind in args.kinds]
    if args.limit:
        entries = [e for k in args.kinds for e in [x for x in entries if x.kind == k][: args.limit]]
    # Kinds interleaved (a receipt, a page, a receipt, ...), so a cut-short run has each kind.
    by_kind = [[e for e in entries if e.kind == k] for k in args.kinds]
    entries = [e for group in itertools.zip_longest(*by_kind) for e in group if e is not None]
    engines = {}
    for name in args.models:
        engine = RapidEngine(models=name, intra_op_threads=1)
        engine.load()
        engines[name] = engine
    # cpu[set][image] = list of CPU-s over rounds; wall alike; text from the first round.
    cpu: dict[str, dict[str, list[float]]] = {m: {} for m in args.models}
    wall: dict[str, dict[str, list[float]]] = {m: {} for m in args.models}
    texts: dict[str, dict[str, str]] = {m: {} for m in args.models}
    load_before = os.getloadavg()[0]
    for round_no in range(args.rounds):
        for k, entry in enumerate(entries):
            # Which set goes first alternates image by image and round by round.
            order = args.models if (round_no + k) % 2 == 0 else list(reversed(args.models))
            image = load_image(entry.image_path)
            item = PreparedImage(entry.name, image, image.size)
            for name in order:
                c0, w0 = time.process_time(), time.perf_counter()
                (out,) = engines[name].run([item])
                c1, w1 = time.process_time(), time.perf_counter()
                cpu[name].setdefault(entry.name, []).append(c1 - c0)
                wall[name].setdefault(entry.name, []).append(w1 - w0)
                texts[name].setdefault(entry.name, out.text if isinstance(out, OcrResult) else "")
            print(
                f"round {round_no + 1}/{args.rounds}: {k + 1}/{len(entries)} images",
                file=sys.stderr,
                flush=True,
            )
            done = entries if round_no else entries[: k + 1]
            save(summarise(args, done, cpu, wall, texts, engines, load_before))
    return summarise(args, entries, cpu, wall, texts, engines, load_before)


def summarise(
    args: argparse.Namespace,
    entries: list,
    cpu: dict[str, dict[str, list[float]]],
    wall: dict[str, dict[str, list[float]]],
    texts: dict[str, dict[str, str]],
    engines: dict,
    load_before: float,
) -> dict:
    """Per kind: CPU-s per image for each set and their ratios, over `entries`."""
    base, other = args.models[0], args.models[1:]
    kinds = {}
    for kind in sorted({e.kind for e in entries}, key=KIND_ORDER.index):
        names = [e.name for e in entries if e.kind == kind]
        per_set = {
            m: {
                "cpu_s_per_image": round(mean(mean(cpu[m][n]) for n in names), 3),
                "wall_s_per_image": round(mean(mean(wall[m][n]) for n in names), 3),
            }
            for m in args.models
        }
        ratios = {}
        for m in other:
            each = [mean(cpu[m][n]) / mean(cpu[base][n]) for n in names if mean(cpu[base][n]) > 0]
            ratios[m] = {
                "of_means": round(
                    per_set[m]["cpu_s_per_image"] / per_set[base]["cpu_s_per_image"], 3
                ),
                "median": round(median(each), 3),
                "min": round(min(each), 3),
                "max": round(max(each), 3),
            }
        kinds[kind] = {"images": len(names), "sets": per_set, "ratio_to_" + base: ratios}
    receipts = [e.name for e in entries if e.kind == "sroie"]
    cjk = {
        m: {
            "receipts_with_cjk": sum(1 for n in receipts if CJK.search(texts[m][n])),
            "chars": "".join(sorted({c for n in receipts for c in CJK.findall(texts[m][n])})),
        }
        for m in args.models
    }
    return {
        "images_done": len(entries),
        "kinds": kinds,
        "cjk_in_receipts": cjk,
        "engines": {m: e.describe() for m, e in engines.items()},
        "loadavg_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "texts": texts,
    }


def markdown(report: dict) -> str:
    base, other = report["models"][0], report["models"][1:]
    out = [
        "# CPU per image of engine rapid's model sets, paired in one run",
        "",
        f"Reproduce: `{report['command']}`",
        "",
        f"Hardware: {hardware_line(report['hardware'])}.",
        f"Images measured: {report['images_done']} (kinds interleaved; figures written after "
        "each image).",
        f"Rounds: {report['rounds']} (which set goes first alternates by image and round); one "
        "onnxruntime thread per engine; each image read alone; CPU = process CPU time across "
        "`engine.run([image])`. "
        f"1-minute load average {report['loadavg_1min']['before']} before and "
        f"{report['loadavg_1min']['after']} after.",
        "",
        "| kind | images | "
        + " | ".join(f"{m} CPU-s / image" for m in report["models"])
        + " | "
        + " | ".join(f"{m} / {base} (of means; per image median, range)" for m in other)
        + " |",
        "|---|---|" + "---|" * (len(report["models"]) + len(other)),
    ]
    for kind, k in report["kinds"].items():
        cells = [str(k["sets"][m]["cpu_s_per_image"]) for m in report["models"]]
        for m in other:
            r = k["ratio_to_" + base][m]
            cells.append(f"{r['of_means']} ({r['median']}; {r['min']}-{r['max']})")
        out.append(f"| {KIND_NAMES.get(kind, kind)} | {k['images']} | " + " | ".join(cells) + " |")
    receipts = report["kinds"].get("sroie", {}).get("images", 0)
    out += ["", f"Receipts whose text holds CJK characters or punctuation (of {receipts}):", ""]
    for m, c in report["cjk_in_receipts"].items():
        out.append(f"- {m}: {c['receipts_with_cjk']} ({c['chars'] or 'none'})")
    out.append("")
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "ocr-eval")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rapid_models")
    ap.add_argument("--models", nargs="+", default=["v4", "v6-small"], help="first: the base")
    ap.add_argument("--kinds", nargs="+", default=["sroie", "page", "svt_scene"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--limit", type=int, help="the first N images of each kind (a busy host)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    head = {
        "command": "python bench/rapid_models.py "
        + shlex.join(list(argv) if argv is not None else sys.argv[1:]),
        "hardware": hardware(),
        "models": args.models,
        "rounds": args.rounds,
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save(figures: dict) -> None:
        report = {**head, **figures}
        (args.out / "rapid_models_cpu.json").write_text(
            json.dumps(report, indent=2, ensure_ascii=False) + "\n"
        )
        (args.out / "rapid_models_cpu.md").write_text(markdown(report))

    save(measure(args, save))
    print((args.out / "rapid_models_cpu.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
