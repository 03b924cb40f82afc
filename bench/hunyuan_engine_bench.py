"""GPU benchmark of HunyuanEngine: seconds, peak memory and throughput per page size and batch.

Why random weights: speed and memory depend on shapes, not on weight values, and the benchmark
must run where no checkpoint can be downloaded. The script writes a random-weight checkpoint of
the full HunyuanOCR-1.0 shape (ocrq/testing/tiny_hunyuan.py, HUNYUAN_OCR_1_0) to a temp dir and
loads it through `HunyuanEngine.load`, so every number comes from the engine's own code path
(processor, left-padded collation, generate). Every run forces 256 new tokens
(min_new_tokens = max_new_tokens) so runs compare with each other and with the baseline.

Per run it records: total seconds, preprocessing seconds (measured once per page size per
image, then reused, as the prefetch threads would do it), prefill seconds and decode ms/step
(from a forward hook on the model), peak allocated and reserved GiB, the memory increment over
the loaded model and its share per image (input for the cost-model fit), images/s and
generated tokens/s. A series for one page size stops when the next batch would exceed the time
budget or the device memory, or once a batch takes longer than --max-batch-s.

    PYTHONUNBUFFERED=1 python bench/hunyuan_engine_bench.py --out bench/results/hunyuan_engine_bench
    python bench/hunyuan_engine_bench.py --shape tiny --device cpu --new-tokens 4 \\
        --batches 1,2,4 --out /tmp/bench   # smoke test without a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    PAGES,
    StepClock,
    add_model_args,
    page_image,
    random_checkpoint,
    run_meta,
)
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.hunyuan import HunyuanEngine  # noqa: E402

GiB = 1024**3


@dataclass
class Run:
    page: str
    width: int
    height: int
    batch: int
    new_tokens: int
    seconds: float  # preprocessing (batch x per-image) + generate
    preprocess_s: float
    generate_s: float
    prefill_s: float  # start of generate to the end of the first forward (vision + prefill)
    decode_ms_per_step: float
    peak_allocated_gib: float
    peak_reserved_gib: float
    prefill_peak_allocated_gib: float
    increment_gib: float  # peak allocated minus allocated before the run
    increment_per_image_gib: float
    images_per_s: float
    generate_images_per_s: float
    generated_tokens_per_s: float
    item_tokens: int  # engine.estimate(item).tokens: prompt + image + max_new_tokens
    item_patches: int
    padded_prompt: int


@dataclass
class Report:
    meta: dict[str, Any] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    stops: list[dict[str, Any]] = field(default_factory=list)


def write(report: Report, out: Path, stem: str) -> None:
    (out / f"{stem}.json").write_text(json.dumps(asdict(report), indent=1))
    (out / f"{stem}.md").write_text(markdown(report))


def markdown(report: Report) -> str:
    m = report.meta
    lines = [
        f"# HunyuanEngine on {m.get('gpu', m.get('device'))}: random weights, "
        f"{m.get('shape')} shape",
        "",
        f"torch {m.get('torch')}, transformers {m.get('transformers')}, {m.get('dtype')}, "
        f"{m.get('attention')} attention, {m.get('new_tokens')} new tokens forced per image. "
        f"Weights {m.get('weights_gib', 0):.2f} GiB allocated; device memory in use after load "
        f"{m.get('device_used_after_load_gib', 0):.2f} GiB (CUDA context included). "
        f"Command: `{m.get('command')}`.",
        "",
        "seconds = preprocessing (batch x measured per-image time) + generate; images/s on that "
        "total; gen img/s and tokens/s on generate alone. +GiB/img = (peak allocated - "
        "allocated before the run) / batch.",
        "",
        "| page | batch | seconds | preprocess s | prefill s | decode ms/step | peak alloc GiB "
        "| peak reserved GiB | +GiB/img | img/s | gen img/s | gen tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.runs:
        lines.append(
            f"| {r.page} | {r.batch} | {r.seconds:.2f} | {r.preprocess_s:.2f} | "
            f"{r.prefill_s:.2f} | {r.decode_ms_per_step:.1f} | {r.peak_allocated_gib:.2f} | "
            f"{r.peak_reserved_gib:.2f} | {r.increment_per_image_gib:.3f} | "
            f"{r.images_per_s:.2f} | {r.generate_images_per_s:.2f} | "
            f"{r.generated_tokens_per_s:.0f} |"
        )
    if report.stops:
        lines += ["", "Series ended early:", ""]
        lines += [f"- {s['page']}: {s['reason']}" for s in report.stops]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="hunyuan_engine_h200")
    add_model_args(ap)
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--pages", default=",".join(PAGES))
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=400.0, help="for all series together")
    ap.add_argument("--max-batch-s", type=float, default=60.0)
    ap.add_argument("--memory-share", type=float, default=0.92, help="of the device's memory")
    args = ap.parse_args()

    import torch

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    report = Report()
    report.meta = {**run_meta(args, "bench/hunyuan_engine_bench.py"), "device": args.device,
                   "attention": args.attention, "new_tokens": args.new_tokens}

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        ckpt = random_checkpoint(Path(tmp), args)
        report.meta["build_s"] = round(time.perf_counter() - t, 1)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free0, total = torch.cuda.mem_get_info()
        settings = Settings(
            model=str(ckpt),
            model_subfolder=None,
            dtype=args.dtype,
            device=args.device,
            attention=args.attention,
            max_new_tokens=args.new_tokens,
        )
        engine = HunyuanEngine(settings)
        t = time.perf_counter()
        engine.load()
        report.meta["load_s"] = round(time.perf_counter() - t, 1)
        if cuda:
            free1, _ = torch.cuda.mem_get_info()
            report.meta["weights_gib"] = torch.cuda.memory_allocated() / GiB
            report.meta["device_used_after_load_gib"] = (total - free1) / GiB
            report.meta["load_took_gib"] = (free0 - free1) / GiB
            report.meta["device_total_gib"] = total / GiB
        params = sum(p.numel() for p in engine.model.parameters())
        report.meta["parameters"] = params
        print(f"built in {report.meta['build_s']} s, loaded in {report.meta['load_s']} s, "
              f"{params / 1e9:.3f} B parameters", flush=True)

        clock = StepClock(torch, args.device)
        engine.model.register_forward_hook(clock)
        warm = PreparedImage("warm", page_image(512, 512), (512, 512))
        engine.generate([warm, warm], max_new_tokens=4, min_new_tokens=4)

        pages = [p for p in args.pages.split(",") if p]
        batches = [int(b) for b in args.batches.split(",")]
        budget_end = started + args.budget_s
        for n, page in enumerate(pages):
            width, height = PAGES[page]
            image = page_image(width, height)
            item = PreparedImage(page, image, (width, height))
            cost = engine.estimate(item)
            t = time.perf_counter()
            row = engine.preprocess(item)
            per_image_pre = time.perf_counter() - t
            # An equal share of what is left, so a short series leaves time to the next ones.
            page_end = time.perf_counter() + (budget_end - time.perf_counter()) / (len(pages) - n)
            last: Run | None = None
            for batch in batches:
                now = time.perf_counter()
                if last is not None:
                    grow = batch / last.batch
                    fixed = last.preprocess_s + last.prefill_s
                    guess = fixed * grow + (last.generate_s - last.prefill_s) * 1.2
                    if now + guess > page_end:
                        report.stops.append({"page": page, "reason": f"batch {batch} would take "
                                             f"~{guess:.0f} s, past this series' time budget"})
                        break
                    if last.seconds > args.max_batch_s:
                        report.stops.append({"page": page, "reason": f"batch {last.batch} took "
                                             f"{last.seconds:.0f} s > {args.max_batch_s:.0f} s"})
                        break
                    if cuda:
                        need = report.meta["weights_gib"] + grow * last.increment_gib
                        if need > args.memory_share * report.meta["device_total_gib"]:
                            report.stops.append({"page": page, "reason": f"batch {batch} would "
                                                 f"need ~{need:.0f} GiB"})
                            break
                items = [item] * batch
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                clock.reset()
                try:
                    out = engine.generate(
                        items,
                        encoded=[row] * batch,
                        max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens,
                    )
                except torch.OutOfMemoryError as exc:
                    reason = f"batch {batch}: out of memory ({exc})"[:300]
                    report.stops.append({"page": page, "reason": reason})
                    torch.cuda.empty_cache()
                    break
                if cuda:
                    torch.cuda.synchronize()
                gen_s = out.timings["generate"] + out.timings["preprocess"]  # collate + copy
                steps = [len(g.token_ids) for g in out.items]
                assert all(s == args.new_tokens for s in steps), steps
                prefill = clock.stamps[0] - clock.started
                decode_ms = (
                    (clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1) * 1e3
                    if len(clock.stamps) > 1 else 0.0
                )
                peak = torch.cuda.max_memory_allocated() if cuda else 0
                reserved = torch.cuda.max_memory_reserved() if cuda else 0
                increment = (peak - before) / GiB if cuda else 0.0
                pre_s = per_image_pre * batch
                last = Run(
                    page=page, width=width, height=height, batch=batch,
                    new_tokens=args.new_tokens,
                    seconds=pre_s + gen_s, preprocess_s=pre_s, generate_s=gen_s,
                    prefill_s=prefill, decode_ms_per_step=decode_ms,
                    peak_allocated_gib=peak / GiB, peak_reserved_gib=reserved / GiB,
                    prefill_peak_allocated_gib=clock.prefill_peak / GiB,
                    increment_gib=increment, increment_per_image_gib=increment / batch,
                    images_per_s=batch / (pre_s + gen_s), generate_images_per_s=batch / gen_s,
                    generated_tokens_per_s=batch * args.new_tokens / gen_s,
                    item_tokens=cost.tokens, item_patches=cost.patches,
                    padded_prompt=out.padded_length,
                )
                report.runs.append(last)
                write(report, args.out, args.stem)
                print(f"{page} b={batch}: {last.seconds:.2f} s (gen {gen_s:.2f}, prefill "
                      f"{prefill:.2f}, {decode_ms:.1f} ms/step) peak {last.peak_allocated_gib:.2f}"
                      f" GiB (+{last.increment_per_image_gib:.3f}/img) "
                      f"{last.images_per_s:.2f} img/s", flush=True)
        report.meta["total_s"] = round(time.perf_counter() - started, 1)
        write(report, args.out, args.stem)
        print(markdown(report), flush=True)


if __name__ == "__main__":
    main()
