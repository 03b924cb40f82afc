"""Memory-budgeted planner against fixed batch sizes, on one GPU with a budget enforced for real.

Why this benchmark: the planner's claim is that batching by predicted bytes beats any fixed batch
size on a mixed workload (word crops, pages, big receipts) without ever running out of memory.
The run shows it or not, in one process, on one model, on the same images:

(a) fixed batch of --fixed images, taken in arrival order (what a count-only batcher does);
(b) the best fixed batch from a bounded sweep: one batch per size from --sweep on the first
    --sweep-subset images, the largest that ran without OOM, then the whole workload at that
    size; OOMs during it are counted and recovered by the Batcher (split, retry);
(c) the Batcher with the planner and the cost model fitted by `ocrq tune`'s code on this device
    at the start of the run (worker.probing.run_probes + worker.tune.save, loaded back through the
    worker's own profile lookup), planning to --headroom of the budget (the rest is for the
    allocator: reserved exceeds allocated by 2-9% on the H200).

The budget is enforced with torch.cuda.set_per_process_memory_fraction, so a batch over it
really raises OutOfMemoryError. Images: --images synthetic images whose sizes are sampled from
the shared evaluation set (bench/data/ocr_eval_sizes.tsv, from its manifest), drawn as text on
white, capped to the engine's model_limit as the worker's prefetch does, and preprocessed once
(in the service the prefetch threads do this while the GPU works, so it is left out of every
mode's time alike). The model is a random-weight checkpoint of the full HunyuanOCR-1.0 shape
(ocrq/testing/tiny_hunyuan.py) loaded through HunyuanEngine.load; every image generates exactly
--new-tokens tokens (the engine's max_new_tokens, forced with min_new_tokens).

Results are written after every phase (JSON + markdown) so a run cut short still reports.

    PYTHONUNBUFFERED=1 python bench/planner_vs_fixed.py --out bench/results/planner_vs_fixed
    python bench/planner_vs_fixed.py --tiny --out /tmp/pvf   # CPU smoke test, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from ocrq.core.pixel_budget import Stage  # noqa: E402
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.intake.images import downscale  # noqa: E402
from ocrq.models.base import Engine, OcrResult, PreparedImage  # noqa: E402
from ocrq.models.costs import CostModel, GiB, ItemCost  # noqa: E402
from ocrq.models.hunyuan import HunyuanEngine  # noqa: E402
from ocrq.models.memory import OutOfMemory, ProbePage, catch_oom  # noqa: E402
from ocrq.scheduling.batcher import StaticBatcher as Batcher  # noqa: E402
from ocrq.scheduling.vocabulary import BatchConfig  # noqa: E402
from ocrq.tuning.probing import draw_page, run_probes  # noqa: E402
from ocrq.tuning.profiles import choose_cost_model  # noqa: E402
from ocrq.tuning.tune import save  # noqa: E402

SIZES = REPO / "bench" / "data" / "ocr_eval_sizes.tsv"
WORDS = ["STATION", "HOTEL", "PARKING", "EXIT", "MARKET", "BANK", "PIZZA", "TAXI", "OPEN"]


# -- workload ------------------------------------------------------------------------------------


def eval_sizes() -> list[tuple[str, int, int]]:
    rows = []
    for line in SIZES.read_text().splitlines():
        if line.startswith("#") or line.startswith("dataset"):
            continue
        name, w, h = line.split("\t")
        rows.append((name, int(w), int(h)))
    return rows


def draw(kind: str, w: int, h: int, i: int) -> Any:
    """Text on white at the given size: a word for crops, lines for receipts and pages."""
    if kind == "svt":  # street-sign word crops
        return draw_page(w, h, [WORDS[i % len(WORDS)]], max(6, int(h * 0.5)))
    size = max(12, h // 60)
    lines = [f"ITEM {j:02d}  {(i + j) * 1.25:8.2f}" for j in range(min(30, h // (2 * size)))]
    return draw_page(w, h, lines, size)


@dataclass
class Work:
    key: str
    kind: str
    original: tuple[int, int]
    image: Any
    encoded: Any
    cost: ItemCost


def workload(engine: HunyuanEngine, n: int, seed: int, threads: int) -> list[Work]:
    rng = np.random.default_rng(seed)
    sizes = eval_sizes()
    picks = [sizes[int(j)] for j in rng.integers(0, len(sizes), n)]

    def make(i: int) -> Work:
        kind, w, h = picks[i]
        image = draw(kind, w, h, i)
        keep = engine.pixel_budget("text", None).at(Stage.DECODE)
        if keep and w * h > keep:
            image = downscale(image, keep)  # what prefetch does before waiting
        item = PreparedImage(f"img{i:04d}", image, (w, h))
        return Work(item.key, kind, (w, h), image, engine.preprocess(item), engine.estimate(item))

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(make, range(n)))


def items_of(work: Sequence[Work]) -> list[PreparedImage]:
    """Fresh items per mode (OOM recovery may downscale an item), sharing the encoded rows."""
    return [PreparedImage(w.key, w.image, w.original, encoded=w.encoded) for w in work]


# -- measuring engine ----------------------------------------------------------------------------


@dataclass
class BatchRun:
    size: int
    status: str  # ok | oom
    seconds: float
    peak_gib: float  # max allocated during the call (weights included)
    reserved_gib: float
    predicted_gib: float  # the planner's model for this batch (peak, fixed part included)
    padded_tokens: int  # longest item's tokens (prompt + image + new)


class Metered(Engine):
    """The engine with a peak-memory reading around every `run`; with `fifo`, every item
    looks alike to the planner, so batches are taken in arrival order by count alone."""

    def __init__(self, inner: HunyuanEngine, model: CostModel, fifo: bool) -> None:
        self.inner, self.model, self.fifo = inner, model, fifo
        self.name = inner.name
        self.runs: list[BatchRun] = []
        self.torch: Any = None
        if inner.device and inner.device.startswith("cuda"):
            import torch

            self.torch = torch

    def load(self) -> None:
        pass

    def estimate(self, item: PreparedImage) -> ItemCost:
        cost = self.inner.estimate(item)
        return ItemCost(0, 0, cost.pixels) if self.fifo else cost

    def cost_model(self) -> CostModel:
        return self.model

    # The inner engine's memory side (ocrq/models/memory.py, MemoryProbing), so that the batcher
    # recovers from an OOM here exactly as it does with the engine alone.
    @property
    def profile_fields(self) -> tuple[str, ...]:
        return self.inner.profile_fields

    def is_oom(self, exc: BaseException) -> bool:
        return self.inner.is_oom(exc)

    def release_memory(self) -> None:
        self.inner.release_memory()

    def default_budget_bytes(self) -> int:
        return self.inner.default_budget_bytes()

    def fragmentation_bytes(self) -> int | None:
        return self.inner.fragmentation_bytes()

    def probe_pages(self) -> Sequence[ProbePage]:
        return self.inner.probe_pages()

    def reset_peak_memory(self) -> None:
        self.inner.reset_peak_memory()

    def peak_memory_bytes(self) -> int:
        return self.inner.peak_memory_bytes()

    def memory_capacity_bytes(self) -> int:
        return self.inner.memory_capacity_bytes()

    def probe(self, batch: Sequence[PreparedImage]) -> list[ItemCost]:
        return self.inner.probe(batch)

    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        costs = [self.inner.estimate(i) for i in batch]
        predicted = self.model.peak_bytes(costs) / GiB
        self.inner.reset_peak_memory()
        t0 = time.perf_counter()
        status = "error"
        try:
            results = self.inner.run(batch)
            status = "ok"
            return results
        except Exception as exc:
            if self.inner.is_oom(exc):
                status = "oom"
            raise
        finally:
            seconds = time.perf_counter() - t0
            peak = self.inner.peak_memory_bytes() / GiB
            reserved = (
                self.torch.cuda.max_memory_reserved(self.inner.device) / GiB if self.torch else 0.0
            )
            self.runs.append(
                BatchRun(len(batch), status, seconds, peak, reserved, predicted,
                         max(c.tokens for c in costs))
            )


# -- modes ---------------------------------------------------------------------------------------


@dataclass
class ModeResult:
    name: str
    max_items: int
    cost_model: str
    images: int = 0
    done: int = 0
    failed: int = 0
    seconds: float = 0.0
    images_per_s: float = 0.0
    partial: bool = False  # stopped submitting at its deadline
    oom_events: int = 0
    batches: list[BatchRun] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarise(mode: ModeResult, budget_gib: float) -> None:
    ok = [b for b in mode.batches if b.status == "ok"]
    peaks = [b.peak_gib for b in ok]
    sizes = [b.size for b in ok]
    s: dict[str, Any] = {
        "batches_ok": len(ok),
        "batches_oom": sum(b.status == "oom" for b in mode.batches),
        "batch_size_min_median_max": [min(sizes, default=0), pct(sizes, 50), max(sizes, default=0)],
        "peak_gib_max": max(peaks, default=0.0),
        "peak_gib_p50": pct(peaks, 50),
        "peak_gib_p90": pct(peaks, 90),
        "peak_gib_min": min(peaks, default=0.0),
        "reserved_gib_max": max((b.reserved_gib for b in ok), default=0.0),
        "all_ok_batches_under_budget": all(p <= budget_gib for p in peaks),
    }
    errs = [(b.predicted_gib - b.peak_gib) / b.peak_gib for b in ok if b.peak_gib > 0]
    if errs:
        s["pred_rel_error_min_max"] = [min(errs), max(errs)]
        s["pred_within_10pct"] = sum(abs(e) <= 0.10 for e in errs) / len(errs)
        s["pred_underestimates"] = sum(e < 0 for e in errs)
    mode.summary = s


def run_mode(
    name: str,
    engine: HunyuanEngine,
    work: Sequence[Work],
    *,
    model: CostModel,
    fifo: bool,
    max_items: int,
    budget_bytes: int,
    deadline: float,
    log: Any,
) -> ModeResult:
    """All of `work` through a Batcher, `2 * max_items` in flight (the worker's prefetch)."""
    metered = Metered(engine, model, fifo)
    plan_model = CostModel(fixed_bytes=0, source="count only") if fifo else model
    config = BatchConfig(max_items=max_items, wait_s=0.05, budget_bytes=budget_bytes)
    batcher = Batcher(metered, config, cost_model=plan_model).start()
    result = ModeResult(name, max_items, plan_model.source, images=len(work))
    window = threading.Semaphore(2 * max_items)
    futures = []
    engine.release_memory()
    t0 = time.perf_counter()
    for item in items_of(work):
        window.acquire()
        if time.monotonic() > deadline:
            result.partial = True
            break
        fut = batcher.submit(item)
        fut.add_done_callback(lambda _f: window.release())
        futures.append(fut)
    done = failed = 0
    for f in futures:  # bounded: a stuck batcher must not hold the device to the call's limit
        try:
            outcome = f.result(timeout=max(30.0, deadline - time.monotonic() + 120.0))
        except TimeoutError:
            failed += 1
            continue
        done += outcome.error is None
        failed += outcome.error is not None
    result.seconds = time.perf_counter() - t0
    batcher.stop(timeout=30)
    result.done, result.failed = done, failed
    result.images_per_s = result.done / result.seconds if result.seconds else 0.0
    result.oom_events = batcher.oom_events
    result.batches = metered.runs
    log(f"{name}: {result.done} done, {result.failed} failed in {result.seconds:.1f} s = "
        f"{result.images_per_s:.2f} img/s, {len(metered.runs)} engine calls, "
        f"{result.oom_events} OOMs{' (partial)' if result.partial else ''}")
    return result


def sweep(engine: HunyuanEngine, work: Sequence[Work], sizes: Sequence[int], model: CostModel,
          log: Any) -> tuple[int, list[BatchRun]]:
    """One batch of the first B images per size, ascending; the largest that ran is best.

    Each larger batch holds the smaller one's images, so its padded length and size only grow:
    after the first OOM no larger size can fit, and the sweep stops.
    """
    metered = Metered(engine, model, fifo=True)
    best = 0
    for size in sizes:
        batch = items_of(work[:size])
        if len(batch) < size:
            break
        engine.release_memory()
        if isinstance(catch_oom(engine, lambda b=batch: metered.run(b)), OutOfMemory):
            log(f"sweep: batch {size} ran out of memory")
            break
        best = size
        log(f"sweep: batch {size} ok, peak {metered.runs[-1].peak_gib:.2f} GiB, "
            f"{metered.runs[-1].seconds:.2f} s")
    return best, metered.runs


# -- report --------------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = [
        f"# Planner vs fixed batches: HunyuanEngine on {m.get('gpu')}, budget "
        f"{m['budget_gib']:.0f} GiB enforced",
        "",
        f"Hardware: {m.get('gpu')} ({m.get('device_total_gib', 0):.0f} GiB), "
        f"{m.get('cpu')}; torch {m.get('torch')}, transformers {m.get('transformers')}, "
        f"Python {m.get('python')}.",
        "",
        f"Model: random weights, {m['shape']} shape, {m['dtype']}, {m['attention']} attention, "
        f"decode loop: {m.get('decode')}, "
        f"{m['new_tokens']} new tokens forced per image. Workload: {m['images']} synthetic "
        f"images, sizes sampled (seed {m['seed']}) from the eval manifest: {m.get('mix')}. "
        f"Memory budget {m['budget_gib']} GiB enforced with "
        "torch.cuda.set_per_process_memory_fraction; the planner plans to "
        f"{m['headroom']:.0%} of it. Command: `{m['command']}`.",
        "",
        "images/s = images done / wall time of the mode (preprocessing done once beforehand, as "
        "prefetch threads do it; the same for every mode). Peak = torch.cuda.max_memory_allocated "
        "per engine call (weights included); OOM = engine calls that raised OutOfMemoryError.",
        "",
        "| mode | batch (planned by) | images done | failed | seconds | images/s "
        "| engine calls (ok/oom) | batch size min/med/max | peak GiB max | p50 | p90 "
        "| reserved GiB max | OOMs |",
        "|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for mode in report["modes"]:
        s = mode["summary"]
        bmin, bmed, bmax = s["batch_size_min_median_max"]
        planned_by = "count only" if mode["cost_model"] == "count only" else "tuned profile"
        lines.append(
            f"| {mode['name']} | up to {mode['max_items']} ({planned_by}) | {mode['done']}"
            f"{' (partial)' if mode['partial'] else ''} | {mode['failed']} | "
            f"{mode['seconds']:.1f} | {mode['images_per_s']:.2f} | "
            f"{s['batches_ok']}/{s['batches_oom']} | {bmin}/{bmed:.0f}/{bmax} | "
            f"{s['peak_gib_max']:.2f} | {s['peak_gib_p50']:.2f} | {s['peak_gib_p90']:.2f} | "
            f"{s['reserved_gib_max']:.2f} | {mode['oom_events']} |"
        )
    if report.get("speedups"):
        lines += ["", "Speed-ups: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in report["speedups"].items())]
    if report.get("sweep"):
        sw = report["sweep"]
        lines += ["", f"Sweep (one batch per size, first {sw['subset']} images): "
                  + ", ".join(f"{b['size']}: {b['status']} ({b['peak_gib']:.2f} GiB)"
                              for b in sw["runs"]) + f"; best = {sw['best']}."]
    if report.get("tune"):
        t = report["tune"]
        lines += ["", f"Cost model: {t['source']}; fixed {t['fixed_gib']:.3f} GiB, per item "
                  f"{t['per_item_kib']:.1f} KiB, per token {t['per_token_kib']:.1f} KiB, per patch "
                  f"{t['per_patch_kib']:.2f} KiB; tune took {t['seconds']:.0f} s, largest error "
                  f"on its probes {t['max_rel_error']:.1%}."]
    planner = next((m for m in report["modes"] if m["name"].startswith("(c)")), None)
    if planner:
        s = planner["summary"]
        if "pred_rel_error_min_max" in s:
            lo, hi = s["pred_rel_error_min_max"]
            lines += [
                "",
                f"Planner: predicted vs measured peak per batch: error {lo:+.1%} .. {hi:+.1%}, "
                f"{s['pred_within_10pct']:.0%} of batches within ±10%, "
                f"{s['pred_underestimates']} under-predicted; every batch under budget: "
                f"{s['all_ok_batches_under_budget']}.",
            ]
        lines += [
            "",
            "| batch | size | padded tokens | predicted GiB | measured GiB | error "
            "| reserved GiB | seconds | status |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for i, b in enumerate(planner["batches"]):
            err = (b["predicted_gib"] - b["peak_gib"]) / b["peak_gib"] if b["peak_gib"] else 0.0
            lines.append(
                f"| {i} | {b['size']} | {b['padded_tokens']} | {b['predicted_gib']:.2f} | "
                f"{b['peak_gib']:.2f} | {err:+.1%} | {b['reserved_gib']:.2f} | "
                f"{b['seconds']:.2f} | {b['status']} |"
            )
    if report.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="planner_vs_fixed_h200")
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU, few images")
    ap.add_argument("--images", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--budget-gib", type=float, default=20.0)
    ap.add_argument("--headroom", type=float, default=0.9)
    ap.add_argument("--fixed", type=int, default=8)
    ap.add_argument("--sweep", default="16,32,64,128")
    ap.add_argument("--sweep-subset", type=int, default=128)
    ap.add_argument("--planner-max", type=int, default=256)
    ap.add_argument("--tune-seconds", type=float, default=40.0)
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds for everything")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="c,b,a", help="which of (a) (b) (c) to run, in order")
    args = ap.parse_args()
    if args.tiny:
        args.images = min(args.images, 40)
        args.sweep, args.sweep_subset, args.fixed, args.planner_max = "4,8,16", 16, 4, 32
        args.tune_seconds = min(args.tune_seconds, 30.0)

    started = time.monotonic()
    end = started + args.time_budget
    import torch
    import transformers

    from ocrq.testing.tiny_hunyuan import HUNYUAN_OCR_1_0, TINY, build_checkpoint

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    logfile = (out / f"{args.stem}.log").open("w")

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - started:6.1f} s] {msg}"
        print(line, flush=True)
        logfile.write(line + "\n")
        logfile.flush()

    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda:0" if cuda else "cpu"
    dtype = "bfloat16" if cuda else "float32"
    report: dict[str, Any] = {"meta": {
        "command": " ".join(["python", "bench/planner_vs_fixed.py", *sys.argv[1:]]),
        "shape": "tiny" if args.tiny else "HunyuanOCR-1.0",
        "device": device, "dtype": dtype, "attention": "sdpa", "new_tokens": args.new_tokens,
        "images": args.images, "seed": args.seed, "budget_gib": args.budget_gib,
        "headroom": args.headroom, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "cpu": f"{os.cpu_count()} CPU threads",
        "gpu": torch.cuda.get_device_name(0) if cuda else "CPU (tiny smoke test)",
    }, "modes": [], "notes": []}

    def write() -> None:
        (out / f"{args.stem}.json").write_text(json.dumps(report, indent=1, default=str))
        (out / f"{args.stem}.md").write_text(markdown(report))

    tmp = Path(tempfile.mkdtemp(prefix="pvf-"))
    try:
        ckpt = tmp / "ckpt"
        shape = TINY if args.tiny else HUNYUAN_OCR_1_0
        build_checkpoint(ckpt, shape, device=device, dtype=dtype)
        settings = Settings(model=str(ckpt), model_subfolder=None, dtype=dtype, device=device,
                            attention="sdpa", max_new_tokens=args.new_tokens,
                            max_batch=args.planner_max, profile_dir=tmp / "profiles")
        engine = HunyuanEngine(settings)
        engine.load()
        # The engine's own run() stops at eos; force every image to generate new_tokens.
        plain_generate = engine.generate

        def forced(batch: Any, **kw: Any) -> Any:
            kw.setdefault("min_new_tokens", args.new_tokens)
            return plain_generate(batch, **kw)

        engine.generate = forced  # type: ignore[method-assign]
        if cuda:
            import gc

            gc.collect()
            torch.cuda.empty_cache()  # what building the checkpoint left cached
            total = torch.cuda.mem_get_info(0)[1]
            torch.cuda.set_per_process_memory_fraction(args.budget_gib * GiB / total, 0)
            report["meta"]["device_total_gib"] = total / GiB
            report["meta"]["weights_gib"] = torch.cuda.memory_allocated(0) / GiB
            budget_total = int(args.budget_gib * GiB)
        else:  # host memory: the budget is what this process holds now plus budget_gib
            engine.reset_peak_memory()
            budget_total = engine.peak_memory_bytes() + int(args.budget_gib * GiB)
            report["notes"].append("CPU smoke test: host RSS, budget not enforced")
        report["meta"]["decode"] = engine.describe().get("decode", "generate")
        log(f"model built and loaded on {device}, decode loop {report['meta']['decode']}")

        work = workload(engine, args.images, args.seed, threads=min(16, os.cpu_count() or 2))
        mix: dict[str, int] = {}
        for w in work:
            mix[w.kind] = mix.get(w.kind, 0) + 1
        report["meta"]["mix"] = ", ".join(f"{k} {v}" for k, v in sorted(mix.items()))
        report["meta"]["tokens_min_max"] = [min(w.cost.tokens for w in work),
                                            max(w.cost.tokens for w in work)]
        log(f"workload: {len(work)} images ({report['meta']['mix']}), tokens "
            f"{report['meta']['tokens_min_max']}")
        write()

        # (c)'s model: tune on this device now, then load it the way a worker does.
        planned_total = int(budget_total * args.headroom)
        tune_report = run_probes(engine, planned_total, max_seconds=args.tune_seconds,
                                 max_batch=args.planner_max,
                                 on_result=lambda p: log(f"tune {p.label} x{p.batch}: {p.status}"
                                                         f" {p.seconds:.2f} s peak "
                                                         f"{(p.peak_bytes or 0) / GiB:.2f} GiB"))
        outcome = save(tune_report, engine, settings.profile_dir)
        choice = choose_cost_model(engine, settings.profile_dir)
        model = choice.model
        assert tune_report.fit is not None
        shutil.copy(outcome.profile, out / f"{args.stem}_profile.json")
        shutil.copy(outcome.plot, out / f"{args.stem}_tune.png")
        report["tune"] = {
            "source": "profile fitted by ocrq tune's code at the start of this run"
            if choice.path else "engine default (no profile)",
            "fixed_gib": model.fixed_bytes / GiB, "per_item_kib": model.per_item_bytes / 1024,
            "per_token_kib": model.per_token_bytes / 1024,
            "per_patch_kib": model.per_patch_bytes / 1024, "seconds": tune_report.seconds,
            "max_rel_error": tune_report.fit.max_rel_error,
            "cover_factor": tune_report.fit.cover_factor,
            "probes": [{"label": p.label, "batch": p.batch, "status": p.status,
                        "seconds": p.seconds, "peak_gib": (p.peak_bytes or 0) / GiB}
                       for p in tune_report.probes],
        }
        log(choice.describe())
        write()

        wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
        best = args.fixed
        if "b" in wanted:  # (b)'s size: a bounded sweep
            sizes = [int(s) for s in args.sweep.split(",") if s]
            best, sweep_runs = sweep(engine, work[: args.sweep_subset], sizes, model, log)
            best = best or args.fixed
            report["sweep"] = {"subset": args.sweep_subset, "best": best,
                               "runs": [asdict(r) for r in sweep_runs]}
            write()

        budget_batches = planned_total - model.fixed_bytes
        # Each mode may use a share of the time left (submitting stops at its deadline and
        # the mode is marked partial): (c) and (b) are the short ones, (a) takes the rest.
        all_modes = {
            "c": ("(c) planner", False, args.planner_max, 0.3),
            "b": (f"(b) best fixed = {best}", True, best, 0.45),
            "a": (f"(a) fixed {args.fixed}", True, args.fixed, 1.0),
        }
        modes = [all_modes[m] for m in wanted]
        if modes:
            modes[-1] = (*modes[-1][:3], 1.0)  # the last mode may use all the time left
        for name, fifo, max_items, share in modes:
            deadline = time.monotonic() + (end - time.monotonic()) * share
            mode = run_mode(name, engine, work, model=model, fifo=fifo, max_items=max_items,
                            budget_bytes=budget_batches, deadline=deadline, log=log)
            summarise(mode, args.budget_gib)
            report["modes"].append(asdict(mode))
            write()
        by = {m["name"][:3]: m for m in report["modes"]}
        if all(k in by for k in ("(a)", "(b)", "(c)")):
            c = by["(c)"]["images_per_s"]
            report["speedups"] = {
                "(c)/(b)": c / max(by["(b)"]["images_per_s"], 1e-9),
                "(c)/(a)": c / max(by["(a)"]["images_per_s"], 1e-9),
            }
        report["meta"]["total_s"] = round(time.monotonic() - started, 1)
        write()
        log(markdown(report))
    finally:
        logfile.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
