"""What the HunyuanOCR benchmarks share: the model they run, how they say what ran, timers.

Every benchmark runs a random-weight checkpoint (ocrq/testing/tiny_hunyuan.py: the full 1.0 or 1.5
shape on a GPU, the tiny ones for smoke tests on a CPU) loaded through the engine's own path, and
starts its report with `run_meta`, so a result file says how to reproduce it. Import this module
after the script has put the repository on sys.path.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

from PIL import Image

PAGES = {"page-1024": (1024, 1024), "receipt-886x1699": (886, 1699), "a4-1248x1760": (1248, 1760)}
# Stands in for images whose rows are handed to `generate` already preprocessed (`encoded`).
BLANK = Image.new("RGB", (8, 8))


# -- the model ------------------------------------------------------------------------------------


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--shape, --device, --dtype: the random-weight model a benchmark runs."""
    ap.add_argument("--shape", choices=("full", "tiny"), default="full")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")


def run_meta(args: argparse.Namespace, script: str) -> dict[str, Any]:
    """The facts every report starts with: how to rerun it, on what, with which libraries."""
    import torch
    import transformers

    cuda = args.device.startswith("cuda")
    return {
        "command": " ".join(["python", script, *sys.argv[1:]]),
        "shape": "HunyuanOCR-1.0" if args.shape == "full" else "tiny",
        "gpu": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": args.dtype,
    }


def random_checkpoint(directory: Path, args: argparse.Namespace, version: str = "1.0") -> Path:
    """A checkpoint of --shape and `version` ("1.0": flat config, 2048² pixels; "1.5": nested,
    ~4096²) with random weights under `directory`, built on --device (much faster on a GPU), on
    the CPU if that fails."""
    from ocrq.testing.tiny_hunyuan import SHAPES, TINY_SHAPES, build_checkpoint

    ckpt = directory / ("ckpt" if version == "1.0" else f"ckpt-{version}")
    shape = SHAPES[version] if args.shape == "full" else TINY_SHAPES[version]
    try:
        build_checkpoint(ckpt, shape, device=args.device, dtype=args.dtype)
    except Exception as exc:
        print(f"building on {args.device} failed ({exc!r}); building on the CPU", flush=True)
        build_checkpoint(ckpt, shape, device="cpu", dtype=args.dtype)
    return ckpt


def page_image(width: int, height: int) -> Any:
    """A page-like image: noise, so nothing about its content is special."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(width * 7919 + height)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


# -- timing and profiles ------------------------------------------------------------------------


class StepClock:
    """Forward hook: times the first forward (prefill) and the steps after it."""

    def __init__(self, torch: Any, device: str) -> None:
        self.torch, self.device = torch, device
        self.reset()

    def reset(self) -> None:
        self.started = time.perf_counter()
        self.stamps: list[float] = []
        self.prefill_peak = 0

    def __call__(self, _module: Any, _args: Any, _output: Any) -> None:
        if not self.stamps and self.device.startswith("cuda"):
            self.torch.cuda.synchronize()
            self.prefill_peak = self.torch.cuda.max_memory_allocated()
        self.stamps.append(time.perf_counter())


def cuda_ms(torch: Any, fn: Any, reps: int, warm: int = 2) -> float:
    """Median milliseconds of fn() by CUDA events."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def cuda_us_back_to_back(torch: Any, fn: Any, reps: int, warm: int = 3) -> float:
    """Mean microseconds of fn() over `reps` calls queued back to back between two CUDA events:
    the GPU's time with the launches overlapped, as inside a graphed step."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / reps


def cuda_us_graphed(torch: Any, fn: Any, reps: int, replays: int = 5, warm: int = 3) -> float:
    """Mean microseconds of fn() over `reps` calls captured in one CUDA graph, replayed
    `replays` times between two CUDA events: the GPU's own time, no host launch between calls.

    Why beside `cuda_us_back_to_back`: a call whose GPU work is a few microseconds (a decode
    attention over a few rows) is timed there by its host launches, and read 7x the running
    loop's graphed figure (bench/results/loop_profile/README.md, stop 44). fn must be
    capturable (no host sync), as everything the loop's graphed step calls is."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch's docs advise
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    del graph
    return a.elapsed_time(b) * 1000 / (reps * replays)


def kernel_events(prof: Any) -> tuple[list[Any], list[Any]]:
    """(device events, host events) of a torch.profiler run."""
    from torch.autograd import DeviceType

    device, host = [], []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            host.append(e)
        elif not (getattr(e, "is_user_annotation", False) or e.name.startswith("step_")):
            device.append(e)  # kernels, copies, memsets; not the GPU copy of our labels
    return device, host


def top(events: list[Any], attr: str, n: int = 12) -> list[dict[str, Any]]:
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in events:
        total[e.name] += getattr(e, attr)
        count[e.name] += 1
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:n]
    return [{"name": name[:90], "us": round(us, 1), "calls": count[name]} for name, us in ranked]


class DeviceSpan:
    """A device event with its duration as an attribute (for `top`)."""

    def __init__(self, e: Any) -> None:
        self.name = e.name
        self.dur = e.time_range.end - e.time_range.start


def run_part(report: Any, started: float, name: str, fn: Any) -> Any:
    """One named part of a long GPU run: its failure is recorded, not fatal, its seconds go to
    the report's meta, and the report is written after it, so a run cut short keeps what it
    measured. `report` has `data` (with "meta" and "errors") and `write()`."""
    t = time.perf_counter()
    try:
        return fn()
    except Exception as exc:
        report.data["errors"].append({"part": name, "error": repr(exc)[:600]})
        traceback.print_exc()
        return None
    finally:
        report.data["meta"][f"{name}_s"] = round(time.perf_counter() - t, 1)
        report.write()
        print(f"[{time.perf_counter() - started:.0f} s] {name} done", flush=True)
