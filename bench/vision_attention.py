"""The vision tower of one prefill pass under each way of grouping its attention calls.

Why: a prefill pass of the service's mix holds a score of scene photos of different sizes. With
one SDPA call per image and layer (transformers' way), or per run of equal-sized images (ocrq's
earlier patch), it launched hundreds of small calls and the GPU waited for the host. This bench
runs the same images through the vision tower (`get_image_features`, as the prefill calls it)
under each mode, in one process on one GPU, and reports the GPU time (CUDA events) against the
wall time (host launch included): where the wall exceeds the GPU time, the host sets the pace.
It also checks each mode's features against the library's loop, and measures one A4 page alone
under SDPA and under the varlen kernel, the facts behind `PACK_BELOW`.

    python bench/vision_attention.py --out OUT --data .evaldata
    python bench/vision_attention.py --out /tmp/va --shape tiny --device cpu  # smoke
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import random
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
from ocrq.models.hunyuan import HunyuanEngine, vision  # noqa: E402
from ocrq.models.hunyuan.patches import batch_vision_attention  # noqa: E402

MODES = ("library", "per_size", "varlen", "varlen_all")


def scene_images(data: Path | None, count: int, seed: int) -> list[Any]:
    """Scene photos of the evaluation set (street signs, many sizes), or noise images of
    scene-like sizes without it."""
    from PIL import Image

    rng = random.Random(seed)
    if data is not None and (data / "manifest.tsv").exists():
        with (data / "manifest.tsv").open() as f:
            rows = [r for r in csv.DictReader(f, delimiter="\t") if r["dataset"] == "svt"]
        picked = [rows[rng.randrange(len(rows))] for _ in range(count)]
        return [Image.open(data / r["image_path"]).convert("RGB") for r in picked]
    return [page_image(rng.randrange(200, 900), rng.randrange(150, 700)) for _ in range(count)]


def set_mode(engine: HunyuanEngine, mode: str) -> None:
    """Install one grouping on the loaded model (see MODES)."""
    vision.plan_groups = functools.partial(  # type: ignore[assignment]
        PLAN, pack_below=10**9 if mode == "varlen_all" else vision.PACK_BELOW
    )
    if mode == "library":
        batch_vision_attention(engine.model, enabled=False)
    else:
        batch_vision_attention(engine.model, varlen=None if mode.startswith("varlen") else False)


PLAN = vision.plan_groups


def measure(torch: Any, engine: HunyuanEngine, rows: list[Any], reps: int, cuda: bool
            ) -> tuple[float, float, Any]:
    """(median GPU ms, median wall ms, features) of the vision tower over `rows` as one pass."""
    inner = engine.model.model
    dtype = next(inner.vision_tower.parameters()).dtype
    device = engine.model.device
    pixels = torch.cat([r.pixel_values for r in rows]).to(device, dtype)
    grid = torch.cat([r.image_grid_thw for r in rows])  # on the CPU, as the fast path keeps it

    def run() -> Any:
        out = inner.get_image_features(pixels, grid, return_dict=True).pooler_output
        return torch.cat(list(out)) if isinstance(out, (list, tuple)) else out

    gpu, wall = [], []
    with torch.inference_mode():
        for i in range(reps + 2):
            if cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t = time.perf_counter()
            feats = run()
            if cuda:
                b.record()
                torch.cuda.synchronize()
            w = (time.perf_counter() - t) * 1000
            if i >= 2:
                wall.append(w)
                gpu.append(a.elapsed_time(b) if cuda else w)
    gpu.sort()
    wall.sort()
    return gpu[len(gpu) // 2], wall[len(wall) // 2], feats.float()


def markdown(d: dict[str, Any]) -> str:
    m = d["meta"]
    lines = [
        f"# The vision tower of one prefill pass, by attention grouping ({m['gpu']})", "",
        f"torch {m['torch']}, transformers {m['transformers']}, {m['dtype']}, random weights of "
        f"the {m['shape']} shape. Command: `{m['command']}`.", "",
        "Modes: `library` = transformers' loop, one SDPA call per image and layer; `per_size` = "
        "one SDPA call per run of equal-sized images; `varlen` = the default (short images of "
        "different sizes share one flash varlen call, images of at least "
        f"{vision.PACK_BELOW} patches keep SDPA); `varlen_all` = every image in the varlen call.",
        "",
        "| pass | images | patches | mode | GPU ms | wall ms | wall / GPU "
        "| max abs diff vs library |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in d["results"]:
        lines.append(
            f"| {r['set']} | {r['images']} | {r['patches']} | {r['mode']} | {r['gpu_ms']:.2f} | "
            f"{r['wall_ms']:.2f} | {r['wall_ms'] / max(r['gpu_ms'], 1e-9):.2f} | "
            f"{r['max_diff']:.3g} |"
        )
    if d["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in d["errors"]]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="vision_attention_h200")
    ap.add_argument("--data", type=Path, default=None, help="ocr-eval directory (scene photos)")
    ap.add_argument("--version", default="1.5")
    ap.add_argument("--reps", type=int, default=10)
    add_model_args(ap)
    args = ap.parse_args()

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    d: dict[str, Any] = {"meta": run_meta(args, "bench/vision_attention.py"), "results": [],
                         "errors": []}
    d["meta"]["shape"] = f"HunyuanOCR-{args.version}" if args.shape == "full" else "tiny"

    def write() -> None:
        (args.out / f"{args.stem}.json").write_text(json.dumps(d, indent=1, default=str))
        (args.out / f"{args.stem}.md").write_text(markdown(d))

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = random_checkpoint(Path(tmp), args, args.version)
        settings = Settings(model=str(ckpt), model_subfolder=None, dtype=args.dtype,
                            device=args.device, max_new_tokens=2)
        engine = HunyuanEngine(settings, decode="fast")
        engine.load()

        def rows_of(images: list[Any], tag: str) -> list[Any]:
            return [engine.preprocess(PreparedImage(f"{tag}{i}", im, im.size))
                    for i, im in enumerate(images)]

        scenes = rows_of(scene_images(args.data, 24, 7), "scene")
        a4 = rows_of([page_image(1248, 1760)], "a4")
        equal = rows_of([page_image(512, 512)] * 16, "sq")
        sets = {
            "24 scene photos": scenes,
            "8 scene photos": scenes[:8],
            "1 A4 page + 12 scene photos": a4 + scenes[:12],
            "16 equal 512x512 images": equal,
            "1 A4 page": a4,
        }
        for name, rows in sets.items():
            patches = sum(int(r.image_grid_thw.prod()) for r in rows)
            reference = None
            for mode in MODES:
                try:
                    set_mode(engine, mode)
                    gpu, wall, feats = measure(torch, engine, rows, args.reps, cuda)
                    if reference is None:
                        reference = feats
                    diff = float((feats - reference).abs().max())
                    d["results"].append({"set": name, "images": len(rows), "patches": patches,
                                         "mode": mode, "gpu_ms": gpu, "wall_ms": wall,
                                         "max_diff": diff})
                    print(f"{name} {mode}: GPU {gpu:.2f} ms wall {wall:.2f} ms diff {diff:.3g}",
                          flush=True)
                except Exception as exc:
                    d["errors"].append(f"{name} {mode}: {exc!r}"[:400])
                write()
        set_mode(engine, "varlen")
    write()
    print(markdown(d), flush=True)


if __name__ == "__main__":
    main()
