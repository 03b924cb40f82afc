"""Static batches against the running loop (continuous batching) on one GPU, in one call.

Why one script: the lease is short, so one call measures what issue 14 asks: the same realistic
workload (word crops of a few tokens, receipts of hundreds, A4 pages of ~1,100) through
(1) the static fast loop, batches of --batch in arrival order, each running to its longest row,
and (2) the running loop under each prefill schedule ("alternate", "chunked"): images/s,
tokens/s, the GPU's busy share (sampled by NVML while each run lasts), the latency of short jobs
(p50/p95 from the moment all jobs were queued) and the peak memory against the running budget's
prediction. Each part is written to --out as soon as it exists (bench/common.py `run_part`).

Lengths: random weights do not end rows by themselves, so every row gets a drawn length and runs
exactly to it (eos banned before it; the static loop forces its batch's longest). Drawn per
class from a log-normal around the class's median (--crop-tokens, --receipt-tokens,
--a4-tokens), the mix set by --mix.

    PYTHONUNBUFFERED=1 python bench/continuous_batching.py --out bench/results/continuous_batching
    python bench/continuous_batching.py --smoke --out /tmp/cb   # tiny model on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_model_args, page_image, random_checkpoint, run_meta, run_part  # noqa: E402
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.hunyuan import HunyuanLoopEngine  # noqa: E402
from ocrq.models.hunyuan.loop_types import LoopRow  # noqa: E402
from ocrq.models.hunyuan.patches import batch_vision_attention  # noqa: E402
from ocrq.models.hunyuan.running import RunningLoop  # noqa: E402
from ocrq.models.hunyuan.vision_attention import fa4_kernel  # noqa: E402
from ocrq.models.slots import RunningBudget  # noqa: E402

GiB = 1024**3
CLASSES = {  # name: (size, default median new tokens)
    "crop": ((240, 64), 12),
    "receipt": ((886, 1699), 300),
    "a4": ((1248, 1760), 1100),
}
SHORT = ("crop", "receipt")


class Report:
    def __init__(self, out: Path, stem: str) -> None:
        self.out, self.stem = out, stem
        self.data: dict[str, Any] = {"meta": {}, "workload": {}, "runs": [], "errors": []}

    def write(self) -> None:
        (self.out / f"{self.stem}.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / f"{self.stem}.md").write_text(markdown(self.data))


class BusySampler:
    """GPU utilisation (NVML's share of time a kernel ran) sampled every 20 ms in a thread."""

    def __init__(self, torch: Any, cuda: bool) -> None:
        self.torch, self.cuda, self.samples = torch, cuda, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(float(self.torch.cuda.utilization()))
            except Exception:
                return
            time.sleep(0.02)

    def __enter__(self) -> BusySampler:
        if self.cuda:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def share(self) -> float | None:
        return statistics.mean(self.samples) / 100 if self.samples else None


def workload(args: argparse.Namespace) -> list[tuple[str, tuple[int, int], int]]:
    """(class, size, new tokens) per job, in arrival order (classes interleaved at random)."""
    import random

    rng = random.Random(args.seed)
    medians = {"crop": args.crop_tokens, "receipt": args.receipt_tokens, "a4": args.a4_tokens}
    weights = dict(zip(CLASSES, (float(x) for x in args.mix.split(",")), strict=True))
    jobs = []
    for _ in range(args.jobs):
        cls = rng.choices(list(weights), list(weights.values()))[0]
        n = int(rng.lognormvariate(0, 0.35) * medians[cls])
        jobs.append((cls, CLASSES[cls][0], max(1, min(args.max_new_tokens, n))))
    return jobs


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None}
    values = sorted(values)
    return {"p50": values[len(values) // 2], "p95": values[min(len(values) - 1,
                                                               int(0.95 * len(values)))]}


def summary(mode: str, jobs: list, finished: dict[int, float], seconds: float, busy: float | None,
            peak: int | None, predicted: int | None, extra: dict[str, Any]) -> dict[str, Any]:
    tokens = sum(n for _, _, n in jobs)
    short = [finished[i] for i, (c, _, _) in enumerate(jobs) if c in SHORT]
    pages = [finished[i] for i, (c, _, _) in enumerate(jobs) if c == "a4"]
    return {
        "mode": mode, "jobs": len(jobs), "seconds": seconds, "images_per_s": len(jobs) / seconds,
        "tokens_per_s": tokens / seconds, "gpu_busy": busy,
        "a4_pages_per_s": len(pages) / seconds if pages else None,
        "short_latency_s": percentiles(short), "a4_latency_s": percentiles(pages),
        "peak_gib": peak / GiB if peak else None,
        "predicted_peak_gib": predicted / GiB if predicted else None,
        "predicted_vs_measured": predicted / peak if peak and predicted else None, **extra,
    }


def run_static(torch: Any, engine: HunyuanLoopEngine, jobs: list, rows: list, batch: int,
               cuda: bool) -> dict[str, Any]:
    """Batches of `batch` in arrival order; each batch forced to its longest row's length."""
    finished: dict[int, float] = {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    blank = PreparedImage("s", page_image(8, 8), (8, 8))
    t0 = time.perf_counter()
    with BusySampler(torch, cuda) as busy:
        for lo in range(0, len(jobs), batch):
            idx = list(range(lo, min(lo + batch, len(jobs))))
            longest = max(jobs[i][2] for i in idx)
            engine.generate([blank] * len(idx), encoded=[rows[i] for i in idx],
                            max_new_tokens=longest, min_new_tokens=longest, decode="fast")
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter() - t0
            for i in idx:
                finished[i] = now
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return summary(f"static b={batch}", jobs, finished, seconds, busy.share, peak, None,
                   {"padded_tokens_per_s": sum(
                       max(jobs[i][2] for i in range(lo, min(lo + batch, len(jobs))))
                       * len(range(lo, min(lo + batch, len(jobs))))
                       for lo in range(0, len(jobs), batch)) / seconds})


def use_kv_dtype(engine: HunyuanLoopEngine, name: str) -> None:
    """The engine's running loop with this KV pool dtype from now on (`OCRQ_KV_CACHE_DTYPE`)."""
    engine.settings = engine.settings.model_copy(update={"kv_cache_dtype": name})


def loop_error(torch: Any, engine: HunyuanLoopEngine, rows: list, steps: int, cuda: bool,
               variant: dict[str, Any]) -> dict[str, Any]:
    """What a loop setting (`variant`: LoopConfig fields, e.g. an fp8 pool or packed prefills)
    changes in the output: the same rows, forced to `steps` tokens, through the running loop
    with the defaults and with the variant, every step's logits kept. Compared up to each
    row's first differing token (after it the two rows are fed different tokens)."""
    from ocrq.models.slots import RunningBudget

    kept: dict[str, dict[str, Any]] = {}
    longest = max(int(r.input_ids.shape[0]) for r in rows)
    for name, overrides in (("reference", {}), ("variant", variant)):
        budget = RunningBudget(len(rows), len(rows) * (longest + steps + 16), 65536, 0, 0, 0, 0)
        config = {"keep_logits": True, "max_new_tokens": steps, "kv_dtype": "auto",
                  "packed": False, "chunk_tokens": 65536, **overrides}
        loop = RunningLoop(engine._decoder, engine.tokens, engine.loop_config(budget, **config))
        loop.add([LoopRow(str(i), r, steps, min_new_tokens=steps) for i, r in enumerate(rows)])
        kept[name] = {d.row.key: d for d in loop.drain()}
        loop.clear()
        del loop
        if cuda:
            torch.cuda.empty_cache()
    diffs, scales, agree, compared = [], [], [], 0
    for key, ref in kept["reference"].items():
        got = kept["variant"][key]
        same = 0
        while same < min(len(ref.tokens), len(got.tokens)) and ref.tokens[same] == got.tokens[same]:
            same += 1
        agree.append(same / len(ref.tokens))
        upto = min(same + 1, ref.logits.shape[0])  # the first differing step compared too
        a, b = ref.logits[:upto].float(), got.logits[:upto].float()
        diffs.append(float((a - b).abs().max()))
        scales.append(float(a.std()))
        compared += upto
    return {"variant": variant, "rows": len(rows), "steps": steps, "steps_compared": compared,
            "max_abs_logit_diff": max(diffs), "mean_of_row_max_diffs": statistics.mean(diffs),
            "logit_std": statistics.mean(scales),
            "tokens_equal_before_first_difference": statistics.mean(agree)}


def run_loop(torch: Any, engine: HunyuanLoopEngine, jobs: list, rows: list, schedule: str,
             args: argparse.Namespace, cuda: bool, slots: int | None = None,
             packed_chunk: int = 0, prefill_stream: bool | None = None) -> dict[str, Any]:
    """Every job queued at once into the running loop, sized from --budget-gib; with
    `packed_chunk`, packed prefill passes of that many tokens (`OCRQ_PREFILL_PACKED`); with
    `prefill_stream`, passes on a side stream or not (`OCRQ_PREFILL_STREAM`; None: the
    setting's)."""
    model = engine.loop_cost_model(engine.cost_model())
    engine.loop = None
    engine.release_memory()
    budget_bytes = int(args.budget_gib * GiB) - model.fixed_bytes
    # The pass the schedule runs is the one reserved (HunyuanLoopEngine.pass_tokens).
    chunk = packed_chunk or args.chunk_tokens
    pass_tokens = chunk if schedule == "chunked" else args.prefill_tokens
    running = RunningBudget.plan(model, budget_bytes, slots=slots or args.slots,
                                 prefill_tokens=pass_tokens,
                                 state_bytes_per_slot=engine.state_bytes_per_slot())
    streams = {} if prefill_stream is None else {"prefill_stream": prefill_stream}
    config = engine.loop_config(running, schedule=schedule, chunk_tokens=chunk,
                                packed=bool(packed_chunk),
                                max_new_tokens=args.max_new_tokens, **streams)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    loop = RunningLoop(engine._decoder, engine.tokens, config)
    loop.add([LoopRow(str(i), rows[i], n, min_new_tokens=n) for i, (_, _, n) in enumerate(jobs)])
    finished: dict[int, float] = {}
    t0 = time.perf_counter()
    with BusySampler(torch, cuda) as busy:
        while not loop.idle():
            for d in loop.run():
                finished[int(d.row.key)] = time.perf_counter() - t0
                assert len(d.tokens) == jobs[int(d.row.key)][2], "forced length not reached"
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else None
    s = loop.collect_stats(wait=True)
    kv = engine.settings.kv_cache_dtype
    mode = f"running {schedule}" + (f" {kv} KV" if kv != "auto" else "")
    mode += f" packed {packed_chunk}" if packed_chunk else ""
    mode += " prefill stream" if config.prefill_stream else ""
    out = summary(mode, jobs, finished, seconds, busy.share, peak,
                  model.fixed_bytes + running.bytes if cuda else None, {
                      "slots": running.slots, "pool_tokens": running.pool_tokens,
                      "prefill_s": s.prefill_s, "decode_s": s.decode_s, "capture_s": s.capture_s,
                      "prefills": s.prefills, "steps": s.steps, "graphs": s.graphs,
                      "prefill_stream": config.prefill_stream, "late_passes": s.late_passes,
                      "pending_iterations": s.pending_iterations,
                      "overlap_steps": s.overlap_steps,
                      "live_share_of_slot_steps": s.row_steps / max(s.slot_steps, 1),
                      "mean_live_rows": s.row_steps / max(s.steps, 1)})
    loop.clear()
    del loop
    return out


def parse_bool(text: str) -> bool:
    if text.strip().lower() not in ("true", "false"):
        raise SystemExit(f"--prefill-streams: true or false, not {text!r}")
    return text.strip().lower() == "true"


def stream_tag(stream: bool | None) -> str:
    return "" if stream is None else f"_stream_{str(stream).lower()}"


def markdown(d: dict[str, Any]) -> str:
    m = d["meta"]
    w = d["workload"]
    lines = [f"# Continuous batching on {m.get('gpu')}: static batches vs the running loop", "",
             f"torch {m.get('torch')}, transformers {m.get('transformers')}, {m.get('dtype')}, "
             f"random weights of the {m.get('shape')} shape. Command: `{m.get('command')}`.", "",
             f"Workload: {w.get('jobs')} jobs, {w.get('by_class')}; new tokens per class "
             f"(mean) {w.get('mean_tokens')}; every row runs exactly to its drawn length.", "",
             "| mode | s | images/s | tokens/s | A4 pages/s | GPU busy | short p50 / p95 s "
             "| A4 p50 / p95 s | peak GiB | predicted GiB | pred/meas |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]

    def f(x: Any, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)

    for r in d["runs"]:
        lines.append(
            f"| {r['mode']} | {r['seconds']:.1f} | {r['images_per_s']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {f(r['a4_pages_per_s'])} | {f(r['gpu_busy'], '.0%')} | "
            f"{f(r['short_latency_s']['p50'])} / {f(r['short_latency_s']['p95'])} | "
            f"{f(r['a4_latency_s']['p50'])} / {f(r['a4_latency_s']['p95'])} | "
            f"{f(r['peak_gib'])} | {f(r['predicted_peak_gib'])} | "
            f"{f(r['predicted_vs_measured'], '.3f')} |")
    static = [r for r in d["runs"] if r["mode"].startswith("static")]
    if static:
        best = max(static, key=lambda r: r["images_per_s"])
        for r in d["runs"]:
            if r["mode"].startswith("running"):
                lines += ["", f"- {r['mode']}: {r['images_per_s'] / best['images_per_s']:.2f}x "
                          f"the images/s of the best static run ({best['mode']}); "
                          f"{r['mean_live_rows']:.1f} rows live per step on average, "
                          f"{r['live_share_of_slot_steps']:.0%} of the slot-steps stepped were "
                          f"live; {r['prefills']} prefill passes ({r['prefill_s']:.1f} s), "
                          f"{r['steps']} decode steps ({r['decode_s']:.1f} s), "
                          f"{r['graphs']} graphs."]
    for r in d["runs"]:
        if r.get("prefill_stream"):
            lines += ["", f"- {r['mode']}: prefill passes on a side stream; {r['prefills']} "
                      f"passes ({r['prefill_s']:.1f} s of GPU spans) and {r['steps']} decode "
                      f"steps ({r['decode_s']:.1f} s) overlap, so their sum can pass the "
                      f"{r['seconds']:.1f} s wall; {r['late_passes']} passes committed late, "
                      f"{r['overlap_steps']} steps run beside a pending pass."]
    for key, what in (("kv_error", "fp8 KV pool against the model's dtype"),
                      ("packed_error", "packed prefill passes against padded ones"),
                      ("stream_error", "prefill passes on a side stream against inline ones")):
        err = d.get(key)
        if err:
            lines += ["", f"{what} ({err['rows']} rows of A4 pages, receipts and word crops, "
                      f"{err['steps']} forced tokens, {err['steps_compared']} steps compared up "
                      f"to each row's first differing token): max abs logit difference "
                      f"{err['max_abs_logit_diff']:.4g} (mean of rows' maxima "
                      f"{err['mean_of_row_max_diffs']:.4g}) on logits of std "
                      f"{err['logit_std']:.4g}; {err['tokens_equal_before_first_difference']:.0%}"
                      " of each row's tokens equal before its first difference, on average."]
    for e in d["errors"]:
        lines += ["", f"ERROR in {e['part']}: {e['error']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="continuous_batching_h200")
    add_model_args(ap)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model on the CPU, a small workload (the test runs this)")
    ap.add_argument("--jobs", type=int, default=512)
    ap.add_argument("--mix", default="0.4,0.3,0.3", help="shares of crop,receipt,a4")
    ap.add_argument("--crop-tokens", type=int, default=12)
    ap.add_argument("--receipt-tokens", type=int, default=300)
    ap.add_argument("--a4-tokens", type=int, default=1100)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--batches", default="128,256", help="static batch sizes")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--budget-gib", type=float, default=120.0)
    ap.add_argument("--prefill-tokens", type=int, default=65536)
    ap.add_argument("--chunk-tokens", type=int, default=8192)
    ap.add_argument("--schedules", default="alternate,chunked")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--kv-dtypes", default="auto",
                    help='running-loop KV pools to run, e.g. "auto,fp8" (OCRQ_KV_CACHE_DTYPE)')
    ap.add_argument("--fp8-slots", type=int, default=512, help="slots with an fp8 pool")
    ap.add_argument("--kv-error-rows", type=int, default=0,
                    help="rows (A4 pages, receipts, word crops) for the fp8 logit error; 0: skip")
    ap.add_argument("--stream-error-rows", type=int, default=0,
                    help="rows compared through the loop with and without OCRQ_PREFILL_STREAM "
                    "(same tokens expected)")
    ap.add_argument("--packed-error-rows", type=int, default=0,
                    help="rows for the packed prefill's logit error against padded; 0: skip")
    ap.add_argument("--kv-error-steps", type=int, default=64)
    ap.add_argument("--packed-chunks", default="",
                    help='packed prefill passes of these tokens, "chunked", e.g. "4096,16384"')
    ap.add_argument("--packed-kv-dtype", default="auto", help="the KV pool of the packed runs")
    ap.add_argument("--vision-attentions", default="",
                    help='run each packed run under these vision attentions, e.g. "sdpa,fa4" '
                    "(OCRQ_VISION_ATTENTION; empty: as the engine loaded)")
    ap.add_argument("--prefill-streams", default="",
                    help='run each running-loop run with these, e.g. "false,true": prefill '
                    "passes on a side stream or not (OCRQ_PREFILL_STREAM; empty: the setting's)")
    ap.add_argument("--version", choices=("1.0", "1.5"), default="1.0")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.device, args.dtype = "tiny", "cpu", "float32"
        args.jobs, args.crop_tokens, args.receipt_tokens, args.a4_tokens = 12, 2, 8, 20
        args.max_new_tokens, args.batches, args.slots, args.fp8_slots = 32, "4", 4, 8
        args.budget_gib, args.prefill_tokens, args.chunk_tokens = 2.9, 2048, 512
        args.stem = "continuous_batching_smoke"
        CLASSES.update({"receipt": ((120, 200), 8), "a4": ((160, 220), 20)})

    import torch

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    report = Report(args.out, args.stem)
    report.data["meta"] = run_meta(args, "bench/continuous_batching.py")
    if args.shape == "full":
        report.data["meta"]["shape"] = f"HunyuanOCR-{args.version}"

    def part(name: str, fn: Any) -> Any:
        return run_part(report, started, name, fn)

    jobs = workload(args)
    streams = [parse_bool(x) for x in args.prefill_streams.split(",") if x] or [None]
    by_class = {c: sum(1 for j in jobs if j[0] == c) for c in CLASSES}
    report.data["workload"] = {
        "jobs": len(jobs), "by_class": by_class,
        "mean_tokens": {c: round(statistics.mean([n for k, _, n in jobs if k == c]))
                        for c in CLASSES if by_class[c]},
        "lengths": [[c, n] for c, _, n in jobs],
    }
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = random_checkpoint(Path(tmp), args, version=args.version)
        settings = Settings(model=str(ckpt), model_subfolder=None, dtype=args.dtype,
                            device=args.device, max_new_tokens=args.max_new_tokens,
                            max_batch=args.slots, vision_attention="sdpa")
        engine = HunyuanLoopEngine(settings, decode="fast")
        engine.load()
        report.data["meta"]["decode_attention"] = engine._decoder.attention
        images = {c: page_image(*size) for c, (size, _) in CLASSES.items()}
        encoded = {c: engine.preprocess(PreparedImage(c, im, im.size))
                   for c, im in images.items()}
        rows = [encoded[c] for c, _, _ in jobs]
        report.data["workload"]["prompt_tokens"] = {
            c: int(e.input_ids.shape[0]) for c, e in encoded.items()}
        part("warm_up", lambda: engine.generate(
            [PreparedImage("w", images["crop"], images["crop"].size)] * 2,
            max_new_tokens=4, min_new_tokens=4))
        # The running loop first: with the lease short, what is new is measured before what
        # earlier runs already showed (static batches).
        # A pass of rows of different lengths: the padded prefill pads them, the packed not.
        sample = [encoded["a4"], encoded["receipt"], encoded["crop"]]
        for name, variant, wanted in (("kv_error", {"kv_dtype": "fp8"}, args.kv_error_rows),
                                      ("packed_error", {"packed": True}, args.packed_error_rows),
                                      ("stream_error", {"prefill_stream": True},
                                       args.stream_error_rows)):
            if not wanted:
                continue
            found = part(name, lambda v=variant, n=wanted: loop_error(
                torch, engine, (sample * n)[:n], args.kv_error_steps, cuda, v))
            if found:
                report.data[name] = found
                report.write()
        use_kv_dtype(engine, args.packed_kv_dtype)
        packed_slots = args.fp8_slots if args.packed_kv_dtype == "fp8" else args.slots
        for chunk in (int(x) for x in args.packed_chunks.split(",") if x):
            for vision in args.vision_attentions.split(",") if args.vision_attentions else [""]:
                if vision:
                    batch_vision_attention(
                        engine.model, kernel=fa4_kernel() if vision == "fa4" else None)
                    part(f"warm_up_{vision}", lambda: engine.generate(  # FA4 compiles here
                        [PreparedImage("w", images["a4"], images["a4"].size)] * 2,
                        max_new_tokens=4, min_new_tokens=4))
                for stream in streams:
                    run = part(f"running_chunked_packed_{chunk}{vision}{stream_tag(stream)}",
                               lambda c=chunk, st=stream: run_loop(
                                   torch, engine, jobs, rows, "chunked", args, cuda,
                                   slots=packed_slots, packed_chunk=c, prefill_stream=st))
                    if run:
                        run["mode"] += f" vision {vision}" if vision else ""
                        report.data["runs"].append(run)
                        report.write()
        use_kv_dtype(engine, "auto")
        for kv in (x for x in args.kv_dtypes.split(",") if x):
            use_kv_dtype(engine, kv)
            for schedule in (x for x in args.schedules.split(",") if x):
                for stream in streams:
                    run = part(f"running_{schedule}_{kv}{stream_tag(stream)}",
                               lambda s=schedule, kv=kv, st=stream: run_loop(
                                   torch, engine, jobs, rows, s, args, cuda,
                                   slots=args.fp8_slots if kv == "fp8" else args.slots,
                                   prefill_stream=st))
                    if run:
                        report.data["runs"].append(run)
                        report.write()
        use_kv_dtype(engine, "auto")
        for b in (int(x) for x in args.batches.split(",") if x):
            run = part(f"static_{b}", lambda b=b: run_static(torch, engine, jobs, rows, b, cuda))
            if run:
                report.data["runs"].append(run)
                report.write()
    report.data["meta"]["total_s"] = round(time.perf_counter() - started, 1)
    report.write()
    print(markdown(report.data), flush=True)


if __name__ == "__main__":
    main()
