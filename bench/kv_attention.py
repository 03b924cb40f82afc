"""The running loop's decode attention alone: bf16 against fp8 KV pools, per kernel config.

Why: with an fp8 pool the A4 pages' decode step read half the bytes, yet a row-step cost 69 us
against 76 us in bf16 (bench/results/continuous_batching/continuous_batching_h200_a4_fp8_before.md),
far from half. This runs only the split-K kernel (ocrq/models/hunyuan/attention.py) over a pool laid
out as the loop lays it out (one (1, KV heads, tokens, D) pool per layer, rows at their own offsets,
batch stride 0), with each row's keys as long as an A4 page's mid-decode context, and reports the
time of one layer's call and the bandwidth it reaches, so the config each dtype needs can be chosen
by measurement.

    python bench/kv_attention.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import cuda_us_back_to_back, cuda_us_graphed  # noqa: E402
from ocrq.models.hunyuan.attention import (  # noqa: E402
    DEFAULT_CONFIG,
    FP8_CONFIG,
    PAD_KEYS,
    KernelConfig,
    TritonDecodeAttention,
    attend_torch,
)
from ocrq.models.hunyuan.kv_cache import padded_width, zero_pool  # noqa: E402

CONFIGS = (
    KernelConfig(),
    KernelConfig(block_n=128, num_warps=4),
    KernelConfig(block_n=128, num_warps=8),
    KernelConfig(block_n=256, num_warps=8, num_stages=2),
    KernelConfig(block_n=64, num_warps=8, num_stages=4),
    KernelConfig(block_n=128, num_warps=4, num_stages=4),
)
# --sweep: an fp8 pool's launch parameters beyond CONFIGS: more, shorter key ranges (less tail
# when rows' lengths differ), two warps, two stages (more programs resident).
SWEEP_CONFIGS = (
    KernelConfig(block_n=128),
    KernelConfig(block_n=128, programs_per_sm=8),
    KernelConfig(block_n=128, programs_per_sm=16),
    KernelConfig(block_n=64, num_warps=2),
    KernelConfig(block_n=128, num_warps=2),
    KernelConfig(block_n=128, num_stages=2),
    KernelConfig(block_n=64, num_stages=2, programs_per_sm=8),
)
# --stages: the sweep's trend (fewer keys and warps a program, three stages beating two) carried
# on: deeper pipelines and narrower programs, for both pools.
STAGE_CONFIGS = (
    KernelConfig(block_n=64, num_warps=2),
    KernelConfig(block_n=64, num_warps=2, num_stages=4),
    KernelConfig(block_n=64, num_warps=2, num_stages=5),
    KernelConfig(block_n=64, num_warps=2, num_stages=6),
    KernelConfig(block_n=32, num_warps=1, num_stages=4),
    KernelConfig(block_n=32, num_warps=1, num_stages=6),
    KernelConfig(block_n=32, num_warps=2, num_stages=6),
    KernelConfig(block_n=64, num_warps=4, num_stages=4),
    KernelConfig(),
    KernelConfig(num_stages=4),
)


def case(torch: Any, rows: int, context: int, dtype: Any, config: KernelConfig, reps: int,
         pool_slots: int = 0, capacity: int = 0, layout: str = "rows",
         graphed: bool = False) -> dict[str, Any]:
    """`pool_slots` > 0: the rows sit in random slots of a pool of that many slots of
    `capacity` tokens, as the running loop's rows do (else packed one after another).
    `layout` "pool": the running loop's fp8 pool (values stored transposed, PAD_KEYS readable
    keys past the end, the kernel's `padded` loads), whatever the dtype; "rows": values
    token-major, masked loads (the loop's bf16 pool). `graphed`: also the time of the same calls
    replayed from one CUDA graph (`us_graphed`), as the loop runs them."""
    heads, kv_heads, dim = 16, 8, 128  # HunyuanOCR's text decoder
    g = torch.Generator(device="cuda").manual_seed(rows)
    lengths = (context + (torch.rand(rows, generator=g, device="cuda") - 0.5) * context * 0.4)
    lengths = lengths.int()
    if pool_slots:
        slots = torch.randperm(pool_slots, generator=g, device="cuda")[:rows]
        starts = (slots * capacity).int()
        width = pool_slots * capacity + 1
    else:
        starts = torch.cat([torch.zeros(1, device="cuda", dtype=torch.int64),
                            lengths.long().cumsum(0)[:-1]]).int()
        width = int(lengths.sum()) + 1
    padded = layout == "pool"
    if padded:  # as ocrq/models/hunyuan/running.py allocates it
        full = padded_width(width, PAD_KEYS)
        pool_k = zero_pool(kv_heads, full, dim, dtype, "cuda")
        pool_k[:, :, :width] = torch.randn(1, kv_heads, width, dim, device="cuda").to(dtype)
        pool_v = zero_pool(kv_heads, full, dim, dtype, "cuda", transposed=True)
        pool_v[:, :, :width] = torch.randn(1, kv_heads, width, dim, device="cuda").to(dtype)
        width = full
    else:
        pool_k = torch.randn(1, kv_heads, width, dim, device="cuda").to(dtype)
        pool_v = torch.randn(1, kv_heads, width, dim, device="cuda").to(dtype)
    q = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    ends = (starts + lengths).int()
    shape = (rows, kv_heads, width, dim)
    attention = TritonDecodeAttention(rows, heads, kv_heads, dim, width, "cuda", config,
                                      padded=padded)
    call = lambda: attention(q, pool_k.expand(shape), pool_v.expand(shape), starts, ends,  # noqa: E731
                             dim**-0.5)
    error = accuracy(torch, call(), q, pool_k, pool_v, starts, ends, dim**-0.5)
    us = cuda_us_back_to_back(torch, call, reps)
    read = int(lengths.sum()) * kv_heads * dim * 2 * pool_k.element_size()
    timed = {}
    if graphed:
        us_graphed = cuda_us_graphed(torch, call, reps)
        timed = {"us_graphed": us_graphed, "gb_per_s_graphed": read / us_graphed / 1e3}
    return {"rows": rows, "context": context, "dtype": str(dtype).replace("torch.", ""),
            "pool": (f"{pool_slots} slots x {capacity}" if pool_slots else "packed")
            + (", transposed values, padded" if padded else ""),
            "config": str(config).replace("KernelConfig", ""), "us": us,
            "us_per_row": us / rows, "gb_per_s": read / us / 1e3, "splits": attention.splits,
            "rel_error": error, **timed}


def accuracy(torch: Any, out: Any, q: Any, pool_k: Any, pool_v: Any, starts: Any, ends: Any,
             scale: float, rows: int = 16) -> float:
    """Relative L2 error of the first rows' output against the float32 reference over the same
    stored keys and values (what the kernel's bf16/fp16 products and its merge cost)."""
    errs = []
    for b in range(min(rows, q.shape[0])):
        lo, hi = int(starts[b]), int(ends[b])
        k = pool_k[:, :, lo:hi].float()
        v = pool_v[:, :, lo:hi].float()
        valid = torch.ones(1, hi - lo, dtype=torch.bool, device=q.device)
        ref = attend_torch(q[b:b + 1].float(), k, v, valid, scale)
        errs.append(float((out[b:b + 1].float() - ref).norm() / ref.norm()))
    return max(errs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="kv_attention_h200")
    ap.add_argument("--rows", default="176,256,512")
    ap.add_argument("--context", type=int, default=2800)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true",
                    help="fp8 pools only, at SWEEP_CONFIGS")
    ap.add_argument("--spread", default="",
                    help="SLOTSxCAPACITY: each case also with its rows in random slots of a pool "
                         "of that shape, as the running loop places them (e.g. 512x4400)")
    ap.add_argument("--stages", action="store_true",
                    help="both pools at STAGE_CONFIGS (deeper pipelines, narrower programs)")
    ap.add_argument("--loop-configs", action="store_true",
                    help="each pool dtype at the config the running loop gives it only")
    ap.add_argument("--exp2", action="store_true",
                    help="each pool dtype at the loop's config, with exp of scaled scores and "
                         "with exp2 (KernelConfig.exp2), alternated twice")
    ap.add_argument("--row-splits", action="store_true",
                    help="the fp8 pool at its loop config, key ranges split at fixed pool "
                         "columns and within each row (KernelConfig.row_splits), alternated "
                         "twice")
    ap.add_argument("--fp8-products", action="store_true",
                    help="the fp8 pool at its loop config, widened to fp16 and multiplied in "
                         "e4m3 (KernelConfig.fp8_products), alternated twice, then e4m3 at four "
                         "other configs: time and error")
    ap.add_argument("--layouts", default="rows",
                    help="comma-separated: rows (values token-major, masked loads: the loop's "
                         "bf16 pool), pool (values transposed, padded: the loop's fp8 pool), "
                         "each for both dtypes; side by side")
    ap.add_argument("--graphed", action="store_true",
                    help="also time each case's calls replayed from one CUDA graph (the loop's "
                         "way: no host launch between calls), beside the back-to-back figure")
    args = ap.parse_args()

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.perf_counter()
    for rows in (int(x) for x in args.rows.split(",")):
        if args.sweep:
            plan = [(torch.float8_e4m3fn, c) for c in SWEEP_CONFIGS]
        elif args.stages:
            plan = [(d, c) for d in (torch.float8_e4m3fn, torch.bfloat16) for c in STAGE_CONFIGS]
        elif args.exp2:
            plan = [(d, replace(c, exp2=e)) for e in (False, True, False, True)
                    for d, c in ((torch.bfloat16, DEFAULT_CONFIG),
                                 (torch.float8_e4m3fn, FP8_CONFIG))]
        elif args.row_splits:
            plan = [(torch.float8_e4m3fn, replace(FP8_CONFIG, row_splits=r))
                    for r in (False, True, False, True)]
        elif args.fp8_products:
            plan = [(torch.float8_e4m3fn, replace(FP8_CONFIG, fp8_products=f))
                    for f in (False, True, False, True)]
            # products in fp8 halve a tile's registers: the block and warps may want to change
            plan += [(torch.float8_e4m3fn, replace(FP8_CONFIG, fp8_products=True, **kw))
                     for kw in ({"block_n": 64}, {"block_n": 256},
                                {"block_n": 256, "num_warps": 8}, {"num_stages": 4})]
        elif args.loop_configs:
            plan = [(torch.bfloat16, DEFAULT_CONFIG), (torch.float8_e4m3fn, FP8_CONFIG)]
        else:
            plan = [(d, c) for d in (torch.bfloat16, torch.float8_e4m3fn) for c in CONFIGS]
        pools = [(0, 0)]
        if args.spread:
            slots, capacity = (int(x) for x in args.spread.split("x"))
            pools.append((slots, capacity))
        for dtype, config in plan:
            for (pool_slots, capacity), layout in (
                (p, lay) for p in pools for lay in args.layouts.split(",")
            ):
                try:
                    r = case(torch, rows, args.context, dtype, config, args.reps, pool_slots,
                             capacity, layout, args.graphed)
                except Exception as exc:  # a mode that does not compile here is a finding too
                    r = {"rows": rows, "context": args.context, "config": str(config),
                         "dtype": str(dtype).replace("torch.", ""), "error": repr(exc)[:300]}
                results.append(r)
                print(r, flush=True)
                torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    lines = [f"# Decode attention alone over the running loop's pool ({gpu})",
             "", f"torch {torch.__version__}; one layer's call; rows' contexts {args.context} "
             "+-20%; HunyuanOCR's 16 query / 8 KV heads of 128. Command: `python "
             f"bench/kv_attention.py {' '.join(sys.argv[1:])}`.", "",
             "| rows | KV dtype | pool | config | us | us per row | GB/s read | splits "
             "| rel. error |" + (" us graphed | GB/s graphed |" if args.graphed else ""),
             "|---:|---|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.graphed
                                                             else "")]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['rows']} | {r['dtype']} | | {r['config']} | failed: "
                         f"{r['error'][:120]} | | | | |" + (" | |" if args.graphed else ""))
            continue
        graphed = (f" {r['us_graphed']:.1f} | {r['gb_per_s_graphed']:.0f} |"
                   if args.graphed else "")
        lines.append(f"| {r['rows']} | {r['dtype']} | {r['pool']} | {r['config']} | "
                     f"{r['us']:.0f} | {r['us_per_row']:.2f} | {r['gb_per_s']:.0f} | "
                     f"{r['splits']} | {r['rel_error']:.4f} |{graphed}")
    (args.out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{args.stem}.json").write_text(json.dumps(
        {"results": results, "seconds": time.perf_counter() - t0}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
