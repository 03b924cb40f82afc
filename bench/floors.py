"""Each part of an A4 page's GPU time against its physical floor on an H200 (issue 29).

No GPU needed: the floors are arithmetic on HunyuanOCR-1.5's shape, and the measured times come
from committed H200 results (named in the table). Why a script and not a hand-written table: the
floors follow from a few counts (patches, prompt and new tokens, layer sizes), and writing them
down as code keeps each assumption visible and re-runnable when a measurement is replaced.

Ceilings: 788 TFLOP/s of dense bf16 matrix work and 4.8 TB/s of HBM3e reads. The first was
measured on these machines (an 8192^3 bf16 product on random data,
/work/.library/device/KINDS.md); the second is the datasheet's, since the decode attention
bench already read 4.47 TB/s (bench/results/kv_attention/kv_attention_h200.md), above the
4.3 TB/s a device-to-device copy showed.

    python bench/floors.py --out bench/results/floors
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TFLOPS = 788e12  # dense bf16, measured (see the module doc)
READ_BPS = 4.8e12  # HBM3e, datasheet


@dataclass(frozen=True)
class Shape:
    """HunyuanOCR-1.5 (ocrq/testing/tiny_hunyuan.py: HUNYUAN_OCR_1_0 holds the same sizes)."""

    vision_hidden: int = 1152
    vision_mlp: int = 4304
    vision_layers: int = 27
    merge: int = 4  # 2 x 2 patches make one image token
    hidden: int = 1024
    mlp: int = 3584
    layers: int = 24
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128


def vision_flops(s: Shape, patches: int) -> float:
    """Matrix FLOPs of the tower over one image of `patches` (bidirectional attention over all
    of them); the patch embedding and the merger are under 1% and left out."""
    d = s.vision_hidden
    linear = 2 * patches * (4 * d * d + 2 * d * s.vision_mlp)  # QKV + out, MLP up + down
    attention = 4 * patches * patches * d  # QK^T and PV
    return s.vision_layers * (linear + attention)


def text_prefill_flops(s: Shape, tokens: int) -> float:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    linear = 2 * tokens * (s.hidden * q + 2 * s.hidden * kv + q * s.hidden + 3 * s.hidden * s.mlp)
    attention = 2 * tokens * tokens * q  # causal: half of 4 N^2 q
    return s.layers * (linear + attention)


def decode_bytes(s: Shape, prompt: int, new: float, kv_bytes: int) -> float:
    """KV bytes a row's decode steps read in all: step i reads prompt + i positions of every
    layer's keys and values. Weights are shared by the ~250 rows of a step: ~4 MB a row-step,
    added."""
    per_position = s.layers * s.kv_heads * s.head_dim * 2 * kv_bytes
    kv = per_position * (prompt * new + new * new / 2)
    weights = 2 * (s.layers * (s.hidden * (2 * s.heads + 2 * s.kv_heads) * s.head_dim
                               + 3 * s.hidden * s.mlp) + 120818 * s.hidden)
    return kv + weights / 250 * new


def per_page(run: dict, key: str) -> float:
    """A service_gpu run's loop GPU seconds of `key` per page done, in ms."""
    return run["loop"][key] / run["jobs_done"] * 1e3


def load(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


RUN28 = "service_gpu/service_gpu_h200_run28_a4_fp8_bf16.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "floors")
    args = ap.parse_args()
    s = Shape()
    fa4 = load("vision_fa4/vision_fa4_h200.json")
    tower = next(t for t in fa4["speed_tower"] if t.get("set") == "1 A4 page")
    prefill = next(t for t in fa4["speed_prefill"] if t.get("set") == "1 A4 page")
    patches = next(a["patches"] for a in fa4["agree_tower"] if a["case"] == "1248x1760 alone")
    run19 = load("service_gpu/service_gpu_h200_run19_a4_fp8_2500.json")
    loop = run19["engine_alone_kv_cache_dtype_fp8"]["loop"]
    pages = run19["engine_alone_kv_cache_dtype_fp8"]["jobs_done"]
    new = run19["workload"]["a4"]["tokens_mean"]
    run20 = load("service_gpu/service_gpu_h200_run20_a4_fp8_fa4.json")
    fp8_fa4 = run20["engine_alone_kv_cache_dtype_fp8_prefill_attention_auto"]
    run21 = load("service_gpu/service_gpu_h200_run21_a4_bf16_fa4.json")
    bf16_fa4 = run21["engine_alone"]
    # Today's decode step (row splits, merged GEMMs, greedy kernels), both pools in one call;
    # the fp8 part ran first, so its prefill carries the call's first compiles (~6 ms a page).
    run28 = load(RUN28)
    fp8_today = run28["engine_alone_kv_cache_dtype_fp8_prefill_attention_auto"]
    bf16_today = run28["engine_alone_prefill_attention_auto"]
    # fp8: the kernel's default since (2 warps, 64-key blocks; the first run had 4 and 128).
    profiles = {"fp8": load("loop_profile/loop_profile_h200_fp8_w2_r1.json"),
                "bf16": load("loop_profile/loop_profile_h200_bf16.json")}
    prompt = patches // s.merge + 30  # image tokens + the template's (~30; ±5% moves 0.1 ms)

    out = args.out.resolve()
    shown = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    vision_ms = vision_flops(s, patches) / TFLOPS * 1e3
    text_ms = text_prefill_flops(s, prompt) / TFLOPS * 1e3
    fp8_ms = decode_bytes(s, prompt, new, 1) / READ_BPS * 1e3
    bf16_ms = decode_bytes(s, prompt, new, 2) / READ_BPS * 1e3
    rows = [
        ("vision tower, one A4 page, SDPA (cuDNN)", tower["gpu_ms"]["sdpa"], vision_ms,
         "vision_fa4/vision_fa4_h200.json"),
        ("vision tower, one A4 page, FA4", tower["gpu_ms"]["fa4"], vision_ms,
         "vision_fa4/vision_fa4_h200.json"),
        ("prefill (tower + text), one A4 page alone, FA4", prefill["gpu_ms"]["fa4"],
         vision_ms + text_ms, "vision_fa4/vision_fa4_h200.json"),
        ("prefill per page in the running loop, fp8 pool, SDPA",
         loop["prefill_gpu_s"] / pages * 1e3, vision_ms + text_ms,
         "service_gpu/service_gpu_h200_run19_a4_fp8_2500.json"),
        ("decode per page in the running loop, fp8 pool", loop["decode_gpu_s"] / pages * 1e3,
         fp8_ms, "service_gpu/service_gpu_h200_run19_a4_fp8_2500.json"),
        ("prefill per page in the running loop, fp8 pool, FA4 (tower and text)",
         per_page(fp8_fa4, "prefill_gpu_s"), vision_ms + text_ms,
         "service_gpu/service_gpu_h200_run20_a4_fp8_fa4.json"),
        ("decode per page in the running loop, fp8 pool (FA4 run)",
         per_page(fp8_fa4, "decode_gpu_s"), fp8_ms,
         "service_gpu/service_gpu_h200_run20_a4_fp8_fa4.json"),
        ("prefill per page in the running loop, bf16 pool, FA4 (tower and text)",
         per_page(bf16_fa4, "prefill_gpu_s"), vision_ms + text_ms,
         "service_gpu/service_gpu_h200_run21_a4_bf16_fa4.json"),
        ("decode per page in the running loop, bf16 pool",
         per_page(bf16_fa4, "decode_gpu_s"), bf16_ms,
         "service_gpu/service_gpu_h200_run21_a4_bf16_fa4.json"),
    ]
    run28_parts = (
        ("decode per page in the running loop, fp8 pool, today's step (run 28)", fp8_today,
         "decode_gpu_s", fp8_ms),
        ("prefill per page in the running loop, bf16 pool, FA4 (run 28)", bf16_today,
         "prefill_gpu_s", vision_ms + text_ms),
        ("decode per page in the running loop, bf16 pool, today's step (run 28)", bf16_today,
         "decode_gpu_s", bf16_ms),
    )
    rows += [(name, per_page(part, key), floor, RUN28) for name, part, key, floor in run28_parts]
    for kv, itemsize in (("fp8", 1), ("bf16", 2)):
        pr = profiles[kv]
        row_layer = pr["mean_context"] * 2 * s.kv_heads * s.head_dim * itemsize / READ_BPS * 1e6
        rows.append((f"decode attention, one row and layer ({kv} pool, context "
                     f"{pr['mean_context']}), us", pr["attention_us_per_row_layer"], row_layer,
                     "loop_profile/" + ("loop_profile_h200_fp8_w2_r1.json" if kv == "fp8"
                                        else "loop_profile_h200_bf16.json")))
    lines = [
        "# An A4 page's GPU time against its physical floor (bench/floors.py)",
        "",
        f"`python bench/floors.py --out {shown}`. No GPU ran here: measured "
        "times come from the committed H200 results named per row; floors are HunyuanOCR-1.5's "
        f"arithmetic at {TFLOPS / 1e12:.0f} TFLOP/s bf16 (measured) and "
        f"{READ_BPS / 1e12:.1f} TB/s (datasheet).",
        "",
        f"Page: {patches} patches (a 1248x1760 view), ~{prompt} prompt tokens, "
        f"{new:.0f} new tokens on average (run 19's A4 pages). Vision tower "
        f"{vision_flops(s, patches) / 1e12:.1f} TFLOP (attention over all patches is "
        f"{s.vision_layers * 4 * patches**2 * s.vision_hidden / vision_flops(s, patches):.0%} "
        f"of it), text prefill {text_prefill_flops(s, prompt) / 1e12:.2f} TFLOP; decode reads "
        f"{decode_bytes(s, prompt, new, 1) / 1e9:.0f} GB of fp8 KV per page "
        f"({decode_bytes(s, prompt, new, 2) / 1e9:.0f} GB in bf16).",
        "",
        "| part | measured ms | floor ms | floor / measured | from |",
        "|---|---:|---:|---:|---|",
    ]
    table = []
    for name, measured, floor, source in rows:
        lines.append(f"| {name} | {measured:.1f} | {floor:.1f} | {floor / measured:.0%} | "
                     f"`{source}` |")
        table.append({"part": name, "measured_ms": measured, "floor_ms": floor,
                      "source": source})
    lines.append("")
    for label, run, kv_ms in (("fp8 pool, SDPA tower (run 19)", run19[
            "engine_alone_kv_cache_dtype_fp8"], fp8_ms), ("fp8 pool, FA4 (run 20)", fp8_fa4,
            fp8_ms), ("bf16 pool, FA4 (run 21)", bf16_fa4, bf16_ms),
            ("fp8 pool, today's step (run 28, first part of its call)", fp8_today, fp8_ms),
            ("bf16 pool, today's step (run 28)", bf16_today, bf16_ms)):
        total = per_page(run, "prefill_gpu_s") + per_page(run, "decode_gpu_s")
        floor_total = vision_ms + text_ms + kv_ms
        lines.append(
            f"- A page in the loop, {label}: {total:.0f} ms of GPU against a floor of "
            f"{floor_total:.0f} ms: {1e3 / total:.1f} pages/s of GPU time, "
            f"{1e3 / floor_total:.1f} at the floor.")
    lines.append("- 12 pages/s needs 83 ms a page; 9 pages/s, 111 ms.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "floors_h200.md").write_text("\n".join(lines) + "\n")
    (args.out / "floors_h200.json").write_text(json.dumps(
        {"tflops": TFLOPS, "read_bps": READ_BPS, "patches": patches, "prompt_tokens": prompt,
         "new_tokens": new, "rows": table}, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
