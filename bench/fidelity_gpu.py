"""HunyuanOCR's image-token numerics on a GPU: the training code's layout (default) against
transformers', in one run (issue 26; ocrq/models/hunyuan/fidelity.py).

Three parts, each written to --out as soon as it exists:
(1) the ViT position-table resampling: ocrq's written-out bilinear against the training code's
    own call (`interpolate(scale_factor=(h + 0.1) / 128, ...)`) on this GPU, on grids with one
    side, both sides or neither equal to the table's 128;
(2) per mode, the fast loop against transformers' generate() on distinct images (token ids and
    per-step logits, bf16), and how far the two modes' logits are apart;
(3) per mode, the fast path's prefill and end-to-end seconds on a batch of pages, the two modes
    alternated --reps times, so a speed change would show as a ratio off 1.

Random weights of the full HunyuanOCR-1.5 shape (ocrq/testing/tiny_hunyuan.py).

    PYTHONUNBUFFERED=1 python bench/fidelity_gpu.py --out bench/results/fidelity_gpu
    python bench/fidelity_gpu.py --shape tiny --device cpu --dtype float32 --new-tokens 4 \\
        --batch 2 --reps 1 --out /tmp/fg   # smoke test without a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_model_args, page_image, random_checkpoint, run_meta  # noqa: E402
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.hunyuan import HunyuanEngine  # noqa: E402
from ocrq.models.hunyuan.fidelity import interpolate_positions  # noqa: E402

MODES = ("trained", "transformers")
# Distinct images for the path check: sizes whose patch grids differ, so the position table is
# resampled differently for each.
CHECK_SIZES = ((640, 480), (512, 896), (1024, 1024), (300, 1200), (1248, 1760), (800, 200))


def resampling(device: str) -> dict[str, Any]:
    """ocrq's written-out bilinear against the training code's F.interpolate(scale_factor)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    table = torch.randn(1, 64, 128, 128, generator=gen).to(device)
    rows = []
    for h, w in ((128, 128), (128, 40), (40, 128), (57, 93), (200, 24), (129, 127)):
        ours = interpolate_positions(table, h, w, "trained", "bilinear")
        theirs = F.interpolate(table, scale_factor=((h + 0.1) / 128, (w + 0.1) / 128),
                               mode="bilinear", align_corners=False)
        library = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=False)
        rows.append({
            "grid": [h, w],
            "ours_vs_training_call": float((ours - theirs).abs().max()),
            "training_vs_transformers": float((theirs - library).abs().max()),
        })
    return {"device": device, "grids": rows}


def engine_for(ckpt: Path, args: argparse.Namespace, mode: str) -> HunyuanEngine:
    settings = Settings(model=str(ckpt), model_subfolder=None, dtype=args.dtype,
                        device=args.device, max_new_tokens=args.new_tokens,
                        hunyuan_rope=mode, hunyuan_vit_positions=mode)
    engine = HunyuanEngine(settings, decode="fast")
    engine.load()
    return engine


def items(sizes: Any, prefix: str) -> list[PreparedImage]:
    out = []
    for i, (w, h) in enumerate(sizes):
        image = page_image(w, h)
        out.append(PreparedImage(f"{prefix}{i}", image, image.size, task="text"))
    return out


def max_diff(a: Any, b: Any) -> float:
    n = min(a.logits.shape[0], b.logits.shape[0])
    return float((a.logits[:n].float() - b.logits[:n].float()).abs().max())


def path_check(engines: dict[str, HunyuanEngine], args: argparse.Namespace) -> dict[str, Any]:
    """Per mode: fast vs generate() one image at a time (no padding), and the modes apart."""
    out: dict[str, Any] = {}
    fast_rows: dict[str, list[Any]] = {}
    for mode, engine in engines.items():
        rows = []
        fast_rows[mode] = []
        for it in items(CHECK_SIZES, "check"):
            engine.prepare(it)
            plain = engine.generate([it], output_logits=True, decode="generate",
                                    max_new_tokens=args.check_tokens).items[0]
            fast = engine.generate([it], output_logits=True, decode="fast",
                                   max_new_tokens=args.check_tokens).items[0]
            fast_rows[mode].append(fast)
            same = [a == b for a, b in zip(plain.token_ids, fast.token_ids, strict=False)]
            first_diff = same.index(False) if False in same else None
            rows.append({
                "image": list(it.size),
                "tokens_equal": plain.token_ids == fast.token_ids,
                "first_differing_token": first_diff,
                "tokens": len(plain.token_ids),
                "step0_logits_max_diff": float(
                    (plain.logits[0].float() - fast.logits[0].float()).abs().max()),
                "logits_max_diff_until_first_difference": max_diff(plain, fast)
                if first_diff is None else None,
            })
        out[mode] = rows
    out["modes_apart_step0"] = [
        float((a.logits[0].float() - b.logits[0].float()).abs().max())
        for a, b in zip(fast_rows["trained"], fast_rows["transformers"], strict=True)
    ]
    return out


def speed(engines: dict[str, HunyuanEngine], args: argparse.Namespace) -> dict[str, Any]:
    """The fast path on one batch of A4-like pages, forced length, modes alternated."""
    import torch

    batch = items([(1248, 1760)] * args.batch, "a4-")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    prefill: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(args.reps + 1):  # the first round warms both up and is not counted
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            engine = engines[mode]
            for it in batch:
                engine.prepare(it)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.generate(batch, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                            decode="fast")
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            if rep:
                times[mode].append(time.perf_counter() - t0)
                stats = engine.last_decode
                prefill[mode].append(float(getattr(stats, "prefill_s", 0.0) or 0.0))
    med = {m: statistics.median(v) for m, v in times.items()}
    return {
        "batch": args.batch, "new_tokens": args.new_tokens, "reps": args.reps,
        "seconds": times, "prefill_s": prefill,
        "median_s": med,
        "pages_per_s": {m: args.batch / s for m, s in med.items()},
        "trained_over_transformers_time": med["trained"] / med["transformers"],
    }


def write(out: Path, stem: str, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    meta = report["meta"]
    lines = [f"# HunyuanOCR numerics: trained vs transformers ({meta['gpu']})", "",
             f"Command: `{meta['command']}`; torch {meta['torch']}, transformers "
             f"{meta['transformers']}, {meta['dtype']}, random HunyuanOCR-1.5 weights.", ""]
    if "resampling" in report:
        lines += ["## ViT position table: ocrq's bilinear vs the training code's call", "",
                  "| grid | ocrq vs training call | training vs transformers |", "|---|---|---|"]
        lines += [f"| {r['grid'][0]}x{r['grid'][1]} | {r['ours_vs_training_call']:.2e} | "
                  f"{r['training_vs_transformers']:.3f} |" for r in report["resampling"]["grids"]]
        lines.append("")
    if "paths" in report:
        lines += ["## Fast loop vs generate(), one image at a time", "",
                  "| mode | image | tokens equal | first differing token | step-0 logits diff |",
                  "|---|---|---|---|---|"]
        for mode in MODES:
            for r in report["paths"][mode]:
                lines.append(f"| {mode} | {r['image'][0]}x{r['image'][1]} | {r['tokens_equal']} "
                             f"| {r['first_differing_token']} | {r['step0_logits_max_diff']:.3f} |")
        apart = report["paths"]["modes_apart_step0"]
        lines += ["", f"Step-0 logits, trained vs transformers mode (same image): max diff "
                  f"{min(apart):.2f}-{max(apart):.2f}.", ""]
    if "speed" in report:
        s = report["speed"]
        lines += [f"## Speed: {s['batch']} A4 pages, {s['new_tokens']} forced tokens, "
                  f"{s['reps']} alternated reps", "", "| mode | median s | pages/s |",
                  "|---|---|---|"]
        lines += [f"| {m} | {s['median_s'][m]:.3f} | {s['pages_per_s'][m]:.2f} |" for m in MODES]
        lines += ["", f"trained / transformers time: {s['trained_over_transformers_time']:.3f}", ""]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="fidelity_h200")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    report: dict[str, Any] = {"meta": run_meta(args, "bench/fidelity_gpu.py")}
    report["meta"]["shape"] = "HunyuanOCR-1.5" if args.shape == "full" else "tiny"
    report["resampling"] = resampling(args.device)
    write(args.out, args.stem, report)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = random_checkpoint(Path(tmp), args, "1.5")
        engines = {mode: engine_for(ckpt, args, mode) for mode in MODES}
        report["paths"] = path_check(engines, args)
        write(args.out, args.stem, report)
        report["speed"] = speed(engines, args)
        write(args.out, args.stem, report)
    print(json.dumps(report["speed"], indent=2))


if __name__ == "__main__":
    main()
