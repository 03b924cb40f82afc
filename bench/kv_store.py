"""The prefill's write of a pass's prompt keys and values into the running loop's pool, per layout.

Why: the fp8 pool's values lie transposed (ocrq/models/hunyuan/running.py), so the tokens axis
the prefill indexes is unit-stride in memory; indexed through that view, a copy writes each byte
of a value a pool width from its neighbour. `kv_cache.store` now writes through the view that
matches memory. This times one layer's write of one prefill pass (rows' prompts at their own
column ranges, from bf16) for: token-major (how keys and bf16 values are stored), transposed
written through the tokens view (before), transposed written through the memory view (now).

    python bench/kv_store.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import cuda_us_back_to_back  # noqa: E402
from ocrq.models.hunyuan.kv_cache import store, to_cache  # noqa: E402


def through_view(pool: Any, index: Any, x: Any) -> None:
    """The write before: index_copy_ along the view's token axis, whatever its stride."""
    import torch

    x = to_cache(x, pool.dtype)
    pool.view(torch.uint8).index_copy_(1, index, x.view(torch.uint8))


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pool-tokens", type=int, default=1_400_000)
    ap.add_argument("--prompts", type=int, nargs="*", default=[2300, 2300, 2300, 2300],
                    help="prompt tokens of each row in the pass (an A4 page: ~2,300)")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    heads, dim, width = args.kv_heads, args.head_dim, args.pool_tokens
    starts, at = [], 1000
    for n in args.prompts:  # rows spread over the pool, as the loop's allocator leaves them
        starts.append(at)
        at += n + width // (len(args.prompts) + 1)
    cols = [c for s, n in zip(starts, args.prompts, strict=True) for c in range(s, s + n)]
    columns = torch.tensor(cols, dtype=torch.long, device=dev)
    x = torch.randn(heads, len(cols), dim, dtype=torch.bfloat16, device=dev)
    rows = torch.zeros(1, heads, width, dim, dtype=torch.float8_e4m3fn, device=dev)
    transposed = torch.zeros(1, heads, dim, width, dtype=torch.float8_e4m3fn, device=dev)
    transposed = transposed.transpose(2, 3)
    cases = {
        "token-major, store": lambda: store(rows[0], 1, columns, x),
        "transposed, through the tokens view (before)": lambda: through_view(
            transposed[0], columns, x),
        "transposed, store (now)": lambda: store(transposed[0], 1, columns, x),
    }
    results = []
    for name, fn in cases.items():
        us = cuda_us_back_to_back(torch, fn, args.reps)
        results.append({"case": name, "us_per_layer": round(us, 1),
                        "bytes": len(cols) * heads * dim})
        print(json.dumps(results[-1]), flush=True)
    a = rows.float()[0, :, columns]
    b = transposed.float()[0, :, columns]
    equal = bool(torch.equal(a, b))
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    (args.out / "kv_store_h200.json").write_text(json.dumps(
        {"gpu": gpu, "torch": torch.__version__, "args": vars(args) | {"out": str(args.out)},
         "results": results, "layouts_equal": equal}, indent=1))
    lines = [
        "# One layer's prompt write into the pool, per layout (bench/kv_store.py)", "",
        f"`python bench/kv_store.py {' '.join(sys.argv[1:])}`", "",
        f"GPU: {gpu}; torch {torch.__version__}; fp8 pool of {width:,} tokens x {heads} KV heads"
        f" x {dim}; one pass of {len(args.prompts)} prompts ({len(cols):,} tokens) from bf16;"
        f" CUDA events over {args.reps} reps. Both transposed writes hold what the token-major"
        f" pool holds: {equal}.", "",
        "| case | us a layer | GB/s of fp8 written |", "|---|---:|---:|",
    ]
    for r in results:
        rate = r["bytes"] / r["us_per_layer"] / 1e3
        lines.append(f"| {r['case']} | {r['us_per_layer']} | {rate:.0f} |")
    (args.out / "kv_store_h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
