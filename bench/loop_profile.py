"""Where a decode step of the running loop spends its GPU time, with the loop full of A4 pages.

Why: in the service's A4 runs a decode step over ~400 rows took ~21.7 ms of GPU (run 20:
145.5 s over 6,712 steps), while the decode attention alone measured ~16 ms for that many rows
(bench/kv_attention.py); what the rest is, and how far each part is from its floor, decides the
next lever of issue 29. This fills one running loop (the service's settings, fp8 pool by
default) with A4-sized rows until none waits, then profiles decode steps only (no prefill pass
runs: every row is admitted and none ends) with torch.profiler, CUDA graphs replayed as the
service replays them, and groups the kernels: the attention (split + merge), the GEMMs, the fused
norm/RoPE kernels, and the rest.

    PYTHONUNBUFFERED=1 python bench/loop_profile.py --out OUT
    python bench/loop_profile.py --out /tmp/lp --smoke  # tiny model on the CPU: the path runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_model_args, page_image, random_checkpoint  # noqa: E402
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.hunyuan import HunyuanLoopEngine  # noqa: E402
from ocrq.models.hunyuan import running as running_module  # noqa: E402
from ocrq.models.hunyuan import text as text_module  # noqa: E402
from ocrq.models.hunyuan.loop_types import LoopRow  # noqa: E402
from ocrq.models.hunyuan.running import RunningLoop  # noqa: E402
from ocrq.models.slots import RunningBudget  # noqa: E402

GiB = 1024**3
HBM_TB_S = 4.8  # the H200's datasheet bandwidth (the floors' figure, bench/floors.py)


def datasheet_tb_s(gpu: str) -> float:
    """The floors' bandwidth for the card the profile ran on: an H100 SXM (HBM3) reads 3.35
    TB/s, where the H200's 4.8 would put its floors ~30% too low."""
    return 3.35 if "H100" in gpu else HBM_TB_S


GROUPS = (  # first match wins: (group, substrings of a kernel's name)
    ("attention", ("split_kernel", "merge_kernel")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "splitkreduce")),
    ("norm/rope", ("rms_norm",)),
    ("sampling", ("greedy", "argmax", "reduce_kernel", "scatter", "gather", "index", "sort",
                  "topk")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="loop_profile_h200")
    ap.add_argument("--version", choices=("1.0", "1.5"), default="1.5")
    ap.add_argument("--kv-dtype", choices=("auto", "fp8"), default="fp8")
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--budget-gib", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=30, help="decode steps profiled")
    ap.add_argument("--size", default="1248x1760", help="each row's page, WxH")
    ap.add_argument("--work", type=Path, default=Path("/tmp/loop_profile_work"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--greedy", choices=("triton", "torch"), default="triton",
                    help="the step's greedy choice: one kernel (ocrq/models/hunyuan/greedy.py, "
                         "the default) or the torch ops before it")
    ap.add_argument("--merged", choices=("on", "off"), default="on",
                    help="the fused step's merged q/k/v and gate/up projections "
                         "(ocrq/models/hunyuan/merged.py) or the modules one by one")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.device, args.dtype = "tiny", "cpu", "float32"
        args.rows, args.slots, args.budget_gib, args.steps = 6, 8, 8.0, 4
        args.kv_dtype = "auto"  # the CPU widens an fp8 pool slowly
        args.size = "160x224"
    args.out.mkdir(parents=True, exist_ok=True)
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device.startswith("cuda")
    ckpt = random_checkpoint(args.work, args, args.version)
    new_tokens = 1200  # rows' capacity: 400 A4 rows fit an fp8 pool, 250 a bf16 one
    settings = Settings(model=str(ckpt), model_subfolder=None, device=args.device,
                        dtype=args.dtype, max_new_tokens=new_tokens, kv_cache_dtype=args.kv_dtype)
    text_module.MERGED_PROJECTIONS = args.merged == "on"
    engine = HunyuanLoopEngine(settings, decode="fast")
    engine.load()
    model = engine.cost_model()
    # The pool token in the loop's KV dtype, as `HunyuanLoopEngine.open` plans it (the committed
    # runs planned with the model dtype's: a smaller pool than fp8 allows, which 250 rows fit).
    running = RunningBudget.plan(engine.loop_cost_model(model),
                                 int(args.budget_gib * GiB) - model.fixed_bytes,
                                 slots=args.slots, prefill_tokens=settings.prefill_chunk_tokens,
                                 state_bytes_per_slot=engine.state_bytes_per_slot())
    running_module.FUSED_GREEDY = args.greedy == "triton"
    loop = RunningLoop(engine._decoder, engine.tokens, engine.loop_config(running))
    w, h = (int(x) for x in args.size.split("x"))
    item = PreparedImage(key="page", image=page_image(w, h), original_size=(w, h), task="parse")
    engine.prepare(item)
    assert item.encoded is not None
    prompt = int(item.encoded.input_ids.shape[0])
    rows = min(args.rows, running.slots)
    # Every row runs to max_new_tokens: none ends, so no pass is needed while profiling.
    loop.add([LoopRow(str(i), item.encoded, new_tokens, min_new_tokens=new_tokens)
              for i in range(rows)])
    t0 = time.perf_counter()
    for _ in range(2000):  # admit all (prefill passes between steps)
        if not loop.waiting and loop.live >= rows:
            break
        loop.run(0.0)
    else:
        raise SystemExit(f"the pool admitted {loop.live} of {rows} rows: ask for fewer")
    for _ in range(10):  # every bucket's graph seen, the pipeline full
        loop.run(0.0)
    fill_s = time.perf_counter() - t0
    stats = loop.collect_stats(wait=True)  # the loop's own object: read its numbers now
    steps0, decode0, prefills0 = stats.steps, stats.decode_s, stats.prefills
    context_before = prompt + steps0  # every row started within the fill
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            loop.run(0.0)
        if cuda:
            torch.cuda.synchronize()
    after = loop.collect_stats(wait=True)
    steps = after.steps - steps0
    assert after.prefills == prefills0, "a prefill pass ran while profiling"

    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0)
        if us and ev.device_type.name == "CUDA":
            kernels[ev.key][0] += us
            kernels[ev.key][1] += ev.count
    groups: dict[str, float] = defaultdict(float)
    for name, (us, _) in kernels.items():
        groups[group_of(name)] += us
    total_us = sum(groups.values())
    per_step = {g: round(us / 1000 / max(steps, 1), 3) for g, us in groups.items()}
    text = engine._decoder.text
    layers = len(text.layers)
    kv_itemsize = 1 if args.kv_dtype == "fp8" else 2
    context = context_before + steps / 2
    kv_bytes_step = rows * context * layers * 2 * text.kv_heads * text.head_dim * kv_itemsize
    weights = sum(p.numel() * p.element_size() for p in engine._decoder.text.model.parameters()
                  if p.device.type == (args.device.split(":")[0]))
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu"
    tb_s = datasheet_tb_s(gpu)
    result: dict[str, Any] = {
        "command": " ".join(["python", "bench/loop_profile.py", *sys.argv[1:]]),
        "gpu": gpu,
        "torch": torch.__version__,
        "kv_dtype": args.kv_dtype, "greedy": args.greedy, "merged": args.merged, "rows": rows,
        "slots": running.slots,
        "prompt_tokens": prompt, "mean_context": round(context), "layers": layers,
        "steps_profiled": steps, "fill_s": round(fill_s, 1),
        "loop_gpu_ms_per_step": round((after.decode_s - decode0) * 1000 / max(steps, 1), 3),
        "profiled_gpu_ms_per_step": round(total_us / 1000 / max(steps, 1), 3),
        "ms_per_step_by_group": per_step,
        "attention_us_per_row_layer": round(groups["attention"] / max(steps, 1) / rows / layers, 3),
        "hbm_tb_s": tb_s,
        "kv_floor_ms_per_step": round(kv_bytes_step / (tb_s * 1e12) * 1000, 3),
        "model_bytes": weights,
        "weights_floor_ms_per_step": round(weights / (tb_s * 1e12) * 1000, 3),
        "top_kernels": sorted(
            ({"name": k[:110], "ms_per_step": round(us / 1000 / max(steps, 1), 3),
              "calls_per_step": round(n / max(steps, 1), 1), "group": group_of(k)}
             for k, (us, n) in kernels.items()),
            key=lambda r: -r["ms_per_step"])[:25],
    }
    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=1))
    r = result
    lines = [
        "# A decode step of the running loop, full of A4 pages (bench/loop_profile.py)", "",
        f"`{r['command']}`", "",
        f"{r['gpu']}, torch {r['torch']}; {r['kv_dtype']} KV pool; greedy choice: "
        f"{r['greedy']}; merged projections: {r['merged']}; {r['rows']} rows of "
        f"{r['prompt_tokens']} prompt tokens ({args.size}), mean context {r['mean_context']}; "
        f"{r['steps_profiled']} decode steps profiled, no prefill pass among them.", "",
        f"GPU per step: {r['loop_gpu_ms_per_step']} ms by the loop's CUDA events, "
        f"{r['profiled_gpu_ms_per_step']} ms of kernels under the profiler. Floors at "
        f"{r.get('hbm_tb_s', HBM_TB_S)} TB/s: the KV read {r['kv_floor_ms_per_step']} ms, "
        "the weights (read once a "
        f"step) {r['weights_floor_ms_per_step']} ms. Decode attention: "
        f"{r['attention_us_per_row_layer']} us per row and layer.", "",
        "| group | ms per step | share |", "|---|---:|---:|",
    ]
    for g, ms in sorted(per_step.items(), key=lambda x: -x[1]):
        lines.append(f"| {g} | {ms:.3f} | {100 * ms / max(sum(per_step.values()), 1e-9):.1f}% |")
    lines += ["", "| kernel | group | ms per step | calls per step |", "|---|---|---:|---:|"]
    lines += [f"| `{k['name']}` | {k['group']} | {k['ms_per_step']:.3f} | "
              f"{k['calls_per_step']} |" for k in r["top_kernels"]]
    (args.out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
