"""The decode step's greedy choice: the Triton kernels against the torch ops they replaced.

Why: at 256 slots the torch path's float32 passes over the (slots, vocab) logits took ~0.55 ms
of a 10.3 ms decode step (bench/results/loop_profile/), and they grow with the slots. This times
both on HunyuanOCR's vocabulary at the loop's graphed slot counts, with the repetition penalty's
mask and the eos ban as the loop applies them, and checks that they choose the same tokens.

    python bench/greedy_choice.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import cuda_us_back_to_back  # noqa: E402
from ocrq.models.hunyuan.greedy import greedy_next, greedy_scores  # noqa: E402


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=120818)
    ap.add_argument("--slots", default="8,64,256,512")
    ap.add_argument("--penalty", type=float, default=1.03)
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    eos = torch.tensor([120020, 120025], device=dev)
    results = []
    for slots in (int(x) for x in args.slots.split(",")):
        logits = (torch.randn(slots, args.vocab, device=dev) * 4).to(torch.bfloat16)
        seen = torch.rand(slots, args.vocab, device=dev) < 0.01
        count = torch.randint(0, 8, (slots,), device=dev)
        min_new = torch.randint(0, 8, (slots,), device=dev)
        inputs = (logits, seen, args.penalty, count, min_new, eos)
        cases = {
            "torch": lambda x=inputs: greedy_scores(*x).argmax(-1),
            "kernel": lambda x=inputs: greedy_next(*x),
        }
        same = bool(torch.equal(cases["torch"](), cases["kernel"]()))
        row = {"slots": slots, "same_tokens": same}
        for _ in range(2):  # alternated twice
            for name, fn in cases.items():
                us = cuda_us_back_to_back(torch, fn, args.reps)
                row.setdefault(name, []).append(round(us, 1))
        results.append(row)
        print(json.dumps(row), flush=True)
    gpu = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "greedy_choice_h200.json").write_text(json.dumps(
        {"gpu": gpu, "torch": torch.__version__, "vocab": args.vocab, "penalty": args.penalty,
         "results": results}, indent=1))
    lines = ["# The decode step's greedy choice: torch ops against one kernel "
             "(bench/greedy_choice.py)", "",
             f"`python bench/greedy_choice.py {' '.join(sys.argv[1:])}`", "",
             f"GPU: {gpu}; torch {torch.__version__}; bf16 logits over {args.vocab:,} ids, "
             f"penalty {args.penalty} on ~1% of ids, eos ban by row; CUDA events over "
             f"{args.reps} calls, each mode twice, alternated.", "",
             "| slots | torch us | kernel us | torch / kernel | same tokens |",
             "|---:|---:|---:|---:|---|"]
    for r in results:
        t, k = min(r["torch"]), min(r["kernel"])
        lines.append(f"| {r['slots']} | {'/'.join(map(str, r['torch']))} | "
                     f"{'/'.join(map(str, r['kernel']))} | {t / k:.1f} | {r['same_tokens']} |")
    (args.out / "greedy_choice_h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
