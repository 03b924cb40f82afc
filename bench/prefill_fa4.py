"""The packed text prefill's causal attention on FlashAttention-4 against torch's flash kernel.

Why: the running loop prefills its rows packed end to end, one causal varlen attention a layer
(ocrq/models/hunyuan/packed.py). torch's path repeats the 8 key/value heads to the 16 query heads
first and runs FlashAttention-2; `Settings.prefill_attention=fa4` hands the grouped heads to
FlashAttention-4's Hopper forward (issue 29, lever 1's second use). On one loaded random-weight
model, switching only that kernel, this bench:

* checks that they agree: the logits of each row's last token and the last layer's keys and
  values, over packs of distinct images (alone and together);
* times the attention alone (one layer's call) on packs of A4 pages and of mixed images, in
  TFLOP/s, and a whole packed prefill pass (vision tower included), CUDA events, the two kernels
  alternated rep by rep, medians.

    PYTHONUNBUFFERED=1 python bench/prefill_fa4.py --out OUT
    python bench/prefill_fa4.py --out /tmp/pf --shape tiny --device cpu --kernel reference  # smoke
"""

from __future__ import annotations

import argparse
import json
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
from bench.vision_fa4 import rel  # noqa: E402
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.hunyuan import HunyuanEngine  # noqa: E402
from ocrq.models.hunyuan.packed import causal_varlen, pack, prefill_packed  # noqa: E402
from ocrq.models.hunyuan.vision_attention import (  # noqa: E402
    choose,
    fa4_kernel,
    reference_causal_varlen,
)

A4 = (1248, 1760)
CHECK_SIZES = [A4, (1024, 1024), (886, 1699), (1920, 1080), (800, 600), (333, 517)]
SPEED_SETS = {
    "1 A4 page": [A4],
    "6 A4 pages": [A4] * 6,
    "1 A4 page + 12 scene photos": [A4] + [(640, 480), (512, 384), (820, 300)] * 4,
}
MODES = ("torch", "fa4")


class Bench:
    def __init__(self, args: argparse.Namespace, engine: HunyuanEngine, kernel: Any) -> None:
        import torch

        self.torch, self.args, self.engine, self.kernel = torch, args, engine, kernel
        self.text = engine._decoder.text
        self.cuda = args.device.startswith("cuda")

    def mode(self, name: str) -> None:
        self.text.causal_kernel = self.kernel if name == "fa4" else None

    def batch(self, sizes: list[tuple[int, int]], tag: str) -> Any:
        rows = []
        for i, (w, h) in enumerate(sizes):
            im = page_image(w, h)
            rows.append(self.engine.preprocess(PreparedImage(f"{tag}{i}", im, im.size)))
        image_token = self.engine.model.model.config.image_token_id
        return pack(rows, image_token, self.text.device, self.text.dtype)

    def alternated(self, fn: Any, reps: int) -> dict[str, float]:
        torch = self.torch
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for rep in range(reps + 2):
            for m in MODES:
                self.mode(m)
                if self.cuda:
                    torch.cuda.synchronize()
                    a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    a.record()
                t = time.perf_counter()
                fn()
                if self.cuda:
                    b.record()
                    torch.cuda.synchronize()
                    ms = a.elapsed_time(b)
                else:
                    ms = (time.perf_counter() - t) * 1000
                if rep >= 2:
                    times[m].append(ms)
        return {m: statistics.median(v) for m, v in times.items()}

    def agree(self) -> list[dict[str, Any]]:
        out = []
        cases = [([s], f"{s[0]}x{s[1]} alone") for s in CHECK_SIZES]
        cases.append((CHECK_SIZES, f"all {len(CHECK_SIZES)} in one pass"))
        for sizes, name in cases:
            batch = self.batch(sizes, "agree")
            got = {}
            for m in MODES:
                self.mode(m)
                kv, logits = prefill_packed(self.text, batch, self.engine._decoder.fused)
                got[m] = (kv[-1][0].float(), kv[-1][1].float(), logits.float())
            (k_t, v_t, l_t), (k_f, v_f, l_f) = got["torch"], got["fa4"]
            entry = {
                "case": name, "rows": len(sizes), "tokens": batch.edges[-1],
                "logits_max_abs": float((l_f - l_t).abs().max()), "logits_rel_l2": rel(l_f, l_t),
                "logit_std": float(l_t.std()),
                "argmax_equal": int((l_f.argmax(-1) == l_t.argmax(-1)).sum()),
                "last_layer_k_rel_l2": rel(k_f, k_t), "last_layer_v_rel_l2": rel(v_f, v_t),
            }
            out.append(entry)
            print(f"agree {name}: {entry}", flush=True)
        return out

    def speed(self) -> list[dict[str, Any]]:
        torch, text = self.torch, self.text
        out = []
        for name, sizes in SPEED_SETS.items():
            batch = self.batch(sizes, "speed")
            n = batch.edges[-1]
            g = torch.Generator(device=text.device).manual_seed(n)
            q, k, v = (torch.randn(n, heads, text.head_dim, generator=g, device=text.device,
                                   dtype=text.dtype)
                       for heads in (text.heads, text.kv_heads, text.kv_heads))

            def attend(q: Any = q, k: Any = k, v: Any = v, batch: Any = batch) -> None:
                causal_varlen(q, k, v, batch, text.scale, text.causal_kernel)

            def whole(batch: Any = batch) -> None:
                prefill_packed(text, batch, self.engine._decoder.fused)

            lengths = [b - a for a, b in zip(batch.edges, batch.edges[1:], strict=False)]
            flop = sum(2 * 2 * x * (x + 1) / 2 * text.heads * text.head_dim for x in lengths)
            att = self.alternated(attend, self.args.reps)
            pas = self.alternated(whole, max(3, self.args.reps // 4))
            entry = {
                "set": name, "rows": len(sizes), "tokens": n,
                "attention_ms": att,
                "attention_tflops": {m: flop / t / 1e9 for m, t in att.items()},
                "attention_torch_over_fa4": att["torch"] / att["fa4"],
                "pass_ms": pas, "pass_torch_over_fa4": pas["torch"] / pas["fa4"],
                "layers": len(text.layers),
            }
            out.append(entry)
            print(f"speed {name}: {entry}", flush=True)
        return out


def markdown(d: dict[str, Any]) -> str:
    m = d["meta"]
    lines = [f"# The packed text prefill's attention: FA4 against torch ({m.get('gpu')})",
             "", f"Command: `python bench/prefill_fa4.py {m.get('argv', '')}`. {m.get('shape')}, "
             f"{m.get('dtype')}; FA4 {m.get('fa4')}; `prefill_attention=auto` chooses "
             f"`{m.get('auto_chooses')}` here; first FA4 call {m.get('first_call_s', 0):.1f} s.",
             "", "## Agreement (torch's flash path is the reference)", "",
             "| case | rows | tokens | logits max abs | logits rel. L2 | logit std | argmax equal "
             "| last layer K rel. L2 | V rel. L2 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in d.get("agree", []):
        lines.append(f"| {e['case']} | {e['rows']} | {e['tokens']} | {e['logits_max_abs']:.4f} | "
                     f"{e['logits_rel_l2']:.4f} | {e['logit_std']:.3f} | "
                     f"{e['argmax_equal']}/{e['rows']} | {e['last_layer_k_rel_l2']:.4f} | "
                     f"{e['last_layer_v_rel_l2']:.4f} |")
    lines += ["", "## Speed (medians, kernels alternated rep by rep)", "",
              "| pack | rows | tokens | attention torch ms | FA4 ms | torch / FA4 | torch TFLOP/s "
              "| FA4 TFLOP/s | pass torch ms | pass FA4 ms | pass torch / FA4 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in d.get("speed", []):
        a, t, p = e["attention_ms"], e["attention_tflops"], e["pass_ms"]
        lines.append(f"| {e['set']} | {e['rows']} | {e['tokens']} | {a['torch']:.3f} | "
                     f"{a['fa4']:.3f} | {e['attention_torch_over_fa4']:.2f} | {t['torch']:.0f} | "
                     f"{t['fa4']:.0f} | {p['torch']:.2f} | {p['fa4']:.2f} | "
                     f"{e['pass_torch_over_fa4']:.3f} |")
    if d.get("errors"):
        lines += ["", "Errors:", *(f"- {x}" for x in d["errors"])]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="prefill_fa4_h200")
    ap.add_argument("--version", default="1.5")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernel", choices=("fa4", "reference"), default="fa4")
    add_model_args(ap)
    args = ap.parse_args()

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    d: dict[str, Any] = {"meta": run_meta(args, "bench/prefill_fa4.py"), "errors": []}
    d["meta"]["shape"] = f"HunyuanOCR-{args.version}" if args.shape == "full" else "tiny"
    d["meta"]["argv"] = " ".join(sys.argv[1:])

    def write() -> None:
        (args.out / f"{args.stem}.json").write_text(json.dumps(d, indent=1, default=str))
        (args.out / f"{args.stem}.md").write_text(markdown(d))

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = random_checkpoint(Path(tmp), args, args.version)
        settings = Settings(model=str(ckpt), model_subfolder=None, dtype=args.dtype,
                            device=args.device, max_new_tokens=2, vision_attention="sdpa",
                            prefill_attention="sdpa")
        engine = HunyuanEngine(settings, decode="fast")
        engine.load()
        if args.kernel == "fa4":
            from importlib.metadata import version

            kernel = fa4_kernel(causal=True)
            d["meta"]["fa4"] = version("flash-attn-4")
        else:
            kernel = reference_causal_varlen
            d["meta"]["fa4"] = "reference (torch)"
        bench = Bench(args, engine, kernel)
        d["meta"]["auto_chooses"] = choose("auto", args.device, bench.text.dtype,
                                           bench.text.head_dim, name="prefill_attention")
        d["meta"]["gpu"] = torch.cuda.get_device_name() if bench.cuda else "CPU"
        t = time.perf_counter()
        with torch.inference_mode():
            bench.mode("fa4")
            prefill_packed(bench.text, bench.batch(CHECK_SIZES[:2], "first"),
                           engine._decoder.fused)
            if bench.cuda:
                torch.cuda.synchronize()
            d["meta"]["first_call_s"] = time.perf_counter() - t
            for part in ("agree", "speed"):
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
