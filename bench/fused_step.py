"""The fused few-row decode step (ocrq/models/hunyuan/fused_step.py) against today's step and
the step's read floor, on random weights of HunyuanOCR-1.5's text shape (issue 50, item 1).

Per (rows, context, pool dtype): today's step as the running loop runs it (TextModel.step with
the fused norm/RoPE kernels, merged GEMMs and the split Triton attention over the pool, one CUDA
graph) and the fused step (one CUDA graph), both from token ids to logits; the greedy choice
after them is the same two kernels for both and left out. Each step is timed as the median of
several runs of `--replays` graph replays between CUDA events. Floor: the bytes a step must read
(every layer's weights, the final norm, the lm_head, and each row's KV at its context) over the
card's datasheet bandwidth and over a measured device-to-device copy's.

Numerics: logits of today's step and the fused one on distinct random tokens and positions over
the same pool (max abs difference, the logits' scale, argmax agreement), and how far the logits
of two distinct inputs lie (a check that could not tell them apart would pass anything).

    PYTHONUNBUFFERED=1 python bench/fused_step.py --out OUT --stem fused_step_h100
    TRITON_INTERPRET=1 python bench/fused_step.py --out /tmp/fs --smoke  # tiny model, CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ocrq.models.hunyuan.attention import (  # noqa: E402
    DEFAULT_CONFIG,
    FP8_CONFIG,
    PAD_KEYS,
    TritonDecodeAttention,
)
from ocrq.models.hunyuan.fused_step import (  # noqa: E402
    FusedConfig,
    FusedStep,
    FusedWeights,
    fused_decode_step,
)
from ocrq.models.hunyuan.kv_cache import padded_width, zero_pool  # noqa: E402
from ocrq.models.hunyuan.text import TextModel  # noqa: E402

DATASHEET_TB_S = {"H100": 3.35, "H200": 4.8}


def build_text(shape: str, device: str, dtype: Any) -> TextModel:
    import torch
    from transformers import HunYuanVLForConditionalGeneration

    from ocrq.testing.tiny_hunyuan import HUNYUAN_OCR_1_5, TINY_1_5, build_config

    torch.manual_seed(0)
    config = build_config(HUNYUAN_OCR_1_5 if shape == "full" else TINY_1_5)
    with torch.device(device):
        model = HunYuanVLForConditionalGeneration._from_config(config, dtype=dtype).eval()
    text = TextModel(model)
    text.merge()
    return text


class Case:
    """A pool holding `rows` rows of `contexts[r]` keys each (random values), and both steps."""

    def __init__(self, text: TextModel, rows: int, contexts: list[int], kv: str, device: str,
                 fused_config: FusedConfig, seed: int) -> None:
        import torch

        self.text, self.rows, self.device = text, rows, device
        cap = max(contexts) + 8
        pool_tokens = rows * cap
        width = padded_width(pool_tokens + 1, PAD_KEYS)
        dtype = torch.float8_e4m3fn if kv == "fp8" else text.dtype
        transposed = kv == "fp8"  # the running loop's layouts (running.py)
        g = torch.Generator(device=device).manual_seed(seed)
        self.keys, self.values = [], []
        kvh, d = text.kv_heads, text.head_dim
        for _ in text.layers:
            k = zero_pool(kvh, width, d, dtype, device)
            v = zero_pool(kvh, width, d, dtype, device, transposed=transposed)
            k.copy_(torch.randn(k.shape, generator=g, device=device).to(dtype))
            v.copy_(torch.randn(v.shape, generator=g, device=device).to(dtype))
            self.keys.append(k)
            self.values.append(v)
        i32 = torch.int32
        self.start = torch.tensor([r * cap for r in range(rows)], dtype=i32, device=device)
        self.end = self.start + torch.tensor(contexts, dtype=i32, device=device)
        self.col = (self.end - 1).long()
        vocab = int(text.lm_head.weight.shape[0])
        self.tok = torch.randint(0, vocab, (rows,), generator=g, device=device)
        self.pos = torch.tensor(contexts, device=device).repeat(text.axes, 1) + 100
        config = FP8_CONFIG if kv == "fp8" else DEFAULT_CONFIG
        self.attention = TritonDecodeAttention(rows, text.heads, kvh, d, pool_tokens + 1,
                                               device, config, padded=transposed)
        self.fused = FusedStep(FusedWeights.from_text(text), rows, device, fused_config,
                               padded=True)
        self.kv_bytes = sum(contexts) * len(text.layers) * 2 * kvh * d * dtype.itemsize

    def today(self) -> Any:
        k, start, end, scale = self.rows, self.start, self.end, self.text.scale

        def attend(q: Any, kc: Any, vc: Any) -> Any:
            shape = (k, *kc.shape[1:])
            return self.attention(q, kc.expand(shape), vc.expand(shape), start, end, scale)

        return self.text.step(self.tok, self.pos, self.col, self.keys, self.values, attend,
                              True, pooled=True)

    def modules(self) -> Any:
        """The module-by-module step with torch attention under a key mask (text.py)."""
        import torch

        from ocrq.models.hunyuan.attention import attend_torch

        width = self.keys[0].shape[2]
        valid = torch.zeros(self.rows, width, dtype=torch.bool, device=self.device)
        for r in range(self.rows):
            valid[r, int(self.start[r]):int(self.end[r])] = True
        k, scale = self.rows, self.text.scale

        def attend(q: Any, kc: Any, vc: Any) -> Any:
            shape = (k, *kc.shape[1:])
            return attend_torch(q, kc.expand(shape), vc.expand(shape), valid, scale)

        return self.text.step(self.tok, self.pos, self.col, self.keys, self.values, attend,
                              False, pooled=True)

    def fused_step(self) -> Any:
        return fused_decode_step(self.text, self.fused, self.tok, self.pos, self.col,
                                 self.start, self.end, self.keys, self.values)


def graph_of(torch: Any, fn: Any) -> tuple[Any, Any]:
    """fn captured in a CUDA graph (after two eager runs on a side stream), and its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def time_graph(torch: Any, graph: Any, replays: int, runs: int) -> float:
    """Median ms a replay, over `runs` runs of `replays` back-to-back replays."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / replays)
    return statistics.median(times)


def copy_tb_s(torch: Any) -> float:
    """A 1 GiB device-to-device copy, bytes read + written a second."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    b.synchronize()
    return 2 * x.numel() * 10 / (a.elapsed_time(b) / 1e3) / 1e12


def profile_kernels(torch: Any, graph: Any, replays: int) -> dict[str, list[float]]:
    """Kernel name -> [us a step, launches a step] under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0.0) or 0.0
        if us and ev.device_type.name == "CUDA":
            out[ev.key][0] += us / replays
            out[ev.key][1] += ev.count / replays
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="fused_step")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--spread", default="256,4096", help="more contexts, at the largest rows")
    ap.add_argument("--kv", default="auto,fp8")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--configs", default="32x1024w8,32x1024w8p,16x1024p,32x1024p,16x1024w8p",
                    help="fused GEMV block_n x block_k [w warps] [p: programmatic dependent "
                         "launch] tried at 1 row (the best one then used)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    text = build_text("tiny" if smoke else "full", device, dtype)
    gpu = "cpu" if smoke else torch.cuda.get_device_name(0)
    card = next((c for c in DATASHEET_TB_S if c in gpu), "H200")
    weights = sum(p.numel() * p.element_size() for lay in text.layers for p in lay.parameters())
    weights += sum(p.numel() * p.element_size() for p in text.norm.parameters())
    weights += text.lm_head.weight.numel() * text.lm_head.weight.element_size()
    measured = 0.0 if smoke else copy_tb_s(torch)
    result: dict[str, Any] = {
        "command": " ".join(["python", "bench/fused_step.py", *sys.argv[1:]]),
        "gpu": gpu, "torch": torch.__version__, "weights_bytes": weights,
        "datasheet_tb_s": DATASHEET_TB_S[card], "copy_tb_s": round(measured, 3),
        "configs": [], "steps": [], "numerics": [], "kernels": {},
    }
    rows_list = [int(r) for r in args.rows.split(",")]
    kvs = args.kv.split(",")
    if smoke:
        rows_list, args.context, args.spread, kvs = [1, 2], 40, "20", ["auto"]
        args.replays, args.runs, args.configs = 1, 1, "16x32,16x1024p"

    def run(fn: Any) -> float:
        if smoke:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        graph, _ = graph_of(torch, fn)
        ms = time_graph(torch, graph, args.replays, args.runs)
        del graph
        return ms

    def floor_ms(case: Case, tb_s: float) -> float:
        return (weights + case.kv_bytes) / (tb_s * 1e12) * 1e3 if tb_s else 0.0

    # the GEMV blocks, at one row of the default context over a bf16 pool
    best, best_ms = FusedConfig(), float("inf")
    for spec in args.configs.split(","):
        pdl = spec.endswith("p")
        blocks, _, warps = spec.rstrip("p").partition("w")
        bn, bk = (int(x) for x in blocks.split("x"))
        cfg = FusedConfig(block_n=bn, block_k=bk, num_warps=int(warps or 4), pdl=pdl)
        case = Case(text, 1, [args.context], kvs[0], device, cfg, 1)
        try:
            with torch.inference_mode():
                ms = run(case.fused_step)
        except Exception as exc:  # a config the card or this Triton refuses: say so, go on
            print(f"config {spec}: {exc!r}"[:400], flush=True)
            result["configs"].append({"spec": spec, "error": repr(exc)[:300]})
            continue
        result["configs"].append({"spec": spec, "block_n": bn, "block_k": bk,
                                  "num_warps": cfg.num_warps, "pdl": pdl,
                                  "fused_ms": round(ms, 4)})
        print(f"config {spec}: {ms:.4f} ms", flush=True)
        if ms < best_ms:
            best, best_ms = cfg, ms
        del case
    result["config"] = {"block_n": best.block_n, "block_k": best.block_k,
                        "num_warps": best.num_warps, "pdl": best.pdl}

    cases = [(r, args.context) for r in rows_list]
    cases += [(max(rows_list), int(c)) for c in args.spread.split(",") if c]
    for kv in kvs:
        for rows, ctx in cases:
            contexts = [ctx] * rows
            case = Case(text, rows, contexts, kv, device, best, rows * 7 + ctx)
            with torch.inference_mode():
                today_ms = run(case.today)
                fused_ms = run(case.fused_step)
                today_again = run(case.today)
            row = {
                "kv": kv, "rows": rows, "context": ctx,
                "today_ms": round(today_ms, 4), "today_again_ms": round(today_again, 4),
                "fused_ms": round(fused_ms, 4), "splits": case.fused.splits,
                "kv_bytes": case.kv_bytes,
                "floor_datasheet_ms": round(floor_ms(case, DATASHEET_TB_S[card]), 4),
                "floor_copy_ms": round(floor_ms(case, measured), 4),
            }
            result["steps"].append(row)
            print(row, flush=True)
            if rows == rows_list[0] and ctx == args.context and kv == kvs[0] and not smoke:
                with torch.inference_mode():
                    for name, fn in (("today", case.today), ("fused", case.fused_step)):
                        graph, _ = graph_of(torch, fn)
                        result["kernels"][name] = {
                            k[:90]: [round(v[0], 2), round(v[1], 1)]
                            for k, v in profile_kernels(torch, graph, 10).items()}
                        del graph
            del case

    # numerics: distinct inputs, the same pool
    for kv in kvs:
        rows = max(rows_list)
        ctxs = [args.context // 2 + 97 * r for r in range(rows)]
        case = Case(text, rows, ctxs, kv, device, best, 12345)
        with torch.inference_mode():
            today = case.today().float().clone()
            again_today = case.today().float().clone()
            modules = case.modules().float().clone()
            # the fused step rewrites the same columns with the same values
            fused = case.fused_step().float().clone()
            again = case.fused_step().float().clone()
            case.tok = (torch.roll(case.tok, 1) + 1) % int(text.lm_head.weight.shape[0])
            other = case.fused_step().float().clone()
        row = {
            "kv": kv, "rows": rows, "contexts": ctxs,
            "max_abs_diff": float((fused - today).abs().max()),
            "logits_max_abs": float(today.abs().max()),
            "logits_std": float(today.std()),
            "argmax_agree": int((fused.argmax(-1) == today.argmax(-1)).sum()),
            "today_repeat_max_abs_diff": float((again_today - today).abs().max()),
            "modules_vs_today_max_abs_diff": float((modules - today).abs().max()),
            "fused_vs_modules_max_abs_diff": float((fused - modules).abs().max()),
            "repeat_max_abs_diff": float((again - fused).abs().max()),
            "distinct_inputs_max_abs_diff": float((other - fused).abs().max()),
        }
        result["numerics"].append(row)
        print(row, flush=True)
        del case

    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# The fused few-row decode step against today's (bench/fused_step.py)", "",
        f"`{result['command']}`", "",
        f"{gpu}, torch {torch.__version__}; weights read a step {weights / 1e9:.3f} GB; "
        f"floors at {DATASHEET_TB_S[card]} TB/s (datasheet) and {result['copy_tb_s']} TB/s "
        "(a device copy, read + write); GEMV blocks "
        f"{best.block_n}x{best.block_k}, {best.num_warps} warps, PDL {best.pdl}. Token ids to "
        "logits, one CUDA graph each.", "",
        "| pool | rows | context | today ms | again | fused ms | x floor (datasheet) | "
        "x floor (copy) | today / fused |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["steps"]:
        fd, fc = r["floor_datasheet_ms"], r["floor_copy_ms"]
        lines.append(
            f"| {r['kv']} | {r['rows']} | {r['context']} | {r['today_ms']:.3f} | "
            f"{r['today_again_ms']:.3f} | **{r['fused_ms']:.3f}** | "
            f"{r['fused_ms'] / fd if fd else 0:.2f}x (floor {fd:.3f}) | "
            f"{r['fused_ms'] / fc if fc else 0:.2f}x | {r['today_ms'] / r['fused_ms']:.2f}x |")
    lines += ["", "| pool | rows | fused vs today | modules vs today | fused vs modules | "
              "logits max abs | argmax agree | fused repeat | today repeat | distinct inputs |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["numerics"]:
        lines.append(f"| {r['kv']} | {r['rows']} | {r['max_abs_diff']:.4g} | "
                     f"{r['modules_vs_today_max_abs_diff']:.4g} | "
                     f"{r['fused_vs_modules_max_abs_diff']:.4g} | "
                     f"{r['logits_max_abs']:.3g} | {r['argmax_agree']}/{r['rows']} | "
                     f"{r['repeat_max_abs_diff']:.3g} | {r['today_repeat_max_abs_diff']:.3g} | "
                     f"{r['distinct_inputs_max_abs_diff']:.3g} |")
    for name, ks in result["kernels"].items():
        total = sum(v[0] for v in ks.values())
        count = sum(v[1] for v in ks.values())
        lines += ["", f"{name}: {count:.0f} kernels a step, {total:.1f} us of kernels "
                  "(profiled replays)", "", "| kernel | us a step | launches |", "|---|---:|---:|"]
        lines += [f"| `{k}` | {v[0]:.1f} | {v[1]:.0f} |"
                  for k, v in sorted(ks.items(), key=lambda x: -x[1][0])[:8]]
    (args.out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
