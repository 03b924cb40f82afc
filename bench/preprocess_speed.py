"""Pages/s of HunyuanOCR's preprocessing: transformers' processor vs ocrq's tensor path.

What a prefetch thread runs per page (`Preprocessor.__call__`: resolution cap, resize, normalise,
patchify, tokenise, RoPE positions, pixels staged in the model's dtype), per page class, with one
thread and with N threads (N = the cores this process may use), and with N-1 threads beside a busy
"GPU feeder" thread that launches tiny torch ops back to back, as the thread that feeds the GPU
does, and reports its own rate against its rate alone (the GIL it loses to preprocessing).

Paths:
* processor-2: transformers' processor, at most 2 threads inside at once (PREPROCESS_SLOTS, the
  shipped setting for that path);
* processor-N: the same with no limit (what the GIL does to it);
* tensor: ocrq/models/hunyuan/pixels.py + spans.py, at most `tensor_slots()` threads at once;
* tensor-gpu (with --device cuda only): the pixels made on the GPU from the uint8 image (not
  what the engine does; measured so the choice stays a measured one);
* control: no preprocessing, a 6M-float torch op per "page" that releases the GIL throughout,
  so its feeder column shows what the feeder loses to CPU contention alone (its pages/s mean
  nothing); a path's feeder rate below the control's is the GIL's share.

The model is the tiny random checkpoint (ocrq/testing/tiny_hunyuan.py) with the released image
limits (1.0: 512²..2048²; the text side's cost does not depend on the weights), bf16 pixels, and
torch at one intra-op thread as the engine sets it on a GPU host. With --device cuda the
pixels are staged in pinned memory as the engine does there and the feeder's ops run on the GPU.

    python bench/preprocess_speed.py --out bench/results/preprocess_speed  # this CPU
    # a GPU host, < 60 s:
    python bench/preprocess_speed.py --device cuda --out bench/results/preprocess_speed
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.hunyuan.geometry import geometry_of  # noqa: E402
from ocrq.models.hunyuan.inputs import Preprocessor, tensor_slots  # noqa: E402

PAGES = {
    "page-1024": (1024, 1024),
    "receipt-886x1699": (886, 1699),
    "a4-1248x1760": (1248, 1760),
    "a4-300dpi-2480x3508": (2480, 3508),
}
LIMITS = (512 * 512, 2048 * 2048)  # HunyuanOCR 1.0's; 1.5's 4096² would leave 300 dpi unshrunk


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def page_image(width: int, height: int) -> Any:
    """A scan-like page: white with dark text-like strokes and noise, so the resize sees edges."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(width * 7919 + height)
    pixels = np.full((height, width, 3), 245, dtype=np.uint8)
    for y in range(40, height - 40, 28):  # "lines" of random dark "glyphs"
        xs = rng.integers(40, max(41, width - 60), size=max(1, width // 30))
        for x in xs:
            pixels[y : y + 14, x : x + 8] = rng.integers(0, 90, size=3, dtype=np.uint8)
    noise = rng.integers(-8, 8, size=pixels.shape)
    return Image.fromarray(np.clip(pixels.astype(int) + noise, 0, 255).astype(np.uint8))


class Model:
    """What a Preprocessor reads of the model, with the engine's dtype."""

    def __init__(self, model: Any, dtype: Any) -> None:
        self.model, self.config, self.dtype = model.model, model.config, dtype


def build(device: str) -> dict[str, Any]:
    """The preprocessors to compare, on the tiny 1.0 checkpoint with the released limits."""
    import torch
    from transformers import AutoProcessor, HunYuanVLForConditionalGeneration

    from ocrq.models.hunyuan.pixels import PixelEncoder, PixelSpec
    from ocrq.models.hunyuan.prompts import PROMPTS_1_0, PromptTemplates
    from ocrq.testing.tiny_hunyuan import TINY_SHAPES, build_checkpoint

    folder = Path(tempfile.mkdtemp(prefix="ocrq-prep-"))
    path = build_checkpoint(folder / "tiny", TINY_SHAPES["1.0"])
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    processor = copy.deepcopy(processor)
    processor.image_processor.size["shortest_edge"] = LIMITS[0]
    processor.image_processor.size["longest_edge"] = LIMITS[1]
    model = Model(HunYuanVLForConditionalGeneration.from_pretrained(path), torch.bfloat16)
    templates = PromptTemplates(processor)
    geometry = geometry_of(processor)
    cuda = device.startswith("cuda")

    def make(mode: str) -> Preprocessor:
        return Preprocessor(
            model,
            processor,
            templates,
            geometry,
            pin=cuda,
            prompt_for=lambda item: PROMPTS_1_0["text"],
            cap_of=lambda item: geometry.max_pixels,
            mode=mode,
        )

    paths: dict[str, Any] = {"processor-2": make("processor"), "tensor": make("tensor")}
    unlimited = make("processor")
    unlimited.slots = threading.BoundedSemaphore(1024)
    paths["processor-N"] = unlimited
    paths["control"] = Control()
    if cuda:
        gpu = make("tensor")
        gpu.pixels = PixelEncoder(
            PixelSpec.of(processor.image_processor), geometry, dtype=torch.bfloat16, device=device
        )
        inner = gpu.encode

        def encode_synced(text: str, image: Any, inner: Any = inner) -> Any:
            row = inner(text, image)
            torch.cuda.current_stream().synchronize()  # the row is ready, not just launched
            return row

        gpu.encode = encode_synced  # type: ignore[method-assign]
        paths["tensor-gpu"] = gpu
    return paths


class Control:
    """A GIL-free "page": one 6M-float in-place multiply (~as much memory as an A4's pixels)."""

    def __init__(self) -> None:
        self.local = threading.local()

    def __call__(self, item: PreparedImage) -> None:
        import torch

        if not hasattr(self.local, "x"):
            self.local.x = torch.ones(6_000_000)
        self.local.x.mul_(1.0)


class Feeder(threading.Thread):
    """Launches tiny torch ops back to back, as the thread feeding the GPU launches kernels; each
    op releases and retakes the GIL, so its rate drops when other threads hold the GIL."""

    def __init__(self, device: str) -> None:
        super().__init__(daemon=True)
        import torch

        self.x = torch.zeros(16, device=device)
        self.cuda = device.startswith("cuda")
        self.stop = threading.Event()
        self.ops = 0
        self.worst_gap = 0.0

    def run(self) -> None:
        import torch

        last = time.perf_counter()
        while not self.stop.is_set():
            for _ in range(50):
                self.x.add_(1.0)
            if self.cuda:
                torch.cuda.current_stream().synchronize()
            self.ops += 50
            now = time.perf_counter()
            self.worst_gap = max(self.worst_gap, now - last)
            last = now


def feeder_rate(device: str, seconds: float) -> float:
    feeder = Feeder(device)
    feeder.start()
    time.sleep(seconds)
    feeder.stop.set()
    feeder.join()
    return feeder.ops / seconds


def measure(
    pre: Any, item: PreparedImage, threads: int, seconds: float, feeder_device: str | None
) -> dict[str, Any]:
    """Pages/s of `threads` threads each preprocessing `item` until `seconds` have passed."""
    done = [0] * threads
    deadline = time.perf_counter() + seconds

    def work(i: int) -> None:
        while time.perf_counter() < deadline:
            pre(item)
            done[i] += 1

    feeder = Feeder(feeder_device) if feeder_device else None
    if feeder:
        feeder.start()
    started = time.perf_counter()
    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - started
    out: dict[str, Any] = {"pages": sum(done), "pages_per_s": sum(done) / elapsed}
    if feeder:
        feeder.stop.set()
        feeder.join()
        out["feeder_ops_per_s"] = feeder.ops / elapsed
        out["feeder_worst_gap_ms"] = feeder.worst_gap * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (pinned staging, GPU feeder)")
    ap.add_argument("--threads", type=int, default=cores(), help="N (default: usable cores)")
    ap.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    ap.add_argument("--pages", nargs="*", default=list(PAGES), choices=list(PAGES))
    ap.add_argument("--out", type=Path, default=None, help="folder for the .json and .md")
    ap.add_argument("--name", default=None, help="result file stem")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)  # as the engine sets it on a GPU host (checkpoint.py)
    began = time.perf_counter()
    paths = build(args.device)
    feeder_device = args.device
    baseline = feeder_rate(feeder_device, args.seconds)
    meta = {
        "command": " ".join(["python", "bench/preprocess_speed.py", *sys.argv[1:]]),
        "cpu": cpu_name(),
        "cores_usable": cores(),
        "threads": args.threads,
        "tensor_slots": tensor_slots(),
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "limits": LIMITS,
        "feeder_ops_per_s_alone": baseline,
    }
    print(json.dumps(meta), flush=True)
    rows = []
    for page in args.pages:
        w, h = PAGES[page]
        item = PreparedImage("bench", page_image(w, h), (w, h), task="text")
        for name, pre in paths.items():
            pre(item)  # warm: template cache, allocator
            # Beside the feeder, one thread fewer: the feeder needs a core of its own (as the
            # thread feeding the GPU does), so what it loses is the GIL, not its core.
            fed = max(1, args.threads - 1)
            for threads, feeder in ((1, False), (args.threads, False), (fed, True)):
                if name == "processor-N" and threads == 1:
                    continue  # one thread is one thread: processor-2's row
                r = measure(pre, item, threads, args.seconds, feeder_device if feeder else None)
                row = {"page": page, "path": name, "threads": threads, "feeder": feeder, **r}
                if feeder:
                    row["feeder_share"] = r["feeder_ops_per_s"] / baseline
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta["wall_s"] = time.perf_counter() - began
    report = {"meta": meta, "rows": rows}
    if args.out:
        stem = args.name or f"preprocess_speed_{args.device.split(':')[0]}"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / f"{stem}.md").write_text(markdown(report))
    print(f"done in {meta['wall_s']:.1f} s", flush=True)


def markdown(report: dict[str, Any]) -> str:
    meta, rows = report["meta"], report["rows"]
    n = meta["threads"]
    lines = [
        f"# Preprocessing pages/s: processor vs tensor path ({meta['device']})",
        "",
        f"`{meta['command']}`",
        "",
        f"CPU: {meta['cpu']}, {meta['cores_usable']} usable cores; N = {n} threads; "
        f"tensor path slots {meta['tensor_slots']}; GPU: {meta['gpu'] or 'none'}; "
        f"torch {meta['torch']}, one intra-op thread; limits {meta['limits']}; "
        f"{meta['wall_s']:.0f} s wall. Feeder alone: {meta['feeder_ops_per_s_alone']:.0f} ops/s.",
        "",
        "| page | path | 1 thread p/s | N threads p/s | N-1 + feeder p/s | feeder rate kept "
        "| feeder worst gap ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    keyed = {(r["page"], r["path"], r["threads"], r["feeder"]): r for r in rows}
    for page in dict.fromkeys(r["page"] for r in rows):
        for path in dict.fromkeys(r["path"] for r in rows):
            one = keyed.get((page, path, 1, False)) or keyed.get((page, "processor-2", 1, False))
            many = keyed.get((page, path, n, False))
            fed = keyed.get((page, path, max(1, n - 1), True))
            if not (one and many and fed):
                continue
            lines.append(
                f"| {page} | {path} | {one['pages_per_s']:.1f} | {many['pages_per_s']:.1f} | "
                f"{fed['pages_per_s']:.1f} | {fed['feeder_share']:.0%} | "
                f"{fed['feeder_worst_gap_ms']:.1f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
