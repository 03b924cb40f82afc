"""Images/s of the CPU engine (`rapid`) by batch size, on real receipts: does a big static batch
buy anything?

    python bench/rapid_batch_size.py --data ../shared/data/ocr-eval

Why: the batcher's cap for the CPU engine was `Engine.preferred_max_batch()` = 32, and a batch's
results reach the store only when the whole batch ends, so a run of 19 receipts showed no
progress for 125 s, then everything at once (issue 52). A smaller cap gives results in steps; it
is only right if small batches are as fast.

How: the engine as the worker builds it (`create_engine("rapid", Settings())`), loaded once; the
receipts (SROIE) decoded once; one warm-up pass; then ROUNDS rounds, each running every receipt
through `engine.run` in batches of each size, the sizes in forward order on even rounds and
reversed on odd ones (ABBA), so a change in the host's load falls on every size alike. For each
pass: wall seconds (perf_counter) and this process's CPU seconds (`time.process_time`, all
threads), and the seconds to the first batch's results (what a progress bar waits for). The host
may be shared: CPU-s per image is the figure that load does not inflate; wall is reported beside
it. Writes rapid_batch_size_cpu.json and .md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.eval_accuracy import hardware, hardware_line, load_image  # noqa: E402
from bench.scoring import load_manifest  # noqa: E402
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import Engine, PreparedImage  # noqa: E402
from ocrq.models.registry import create_engine  # noqa: E402


def one_pass(engine: Engine, items: list[PreparedImage], size: int) -> dict[str, float]:
    """Every item through `engine.run` in batches of `size`: wall, CPU and first-result seconds."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    first = None
    for start in range(0, len(items), size):
        results = engine.run(items[start : start + size])
        bad = [r for r in results if isinstance(r, Exception)]
        if bad:
            raise RuntimeError(f"batch of {size} failed: {bad[0]!r}")
        if first is None:
            first = time.perf_counter() - wall0
    return {
        "wall_s": time.perf_counter() - wall0,
        "cpu_s": time.process_time() - cpu0,
        "first_s": first or 0.0,
    }


def summarise(passes: list[dict[str, float]], images: int) -> dict[str, float]:
    cpu = [p["cpu_s"] / images for p in passes]
    wall = [p["wall_s"] / images for p in passes]
    return {
        "passes": len(passes),
        "cpu_s_per_image": statistics.mean(cpu),
        "cpu_s_per_image_min": min(cpu),
        "cpu_s_per_image_max": max(cpu),
        "wall_s_per_image": statistics.mean(wall),
        "wall_s_per_image_min": min(wall),
        "wall_s_per_image_max": max(wall),
        "images_per_cpu_s": 1 / statistics.mean(cpu),
        "images_per_wall_s": 1 / statistics.mean(wall),
        "first_result_s": statistics.mean(p["first_s"] for p in passes),
    }


def markdown(report: dict) -> str:
    lines = [
        "# rapid: images/s by batch size (SROIE receipts)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {report['hardware_line']}. Load: {report['load_note']}",
        "",
        f"{report['images']} receipts, {report['rounds']} rounds, sizes interleaved "
        "(forward, then reversed); one warm-up pass first. CPU-s: `time.process_time` of the "
        "process (all threads); wall: perf_counter.",
        "",
        "| batch | CPU-s/image (min-max) | images/CPU-s | wall-s/image (min-max) | images/s wall "
        "| first results after (s) |",
        "|---:|---|---:|---|---:|---:|",
    ]
    for size, s in report["sizes"].items():
        lines.append(
            f"| {size} | {s['cpu_s_per_image']:.3f} ({s['cpu_s_per_image_min']:.3f}-"
            f"{s['cpu_s_per_image_max']:.3f}) | {s['images_per_cpu_s']:.3f} | "
            f"{s['wall_s_per_image']:.3f} ({s['wall_s_per_image_min']:.3f}-"
            f"{s['wall_s_per_image_max']:.3f}) | {s['images_per_wall_s']:.3f} | "
            f"{s['first_result_s']:.1f} |"
        )
    lines += ["", f"Smallest size within {report['within'] * 100:.0f}% of the best CPU-s/image: "
              f"**{report['smallest_within']}**", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="the ocr-eval folder (manifest.tsv)")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/rapid_batch_size")
    ap.add_argument("--images", type=int, default=12, help="receipts to use (SROIE has 20)")
    ap.add_argument("--sizes", default="1,2,4,12")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--within", type=float, default=0.05)
    ap.add_argument("--load-note", default="not stated")
    args = ap.parse_args(argv)

    entries = [e for e in load_manifest(args.data) if e.dataset == "sroie"][: args.images]
    items = []
    for e in entries:
        im = load_image(e.image_path)
        items.append(PreparedImage(key=e.image_path.name, image=im, original_size=im.size))
    sizes = [int(s) for s in args.sizes.split(",")]
    engine = create_engine("rapid", Settings())
    engine.load()
    one_pass(engine, items[:2], 2)  # warm-up: sessions' first calls
    passes: dict[int, list[dict[str, float]]] = {s: [] for s in sizes}
    for r in range(args.rounds):
        for size in sizes if r % 2 == 0 else list(reversed(sizes)):
            p = one_pass(engine, items, size)
            passes[size].append(p)
            print(f"round {r} size {size}: {p}", flush=True)
    summary = {str(s): summarise(passes[s], len(items)) for s in sizes}
    best = min(v["cpu_s_per_image"] for v in summary.values())
    smallest = min(
        s for s in sizes if summary[str(s)]["cpu_s_per_image"] <= best * (1 + args.within)
    )
    hw = hardware()
    report = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "hardware": hw,
        "hardware_line": hardware_line(hw),
        "load_note": args.load_note,
        "images": len(items),
        "rounds": args.rounds,
        "within": args.within,
        "smallest_within": smallest,
        "sizes": summary,
        "passes": {str(s): v for s, v in passes.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rapid_batch_size_cpu.json").write_text(json.dumps(report, indent=2))
    (args.out / "rapid_batch_size_cpu.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
