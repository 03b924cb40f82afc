"""The vision tower's linears in fp8 (`OCRQ_VISION_GEMM_DTYPE=fp8`) against the model's dtype.

Why: with its attention on FlashAttention-4, an A4 page's vision tower is mostly GEMMs (q, k, v,
o and the MLP: ~7.5 TFLOP a page in bf16), and Hopper runs e4m3 at twice bf16's rate
(ocrq/models/hunyuan/vision_fp8.py; issue 29's third lever). This bench loads the same
random-weight checkpoint twice, once per setting, both with the same attention kernel, and:

* checks the error: the tower's features of several distinct images and the prefill's
  last-position logits, fp8 against bf16, beside the spread between two accepted bf16 attention
  kernels (FA4 against SDPA, where FA4 runs) so the fp8 figure has a yardstick;
* checks the Triton quantisation kernel against torch's arithmetic, element for element;
* times the tower per pass (CUDA events, modes alternated rep by rep, medians) on one A4 page,
  four pages, a page with scene photos, and one layer's GEMMs alone (bf16 `F.linear` against
  quantise + `_scaled_mm`) on an A4 page's patches, in TFLOP/s.

    PYTHONUNBUFFERED=1 python bench/vision_fp8.py --out OUT
    python bench/vision_fp8.py --out /tmp/vf8 --shape tiny --device cpu --reps 2  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_model_args, page_image, random_checkpoint, run_meta  # noqa: E402
from bench.vision_fa4 import CHECK_SIZES, compare, scene_sizes  # noqa: E402
from bench.vision_fa4 import Bench as FA4Bench  # noqa: E402
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.hunyuan import HunyuanEngine  # noqa: E402
from ocrq.models.hunyuan.patches import batch_vision_attention  # noqa: E402
from ocrq.models.hunyuan.vision_attention import fa4_kernel  # noqa: E402

MODES = ("bf16", "fp8")
A4 = (1248, 1760)


class Bench:
    def __init__(self, args: argparse.Namespace, engines: dict[str, HunyuanEngine]) -> None:
        import torch

        self.torch, self.args, self.engines = torch, args, engines
        self.cuda = args.device.startswith("cuda")
        base = engines["bf16"]
        self.dtype = next(base.model.model.vision_tower.parameters()).dtype

    def rows(self, sizes: list[tuple[int, int]], tag: str) -> list[Any]:
        out = []
        for i, (w, h) in enumerate(sizes):
            im = page_image(w, h)
            out.append(self.engines["bf16"].preprocess(PreparedImage(f"{tag}{i}", im, im.size)))
        return out

    def tower(self, mode: str, rows: list[Any]) -> Any:
        torch = self.torch
        engine = self.engines[mode]
        pixels = torch.cat([r.pixel_values for r in rows]).to(engine.model.device, self.dtype)
        grid = torch.cat([r.image_grid_thw for r in rows])
        inner = engine.model.model

        def run() -> Any:
            out = inner.get_image_features(pixels, grid, return_dict=True).pooler_output
            return torch.cat(list(out)) if isinstance(out, (list, tuple)) else out

        return run

    # (GPU ms by CUDA events, wall ms) of one fn(): vision_fa4's, which reads the same
    # `torch` and `cuda` attributes.
    time_once = FA4Bench.time_once

    def alternated(self, fns: dict[str, Any], reps: int) -> dict[str, Any]:
        """Medians of each mode's fn, modes alternated rep by rep after two warm-up rounds."""
        names = list(fns)
        gpu: dict[str, list[float]] = {m: [] for m in names}
        with self.torch.inference_mode():
            for rep in range(reps + 2):
                for m in (names if rep % 2 == 0 else names[::-1]):
                    g, _ = self.time_once(fns[m])
                    if rep >= 2:
                        gpu[m].append(g)
        med = {m: statistics.median(gpu[m]) for m in names}
        return {"gpu_ms": med, "gpu_ms_all": gpu, "bf16_over_fp8": med[names[0]] / med[names[1]]}

    # -- error ---------------------------------------------------------------------------------

    def agree_tower(self) -> list[dict[str, Any]]:
        torch = self.torch
        out = []
        rows = self.rows(CHECK_SIZES, "check")
        cases = [([r], f"{w}x{h} alone") for r, (w, h) in zip(rows, CHECK_SIZES, strict=True)]
        cases.append((rows, f"all {len(rows)} in one pass"))
        base = self.engines["bf16"]
        with torch.inference_mode():
            for case_rows, name in cases:
                feats = {m: self.tower(m, case_rows)().float() for m in MODES}
                entry: dict[str, Any] = {
                    "case": name,
                    "patches": sum(int(r.image_grid_thw.prod()) for r in case_rows),
                    "fp8_vs_bf16": compare(feats["fp8"], feats["bf16"]),
                    "finite": bool(torch.isfinite(feats["fp8"]).all()),
                }
                if base.vision_attention == "fa4":  # the spread between two bf16 kernels
                    batch_vision_attention(base.model)
                    try:
                        sdpa = self.tower("bf16", case_rows)().float()
                    finally:
                        batch_vision_attention(base.model, kernel=fa4_kernel())
                    entry["sdpa_vs_fa4_bf16"] = compare(sdpa, feats["bf16"])
                out.append(entry)
                print(f"tower {name}: {entry}", flush=True)
        return out

    def agree_logits(self) -> list[dict[str, Any]]:
        out = []
        sizes = CHECK_SIZES
        its: dict[str, list[PreparedImage]] = {}
        for m in MODES:
            its[m] = []
            for i, (w, h) in enumerate(sizes):
                im = page_image(w, h)
                it = PreparedImage(f"logit{i}", im, im.size, task="text")
                self.engines[m].prepare(it)
                its[m].append(it)
        cases = [(slice(i, i + 1), f"{w}x{h} alone") for i, (w, h) in enumerate(sizes)]
        cases.append((slice(None), f"all {len(sizes)} in one static batch"))
        for span, name in cases:
            logits = {}
            for m in MODES:
                res = self.engines[m].generate(its[m][span], output_logits=True, decode="fast",
                                               max_new_tokens=1)
                logits[m] = [r.logits[0].float() for r in res.items]
            for i, (a, b) in enumerate(zip(logits["fp8"], logits["bf16"], strict=True)):
                entry = {
                    "case": name, "row": i, **compare(a, b),
                    "argmax_equal": int(a.argmax()) == int(b.argmax()),
                    "top5_equal": a.topk(5).indices.tolist() == b.topk(5).indices.tolist(),
                    "logit_std": float(b.std()),
                }
                out.append(entry)
                print(f"logits {name} row {i}: {entry}", flush=True)
        return out

    def kernel_check(self) -> dict[str, Any]:
        """The Triton quantisation against torch's arithmetic on one A4 page's MLP input."""
        torch = self.torch
        from ocrq.models.hunyuan.vision_fp8 import quantize_rows, quantize_rows_torch

        gen = torch.Generator(device=self.args.device).manual_seed(5)
        cols = self.engines["bf16"].model.model.vision_tower.layers[0].mlp.fc2.in_features
        x = (torch.randn(8580, cols, generator=gen, device=self.args.device) * 3).to(self.dtype)
        x[7] = 0
        with torch.inference_mode():
            (q, s), (qt, st) = quantize_rows(x), quantize_rows_torch(x)
        r = {"rows": 8580, "cols": cols,
             "values_differing": int((q.float() != qt.float()).sum()),
             "scales_differing": int((s != st).sum()),
             "zero_row_zero": bool((q[7].float() == 0).all())}
        print(f"quantisation kernel vs torch: {r}", flush=True)
        return r

    # -- speed ---------------------------------------------------------------------------------

    def speed_tower(self) -> list[dict[str, Any]]:
        scenes = scene_sizes(24, 7)
        sets = {"1 A4 page": [A4], "4 A4 pages": [A4] * 4,
                "1 A4 page + 12 scene photos": [A4, *scenes[:12]], "24 scene photos": scenes}
        out = []
        for name, sizes in sets.items():
            rows = self.rows(sizes, "speed")
            r = self.alternated({m: self.tower(m, rows) for m in MODES}, self.args.reps)
            r.update({"set": name, "images": len(rows),
                      "patches": sum(int(x.image_grid_thw.prod()) for x in rows)})
            out.append(r)
            print(f"tower {name}: {r['gpu_ms']} ratio {r['bf16_over_fp8']:.3f}", flush=True)
        return out

    def speed_gemms(self) -> list[dict[str, Any]]:
        """One vision layer's four products (q/k/v merged, o, fc1, fc2) on an A4 page's patches:
        bf16 `F.linear` of the model's weights against the fp8 layer's modules."""
        torch = self.torch
        import torch.nn.functional as F

        n = 8580
        b_layer = self.engines["bf16"].model.model.vision_tower.layers[0]
        f_layer = self.engines["fp8"].model.model.vision_tower.layers[0]
        ba, fa = b_layer.self_attn, f_layer.self_attn
        qkv_w = torch.cat([ba.q_proj.weight, ba.k_proj.weight, ba.v_proj.weight])
        qkv_b = torch.cat([ba.q_proj.bias, ba.k_proj.bias, ba.v_proj.bias])
        shapes = {
            "q/k/v (merged)": ((qkv_w, qkv_b), fa.ocrq_qkv),
            "o": ((ba.o_proj.weight, ba.o_proj.bias), fa.o_proj),
            "fc1": ((b_layer.mlp.fc1.weight, b_layer.mlp.fc1.bias), f_layer.mlp.fc1),
            "fc2": ((b_layer.mlp.fc2.weight, b_layer.mlp.fc2.bias), f_layer.mlp.fc2),
        }
        out = []
        for name, ((w, b), fp8) in shapes.items():
            x = torch.randn(n, w.shape[1], device=w.device, dtype=self.dtype)

            def bf16(x: Any = x, w: Any = w, b: Any = b) -> None:
                F.linear(x, w, b)

            def f8(x: Any = x, fp8: Any = fp8) -> None:
                fp8(x)

            r = self.alternated({"bf16": bf16, "fp8": f8}, max(self.args.reps, 20))
            flops = 2 * n * w.shape[0] * w.shape[1]
            r.update({"set": f"{name} {w.shape[1]}->{w.shape[0]}", "tokens": n,
                      "tflops": {m: flops / (ms * 1e9) for m, ms in r["gpu_ms"].items()}})
            out.append(r)
            print(f"gemm {name}: {r['gpu_ms']} {r['tflops']}", flush=True)
        return out


    def speed_parts(self) -> list[dict[str, Any]]:
        """Where an fp8 product's time goes, per GEMM shape on an A4 page's patches: the
        quantisation kernel alone, `_scaled_mm` with per-row scales (what Fp8Linear runs) and
        with one scale per tensor (cuBLASLt's plain fp8 path), against bf16 `F.linear`."""
        torch = self.torch
        import torch.nn.functional as F

        from ocrq.models.hunyuan.vision_fp8 import quantize_rows

        n = 8580
        layer = self.engines["fp8"].model.model.vision_tower.layers[0]
        mods = {"q/k/v (merged)": layer.self_attn.ocrq_qkv, "o": layer.self_attn.o_proj,
                "fc1": layer.mlp.fc1, "fc2": layer.mlp.fc2}
        out = []
        for name, mod in mods.items():
            k, m = mod.in_features, mod.out_features
            x = torch.randn(n, k, device=mod.weight_q.device, dtype=self.dtype)
            w = torch.randn(m, k, device=x.device, dtype=self.dtype)
            qx, sx = quantize_rows(x)
            one = torch.ones((), device=x.device, dtype=torch.float32)
            wq, ws, bias = mod.weight_q.t(), mod.weight_scale, mod.bias

            fns = {
                "bf16 F.linear": lambda x=x, w=w, b=bias: F.linear(x, w, b),
                "quantise only": lambda x=x: quantize_rows(x),
                "_scaled_mm per row": lambda qx=qx, sx=sx, wq=wq, ws=ws, b=bias: torch._scaled_mm(
                    qx, wq, scale_a=sx, scale_b=ws, bias=b, out_dtype=torch.bfloat16),
                "_scaled_mm per tensor": lambda qx=qx, wq=wq, one=one, b=bias: torch._scaled_mm(
                    qx, wq, scale_a=one, scale_b=one, bias=b, out_dtype=torch.bfloat16),
                "_scaled_mm per tensor, no bias": lambda qx=qx, wq=wq, one=one: torch._scaled_mm(
                    qx, wq, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            }
            times: dict[str, list[float]] = {f: [] for f in fns}
            with torch.inference_mode():
                for rep in range(max(self.args.reps, 20) + 2):
                    for f, fn in fns.items():
                        g, _ = self.time_once(fn)
                        if rep >= 2:
                            times[f].append(g)
            med = {f: statistics.median(v) for f, v in times.items()}
            flops = 2 * n * m * k
            r = {"set": f"{name} {k}->{m}", "tokens": n, "gpu_ms": med,
                 "tflops": {f: flops / (ms * 1e9) for f, ms in med.items()}}
            out.append(r)
            print(f"parts {name}: {med}", flush=True)
        return out


def markdown(d: dict[str, Any]) -> str:
    m = d["meta"]
    lines = [
        f"# Vision tower linears: fp8 (e4m3) vs the model's dtype ({m['gpu']})", "",
        f"torch {m['torch']}, transformers {m['transformers']}, {m['dtype']}, random weights "
        f"of the {m['shape']} shape, vision attention {m.get('vision_attention')} in both. "
        f"Command: `{m['command']}`.", "",
        "## Error: vision tower features", "",
        "| case | patches | fp8 vs bf16 max abs | rel L2 | SDPA vs FA4 (both bf16) rel L2 |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in d.get("agree_tower", []):
        lines.append(
            f"| {r['case']} | {r['patches']} | {r['fp8_vs_bf16']['max_abs']:.3g} | "
            f"{r['fp8_vs_bf16']['rel_l2']:.3g} | "
            f"{r.get('sdpa_vs_fa4_bf16', {}).get('rel_l2', float('nan')):.3g} |")
    lines += ["", "## Error: last-position logits of the prefill", "",
              "| case | row | max abs | rel L2 | logit std | argmax equal | top-5 equal |",
              "|---|---:|---:|---:|---:|---|---|"]
    for r in d.get("agree_logits", []):
        lines.append(f"| {r['case']} | {r['row']} | {r['max_abs']:.3g} | {r['rel_l2']:.3g} | "
                     f"{r['logit_std']:.3g} | {r['argmax_equal']} | {r['top5_equal']} |")
    if "kernel_check" in d:
        k = d["kernel_check"]
        lines += ["", f"Quantisation kernel against torch's arithmetic ({k['rows']} x "
                      f"{k['cols']}): {k['values_differing']} values and "
                      f"{k['scales_differing']} scales differ; a zero row quantises to zeros: "
                      f"{k['zero_row_zero']}."]
    lines += ["", "## Speed (GPU ms by CUDA events, medians, modes alternated)", "",
              "| what | images / tokens | patches | bf16 ms | fp8 ms | bf16 / fp8 |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in d.get("speed_tower", []):
        lines.append(f"| vision tower: {r['set']} | {r['images']} | {r['patches']} | "
                     f"{r['gpu_ms']['bf16']:.2f} | {r['gpu_ms']['fp8']:.2f} | "
                     f"{r['bf16_over_fp8']:.3f} |")
    for r in d.get("speed_gemms", []):
        lines.append(f"| one layer's GEMM: {r['set']} ({r['tflops']['bf16']:.0f} vs "
                     f"{r['tflops']['fp8']:.0f} TFLOP/s) | {r['tokens']} | | "
                     f"{r['gpu_ms']['bf16']:.3f} | {r['gpu_ms']['fp8']:.3f} | "
                     f"{r['bf16_over_fp8']:.3f} |")
    parts = d.get("speed_parts", [])
    if parts:
        names = list(parts[0]["gpu_ms"])
        lines += ["", "## Where an fp8 product's time goes (GPU ms, medians; A4 page's patches)",
                  "", "| GEMM | " + " | ".join(names) + " |",
                  "|---|" + "---:|" * len(names)]
        for r in parts:
            lines.append(f"| {r['set']} | " + " | ".join(
                f"{r['gpu_ms'][f]:.3f} ({r['tflops'][f]:.0f} TFLOP/s)"
                if f != "quantise only" else f"{r['gpu_ms'][f]:.3f}" for f in names) + " |")
    if d["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in d["errors"]]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="vision_fp8")
    ap.add_argument("--version", default="1.5")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--vision-attention", default="auto", choices=("auto", "fa4", "sdpa"))
    ap.add_argument("--parts", nargs="*", default=["kernel_check", "agree_tower", "agree_logits",
                                                    "speed_gemms", "speed_parts", "speed_tower"])
    add_model_args(ap)
    args = ap.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    d: dict[str, Any] = {"meta": run_meta(args, "bench/vision_fp8.py"), "errors": []}
    d["meta"]["shape"] = f"HunyuanOCR-{args.version}" if args.shape == "full" else "tiny"

    def write() -> None:
        (args.out / f"{args.stem}.json").write_text(json.dumps(d, indent=1, default=str))
        (args.out / f"{args.stem}.md").write_text(markdown(d))

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = random_checkpoint(Path(tmp), args, args.version)
        engines = {}
        for mode, dtype in (("bf16", "auto"), ("fp8", "fp8")):
            settings = Settings(model=str(ckpt), model_subfolder=None, dtype=args.dtype,
                                device=args.device, max_new_tokens=2,
                                vision_attention=args.vision_attention, vision_gemm_dtype=dtype)
            engines[mode] = HunyuanEngine(settings, decode="fast")
            engines[mode].load()
        d["meta"]["vision_attention"] = engines["bf16"].vision_attention
        d["meta"]["vision_gemms"] = {m: e.vision_gemm_dtype for m, e in engines.items()}
        bench = Bench(args, engines)
        for part in args.parts:
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
