"""The vision tower's attention on FlashAttention-4 against today's SDPA path, in one process.

Why: 83% of an A4 page's prefill is the vision tower (issue 29), whose attention runs on cuDNN
through SDPA, one call per run of equal-sized images. `Settings.vision_attention=fa4` runs it as
one FlashAttention-4 varlen call per layer over every image of the pass
(ocrq/models/hunyuan/vision_attention.py). This bench, on one loaded random-weight model whose
vision layers it switches between the two:

* checks that they agree: the vision tower's features of several distinct images (alone and
  packed in one pass) and the prefill's last-position logits, FA4 vs SDPA, beside the spread
  between two accepted bf16 kernels (SDPA's cuDNN/flash choice vs its math backend);
* times the vision tower per pass (CUDA events, modes alternated rep by rep, medians): one A4
  page, a pass of mixed images, scene photos, equal squares; one static prefill of mixed images;
  and the attention kernel alone on the A4 shape, in TFLOP/s.

    PYTHONUNBUFFERED=1 python bench/vision_fa4.py --out OUT
    python bench/vision_fa4.py --out /tmp/vf --shape tiny --device cpu --kernel reference  # smoke

`--kernel reference` puts the torch reference (`reference_varlen`) in the kernel's place, so the
packing around it runs where FlashAttention-4 does not (the smoke test on a CPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_model_args, page_image, random_checkpoint, run_meta  # noqa: E402
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.hunyuan import HunyuanEngine  # noqa: E402
from ocrq.models.hunyuan.patches import batch_vision_attention  # noqa: E402
from ocrq.models.hunyuan.vision_attention import (  # noqa: E402
    choose,
    fa4_kernel,
    fa4_unusable,
    reference_varlen,
)

# Distinct images for the agreement checks (width, height): an A4 page, a square page, a receipt,
# a wide frame, small odd sizes.
CHECK_SIZES = [(1248, 1760), (1024, 1024), (886, 1699), (1920, 1080), (800, 600), (333, 517)]
MODES = ("sdpa", "fa4")


def scene_sizes(count: int, seed: int) -> list[tuple[int, int]]:
    """Scene-photo-like sizes (street signs in the service's mix are 200-900 px a side)."""
    rng = random.Random(seed)
    return [(rng.randrange(200, 900), rng.randrange(150, 700)) for _ in range(count)]


def rel(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| in float32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(a: Any, b: Any) -> dict[str, float]:
    return {"max_abs": float((a.float() - b.float()).abs().max()), "rel_l2": rel(a, b)}


class Bench:
    def __init__(self, args: argparse.Namespace, engine: HunyuanEngine, kernel: Any) -> None:
        import torch

        self.torch, self.args, self.engine, self.kernel = torch, args, engine, kernel
        self.cuda = args.device.startswith("cuda")
        self.inner = engine.model.model
        self.dtype = next(self.inner.vision_tower.parameters()).dtype

    def mode(self, name: str) -> None:
        batch_vision_attention(self.engine.model, kernel=self.kernel if name == "fa4" else None)

    def rows(self, sizes: list[tuple[int, int]], tag: str) -> list[Any]:
        out = []
        for i, (w, h) in enumerate(sizes):
            im = page_image(w, h)
            out.append(self.engine.preprocess(PreparedImage(f"{tag}{i}", im, im.size)))
        return out

    def items(self, sizes: list[tuple[int, int]], tag: str) -> list[PreparedImage]:
        out = []
        for i, (w, h) in enumerate(sizes):
            im = page_image(w, h)
            it = PreparedImage(f"{tag}{i}", im, im.size, task="text")
            self.engine.prepare(it)
            out.append(it)
        return out

    def tower(self, rows: list[Any]) -> Any:
        """The vision tower over `rows` as one pass (grid on the host, as the engine keeps it)."""
        torch = self.torch
        pixels = torch.cat([r.pixel_values for r in rows]).to(self.engine.model.device, self.dtype)
        grid = torch.cat([r.image_grid_thw for r in rows])

        def run() -> Any:
            out = self.inner.get_image_features(pixels, grid, return_dict=True).pooler_output
            return torch.cat(list(out)) if isinstance(out, (list, tuple)) else out

        return run

    def time_once(self, fn: Any) -> tuple[float, float]:
        """(GPU ms by CUDA events, wall ms) of one fn()."""
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t = time.perf_counter()
        fn()
        if self.cuda:
            b.record()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1000
        return (a.elapsed_time(b) if self.cuda else wall), wall

    def alternated(self, fns: dict[str, Any], reps: int) -> dict[str, Any]:
        """Medians of each mode's fn, modes alternated rep by rep after two warm-up rounds."""
        gpu: dict[str, list[float]] = {m: [] for m in fns}
        wall: dict[str, list[float]] = {m: [] for m in fns}
        with self.torch.inference_mode():
            for rep in range(reps + 2):
                for m in (MODES if rep % 2 == 0 else MODES[::-1]):
                    self.mode(m)
                    g, w = self.time_once(fns[m])
                    if rep >= 2:
                        gpu[m].append(g)
                        wall[m].append(w)
        med = {m: statistics.median(gpu[m]) for m in fns}
        return {
            "gpu_ms": med,
            "wall_ms": {m: statistics.median(wall[m]) for m in fns},
            "gpu_ms_all": gpu,
            "sdpa_over_fa4": med["sdpa"] / med["fa4"],
        }

    # -- agreement -----------------------------------------------------------------------------

    def agree_tower(self) -> list[dict[str, Any]]:
        torch = self.torch
        out = []
        rows = self.rows(CHECK_SIZES, "check")
        cases = [([r], f"{w}x{h} alone") for r, (w, h) in zip(rows, CHECK_SIZES, strict=True)]
        cases.append((rows, f"all {len(rows)} in one pass"))
        with torch.inference_mode():
            for case_rows, name in cases:
                run = self.tower(case_rows)
                feats = {}
                for m in MODES:
                    self.mode(m)
                    feats[m] = run().float()
                entry: dict[str, Any] = {
                    "case": name,
                    "patches": sum(int(r.image_grid_thw.prod()) for r in case_rows),
                    "fa4_vs_sdpa": compare(feats["fa4"], feats["sdpa"]),
                    "finite": bool(torch.isfinite(feats["fa4"]).all()),
                }
                if self.cuda:
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    self.mode("sdpa")
                    with sdpa_kernel(SDPBackend.MATH):
                        math = run().float()
                    entry["sdpa_math_vs_sdpa"] = compare(math, feats["sdpa"])
                    entry["fa4_vs_sdpa_math"] = compare(feats["fa4"], math)
                out.append(entry)
                print(f"tower {name}: {entry}", flush=True)
        return out

    def agree_logits(self) -> list[dict[str, Any]]:
        out = []
        its = self.items(CHECK_SIZES, "logit")
        cases = [([it], f"{w}x{h} alone") for it, (w, h) in zip(its, CHECK_SIZES, strict=True)]
        cases.append((its, f"all {len(its)} in one static batch"))
        for batch, name in cases:
            logits: dict[str, list[Any]] = {}
            for m in MODES:
                self.mode(m)
                res = self.engine.generate(batch, output_logits=True, decode="fast",
                                           max_new_tokens=1)
                logits[m] = [r.logits[0].float() for r in res.items]
            for i, (a, b) in enumerate(zip(logits["fa4"], logits["sdpa"], strict=True)):
                entry = {
                    "case": name, "row": i, **compare(a, b),
                    "argmax_equal": int(a.argmax()) == int(b.argmax()),
                    "top5_equal": a.topk(5).indices.tolist() == b.topk(5).indices.tolist(),
                    "logit_std": float(b.std()),
                }
                out.append(entry)
                print(f"logits {name} row {i}: {entry}", flush=True)
        return out

    # -- speed ---------------------------------------------------------------------------------

    def speed_tower(self) -> list[dict[str, Any]]:
        scenes = scene_sizes(24, 7)
        sets = {
            "1 A4 page": [(1248, 1760)],
            "1 A4 page + 12 scene photos": [(1248, 1760), *scenes[:12]],
            "4 A4 pages": [(1248, 1760)] * 4,
            "24 scene photos": scenes,
            "16 equal 512x512 images": [(512, 512)] * 16,
        }
        out = []
        for name, sizes in sets.items():
            rows = self.rows(sizes, "speed")
            run = self.tower(rows)
            r = self.alternated({m: run for m in MODES}, self.args.reps)
            r.update({"set": name, "images": len(rows),
                      "patches": sum(int(x.image_grid_thw.prod()) for x in rows)})
            out.append(r)
            print(f"tower {name}: {r['gpu_ms']} ratio {r['sdpa_over_fa4']:.3f}", flush=True)
        return out

    def speed_prefill(self) -> list[dict[str, Any]]:
        """One static prefill (generate, one new token) of a mixed batch, modes alternated."""
        scenes = scene_sizes(24, 11)
        sets = {"1 A4 page": [(1248, 1760)],
                "1 A4 page + 12 scene photos": [(1248, 1760), *scenes[:12]]}
        out = []
        for name, sizes in sets.items():
            its = self.items(sizes, "prefill")

            def run(its: list[PreparedImage] = its) -> None:
                self.engine.generate(its, decode="fast", max_new_tokens=1, min_new_tokens=1)

            r = self.alternated({m: run for m in MODES}, max(3, self.args.reps // 3))
            r.update({"set": name, "images": len(its)})
            out.append(r)
            print(f"prefill {name}: {r['gpu_ms']} ratio {r['sdpa_over_fa4']:.3f}", flush=True)
        return out

    def speed_kernel(self) -> list[dict[str, Any]]:
        """The attention alone, 16 heads x 72, bidirectional: today's SDPA call vs the varlen
        kernel, on one A4 page's patches and on 24 scene photos packed."""
        import torch
        import torch.nn.functional as F

        attn = self.inner.vision_tower.layers[0].self_attn
        heads, dim, scale = attn.num_heads, attn.head_dim, attn.scaling
        dev = self.engine.model.device
        out = []
        for name, lengths in {"1 A4 page": [8580],
                              "24 scene photos": [int(w * h / 256) for w, h in
                                                  scene_sizes(24, 7)]}.items():
            total = sum(lengths)
            q, k, v = (torch.randn(total, heads, dim, device=dev, dtype=self.dtype)
                       for _ in range(3))
            edges = [0]
            for n in lengths:
                edges.append(edges[-1] + n)
            cu = torch.tensor(edges, dtype=torch.int32, device=dev)

            def sdpa(q: Any = q, k: Any = k, v: Any = v, edges: list[int] = edges) -> None:
                for lo, hi in itertools.pairwise(edges):
                    F.scaled_dot_product_attention(
                        *(t[lo:hi].transpose(0, 1)[None] for t in (q, k, v)), scale=scale)

            def fa4(q: Any = q, k: Any = k, v: Any = v, cu: Any = cu,
                    lengths: list[int] = lengths) -> None:
                self.kernel(q, k, v, cu, max(lengths), scale)

            r = self.alternated({"sdpa": sdpa, "fa4": fa4}, self.args.reps)
            flops = sum(4 * n * n * heads * dim for n in lengths)
            r.update({"set": name, "tokens": total, "sequences": len(lengths),
                      "tflops": {m: flops / (ms * 1e9) for m, ms in r["gpu_ms"].items()}})
            out.append(r)
            print(f"kernel {name}: {r['gpu_ms']} {r['tflops']}", flush=True)
        return out


def markdown(d: dict[str, Any]) -> str:
    m = d["meta"]
    lines = [
        f"# Vision attention: FlashAttention-4 vs SDPA ({m['gpu']})", "",
        f"torch {m['torch']}, transformers {m['transformers']}, flash-attn-4 {m.get('fa4')}, "
        f"{m['dtype']}, random weights of the {m['shape']} shape. Command: `{m['command']}`. "
        f"First FA4 call (JIT compile included): {m.get('first_call_s', 0):.1f} s. "
        f"`vision_attention=auto` chooses here: {m.get('auto_chooses')}.", "",
        "## Agreement: vision tower features", "",
        "| case | patches | FA4 vs SDPA max abs | rel L2 | SDPA math vs SDPA rel L2 |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in d.get("agree_tower", []):
        lines.append(
            f"| {r['case']} | {r['patches']} | {r['fa4_vs_sdpa']['max_abs']:.3g} | "
            f"{r['fa4_vs_sdpa']['rel_l2']:.3g} | "
            f"{r.get('sdpa_math_vs_sdpa', {}).get('rel_l2', float('nan')):.3g} |")
    lines += ["", "## Agreement: last-position logits of the prefill", "",
              "| case | row | max abs | rel L2 | logit std | argmax equal | top-5 equal |",
              "|---|---:|---:|---:|---:|---|---|"]
    for r in d.get("agree_logits", []):
        lines.append(f"| {r['case']} | {r['row']} | {r['max_abs']:.3g} | {r['rel_l2']:.3g} | "
                     f"{r['logit_std']:.3g} | {r['argmax_equal']} | {r['top5_equal']} |")
    lines += ["", "## Speed (GPU ms by CUDA events, medians, modes alternated)", "",
              "| what | images | patches / tokens | SDPA ms | FA4 ms | SDPA / FA4 | "
              "wall SDPA | wall FA4 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in ("speed_tower", "speed_prefill", "speed_kernel"):
        for r in d.get(kind, []):
            label = {"speed_tower": "vision tower", "speed_prefill": "static prefill",
                     "speed_kernel": "attention kernel, 1 layer"}[kind]
            size = r.get("patches", r.get("tokens", ""))
            extra = ""
            if "tflops" in r:
                extra = (f" ({r['tflops']['sdpa']:.0f} vs {r['tflops']['fa4']:.0f} TFLOP/s)")
            lines.append(
                f"| {label}: {r['set']}{extra} | {r.get('images', r.get('sequences', ''))} | "
                f"{size} | {r['gpu_ms']['sdpa']:.2f} | {r['gpu_ms']['fa4']:.2f} | "
                f"{r['sdpa_over_fa4']:.3f} | {r['wall_ms']['sdpa']:.2f} | "
                f"{r['wall_ms']['fa4']:.2f} |")
    if d["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in d["errors"]]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="vision_fa4_h200")
    ap.add_argument("--version", default="1.5")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernel", choices=("fa4", "reference"), default="fa4")
    add_model_args(ap)
    args = ap.parse_args()

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    d: dict[str, Any] = {"meta": run_meta(args, "bench/vision_fa4.py"), "errors": []}
    d["meta"]["shape"] = f"HunyuanOCR-{args.version}" if args.shape == "full" else "tiny"

    def write() -> None:
        (args.out / f"{args.stem}.json").write_text(json.dumps(d, indent=1, default=str))
        (args.out / f"{args.stem}.md").write_text(markdown(d))

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = random_checkpoint(Path(tmp), args, args.version)
        settings = Settings(model=str(ckpt), model_subfolder=None, dtype=args.dtype,
                            device=args.device, max_new_tokens=2, vision_attention="sdpa")
        engine = HunyuanEngine(settings, decode="fast")
        engine.load()
        if args.kernel == "fa4":
            from importlib.metadata import version

            kernel = fa4_kernel()
            d["meta"]["fa4"] = version("flash-attn-4")
        else:
            kernel = reference_varlen
            d["meta"]["fa4"] = "reference (torch)"
        bench = Bench(args, engine, kernel)
        head_dim = engine.model.model.vision_tower.layers[0].self_attn.head_dim
        d["meta"]["auto_chooses"] = choose("auto", args.device, bench.dtype, head_dim)
        d["meta"]["fa4_unusable_because"] = fa4_unusable(args.device, bench.dtype, head_dim)
        print(f"auto chooses {d['meta']['auto_chooses']}", flush=True)
        t = time.perf_counter()
        with torch.inference_mode():
            bench.mode("fa4")
            bench.tower(bench.rows(CHECK_SIZES[:2], "first"))()
            if bench.cuda:
                torch.cuda.synchronize()
        d["meta"]["first_call_s"] = time.perf_counter() - t
        for part in ("agree_tower", "agree_logits", "speed_kernel", "speed_tower",
                     "speed_prefill"):
            try:
                d[part] = getattr(bench, part)()
            except Exception as exc:
                traceback.print_exc()
                d["errors"].append(f"{part}: {exc!r}"[:600])
            write()
    write()
    print(markdown(d), flush=True)


if __name__ == "__main__":
    main()
