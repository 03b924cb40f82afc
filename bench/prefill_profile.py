"""Where a batch's prefill goes on one GPU: phases, kernels, and the preprocessing beside it.

Why: with the graphed decode loop (ocrq/models/hunyuan/decode.py) the prefill is most of a batch
(decode_speed_h200_128tok.md: 7.8 s of 9.8 s for 128 A4 pages), so the next lever must be found by
measurement, not guessed. One call measures, for each page size at one batch:

* the prefill split into phases by forward hooks that synchronise the device: multimodal RoPE
  indices, vision patch embedding, the 27 vision blocks, the patch mergers, the text decoder,
  the lm_head, and the copy of the KV cache into the static cache;
* a torch.profiler run of the same prefill: GPU kernels and host ops by time, GPU busy share;
* the vision attention alone under each sdpa backend, and one vision MLP matmul's TFLOP/s,
  to see how far the tower's arithmetic is from the chip;
* the processor: which image processor class runs, ms per image alone, and the wall time of a
  batch preprocessed by a pool of threads as the worker's prefetch does.

    PYTHONUNBUFFERED=1 python bench/prefill_profile.py --out OUT
    python bench/prefill_profile.py --shape tiny --device cpu --batch 2 --out /tmp/pp  # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    BLANK,
    PAGES,
    DeviceSpan,
    add_model_args,
    cuda_ms,
    kernel_events,
    page_image,
    random_checkpoint,
    run_meta,
    top,
)
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.hunyuan import HunyuanEngine  # noqa: E402


class PhaseClock:
    """Forward hooks that stamp the wall clock after synchronising the device."""

    def __init__(self, torch: Any, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda
        self.stamps: list[tuple[str, float]] = []
        self.handles: list[Any] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
        self.stamps.append((name, time.perf_counter()))

    def hook(self, module: Any, before: str | None, after: str | None) -> None:
        if before:
            self.handles.append(module.register_forward_pre_hook(
                lambda *_a, n=before: self.mark(n)))
        if after:
            self.handles.append(module.register_forward_hook(lambda *_a, n=after: self.mark(n)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def phases(self) -> dict[str, float]:
        """Seconds between consecutive stamps, summed by the name of the stamp that ends them."""
        out: dict[str, float] = {}
        for (_, t0), (name, t1) in zip(self.stamps, self.stamps[1:], strict=False):
            out[name] = out.get(name, 0.0) + (t1 - t0)
        return out


def install_clock(torch: Any, engine: HunyuanEngine, cuda: bool) -> PhaseClock:
    """Stamps named for the phase that ends at them. The fast path's fused text prefill calls
    the vision tower and the lm_head but not the model's forward: those are its landmarks."""
    clock = PhaseClock(torch, cuda)
    model = engine.model
    tower = model.model.vision_tower
    clock.hook(tower, "collate+h2d+embed_tokens", None)
    clock.hook(tower.embeddings, None, "vision_patch_embed")
    clock.hook(tower.layers[-1], None, "vision_blocks")
    clock.hook(tower.patch_merger, None, "vision_mergers")
    clock.hook(model.lm_head, "image_scatter+text_decoder", "lm_head")
    return clock


def prefill_phases(torch: Any, engine: HunyuanEngine, row: Any, batch: int, cuda: bool
                   ) -> dict[str, Any]:
    """One fast-path generate() with 2 new tokens, phases timed by synchronising hooks."""
    item = PreparedImage("p", BLANK, (8, 8))
    clock = install_clock(torch, engine, cuda)
    try:
        clock.mark("start")
        out = engine.generate([item] * batch, encoded=[row] * batch, max_new_tokens=2,
                              min_new_tokens=2, decode="fast")
        clock.mark("kv_copy+first_token+decode")
    finally:
        clock.remove()
    stats = engine.last_decode
    phases = clock.phases()
    return {"batch": batch, "prompt_tokens": out.padded_length,
            "prefill_s": stats.prefill_s if stats else None,
            "generate_s": out.timings.get("generate"), "collate_s": out.timings.get("preprocess"),
            "phases_s": {k: round(v, 4) for k, v in phases.items()}}


def prefill_profile(torch: Any, engine: HunyuanEngine, row: Any, batch: int) -> dict[str, Any]:
    """torch.profiler over one prefill (2 new tokens): kernels, host ops, GPU busy share."""
    from torch.profiler import ProfilerActivity, profile

    item = PreparedImage("p", BLANK, (8, 8))
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate([item] * batch, encoded=[row] * batch, max_new_tokens=2,
                        min_new_tokens=2, decode="fast")
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    device, host = kernel_events(prof)
    busy = sum(e.time_range.end - e.time_range.start for e in device) / 1e6
    return {"batch": batch, "wall_s_profiled": wall, "gpu_busy_s": busy,
            "kernels": len(device),
            "top_gpu": top([DeviceSpan(e) for e in device], "dur", n=20),
            "top_cpu_self": top(host, "self_cpu_time_total", n=15)}


def vision_attention_backends(torch: Any, images: int, patches: int, heads: int, dim: int
                              ) -> list[dict[str, Any]]:
    """One vision attention call over `images` equal images, under each sdpa backend."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(images, heads, patches, dim, device="cuda", dtype=torch.bfloat16,
                           generator=g) for _ in range(3))
    flops = 4 * images * heads * patches * patches * dim
    rows = []
    ref = None
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("default", None)):
        try:
            def call(backend: Any = backend) -> Any:
                if backend is None:
                    return F.scaled_dot_product_attention(q, k, v)
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v)
            out = call()
            ref = out if ref is None else ref
            ms = cuda_ms(torch, call, reps=5)
            rows.append({"backend": name, "ms": ms, "tflops": flops / (ms / 1e3) / 1e12,
                         "max_diff_vs_first": float((out.float() - ref.float()).abs().max())})
        except Exception as exc:
            rows.append({"backend": name, "error": repr(exc)[:200]})
    return rows


def matmul_rate(torch: Any, tokens: int, n_in: int, n_out: int) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16, generator=g)
    ms = cuda_ms(torch, lambda: torch.nn.functional.linear(x, w), reps=5)
    return {"tokens": tokens, "in": n_in, "out": n_out, "ms": ms,
            "tflops": 2 * tokens * n_in * n_out / (ms / 1e3) / 1e12}


def preprocessing(engine: HunyuanEngine, page: str, count: int, threads: int
                  ) -> dict[str, Any]:
    w, h = PAGES[page]
    image = page_image(w, h)
    items = [PreparedImage(f"{page}-{i}", image.copy(), (w, h)) for i in range(count)]
    engine.preprocess(items[0])
    t = time.perf_counter()
    for it in items[:8]:
        engine.preprocess(it)
    alone_ms = (time.perf_counter() - t) / 8 * 1e3
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(engine.preprocess, items))
    pooled = time.perf_counter() - t
    return {"page": page, "images": count, "threads": threads, "alone_ms_per_image": alone_ms,
            "pool_wall_s": pooled, "pool_ms_per_image": pooled / count * 1e3,
            "image_processor": type(engine.processor.image_processor).__name__}


def contention(torch: Any, engine: HunyuanEngine, page: str, batch: int, threads: int
               ) -> list[dict[str, Any]]:
    """A fast generate() (32 new tokens) of `batch` rows alone, and while a pool of `threads`
    preprocesses `batch` more images as the worker's prefetch does, with the engine letting
    1, 2, 4 or `threads` of them run the processor at once (`PREPROCESS_SLOTS`,
    ocrq/models/hunyuan/inputs.py): how much does the prefetch slow the batch (GIL), and how many
    slots keep it from doing so?"""
    import threading

    w, h = PAGES[page]
    image = page_image(w, h)
    row = engine.preprocess(PreparedImage(page, image, (w, h)))
    item = PreparedImage("p", BLANK, (8, 8))
    prep = engine.preprocess_row
    default = prep.slots
    rows = []
    try:
        for slots in (0, 1, 2, 4, threads):
            prep.slots = threading.BoundedSemaphore(max(slots, 1))
            upcoming = [PreparedImage(f"u{i}", image.copy(), (w, h)) for i in range(batch)]
            t = time.perf_counter()
            pool = ThreadPoolExecutor(threads) if slots else None
            pending = [pool.submit(engine.preprocess, it) for it in upcoming] if pool else []
            out = engine.generate([item] * batch, encoded=[row] * batch, max_new_tokens=32,
                                  min_new_tokens=32, decode="fast")
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            gen = time.perf_counter() - t
            wait(pending)
            both = time.perf_counter() - t
            if pool:
                pool.shutdown()
            stats = engine.last_decode
            rows.append({"page": page, "batch": batch, "intra_op_threads": torch.get_num_threads(),
                         "prefetch_pool": threads if slots else 0, "slots": slots,
                         "generate_s": gen, "until_both_s": both,
                         "collate_s": out.timings["preprocess"],
                         "prefill_s": stats.prefill_s if stats else None,
                         "decode_s": stats.decode_s if stats else None})
            del upcoming, pending
    finally:
        prep.slots = default
    return rows


def markdown(d: dict[str, Any]) -> str:
    m = d["meta"]
    lines = [f"# Prefill breakdown on {m.get('gpu')}", "",
             f"torch {m.get('torch')}, transformers {m.get('transformers')}, random weights of "
             f"the {m.get('shape')} shape. Command: `{m.get('command')}`.", ""]
    for page, r in d["phases"].items():
        lines += [f"## {page}, batch {r['batch']} ({r['prompt_tokens']} prompt tokens)", "",
                  f"prefill {r['prefill_s']:.3f} s (fast path, synchronising hooks add a little)",
                  "", "| phase | s | share |", "|---|---:|---:|"]
        total = sum(r["phases_s"].values())
        for k, v in r["phases_s"].items():
            lines.append(f"| {k} | {v:.3f} | {v / total:.0%} |")
        p = d["profile"].get(page)
        if p:
            lines += ["", f"profiled wall {p['wall_s_profiled']:.3f} s, GPU busy "
                      f"{p['gpu_busy_s']:.3f} s, {p['kernels']} kernels", "",
                      "| GPU kernel | ms | calls |", "|---|---:|---:|"]
            lines += [f"| `{k['name']}` | {k['us'] / 1e3:.1f} | {k['calls']} |"
                      for k in p["top_gpu"]]
            lines += ["", "| host op (self) | ms | calls |", "|---|---:|---:|"]
            lines += [f"| `{k['name']}` | {k['us'] / 1e3:.1f} | {k['calls']} |"
                      for k in p["top_cpu_self"]]
        lines.append("")
    if d["attention"]:
        lines += ["## Vision attention alone", "", "| shape | backend | ms | TFLOP/s | diff |",
                  "|---|---|---:|---:|---:|"]
        for a in d["attention"]:
            if "error" in a:
                lines.append(f"| {a['shape']} | {a['backend']} | error: {a['error']} | | |")
            else:
                lines.append(f"| {a['shape']} | {a['backend']} | {a['ms']:.2f} | "
                             f"{a['tflops']:.0f} | {a['max_diff_vs_first']:.4f} |")
        lines.append("")
    for mm in d["matmul"]:
        lines.append(f"- linear {mm['tokens']}x{mm['in']} -> {mm['out']}: {mm['ms']:.2f} ms, "
                     f"{mm['tflops']:.0f} TFLOP/s")
    if d.get("contention"):
        lines += ["", "## Prefetch beside a batch (fast path, 32 new tokens)", "",
                  "| page | batch | intra-op threads | prefetch pool | slots | generate s "
                  "| until both s "
                  "| collate s | prefill s | decode s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in d["contention"]:
            lines.append(f"| {c['page']} | {c['batch']} | {c['intra_op_threads']} | "
                         f"{c['prefetch_pool']} | {c.get('slots', '')} | {c['generate_s']:.3f} | "
                         f"{c['until_both_s']:.3f} "
                         f"| {c['collate_s']:.3f} | {c['prefill_s']:.3f} | {c['decode_s']:.3f} |")
    if d["preprocess"]:
        lines += ["", "## Preprocessing (CPU)", "",
                  "| page | processor | alone ms/img | threads | pool ms/img |",
                  "|---|---|---:|---:|---:|"]
        for p in d["preprocess"]:
            lines.append(f"| {p['page']} | {p['image_processor']} | {p['alone_ms_per_image']:.1f}"
                         f" | {p['threads']} | {p['pool_ms_per_image']:.1f} |")
    for e in d["errors"]:
        lines += ["", f"ERROR in {e['part']}: {e['error']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="prefill_profile_h200")
    add_model_args(ap)
    ap.add_argument("--pages", default="page-1024,a4-1248x1760")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()

    import torch

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    d: dict[str, Any] = {
        "meta": run_meta(args, "bench/prefill_profile.py"),
        "phases": {}, "profile": {}, "attention": [], "matmul": [], "preprocess": [],
        "contention": [], "errors": [],
    }

    def write() -> None:
        (args.out / f"{args.stem}.json").write_text(json.dumps(d, indent=1, default=str))
        (args.out / f"{args.stem}.md").write_text(markdown(d))

    def part(name: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            d["errors"].append({"part": name, "error": repr(exc)[:600]})
            traceback.print_exc()
            return None
        finally:
            write()
            print(f"[{time.perf_counter() - started:.0f} s] {name} done", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = random_checkpoint(Path(tmp), args)
        settings = Settings(model=str(ckpt), model_subfolder=None, dtype=args.dtype,
                            device=args.device, max_new_tokens=2)
        engine = HunyuanEngine(settings, decode="fast")
        engine.load()
        warm = PreparedImage("warm", page_image(512, 512), (512, 512))
        engine.generate([warm, warm], max_new_tokens=2, min_new_tokens=2, decode="fast")
        for page in args.pages.split(","):
            w, h = PAGES[page]
            row = engine.preprocess(PreparedImage(page, page_image(w, h), (w, h)))
            part(f"warm_{page}", lambda row=row: prefill_phases(torch, engine, row, 2, cuda))
            found = part(f"phases_{page}", lambda row=row: prefill_phases(
                torch, engine, row, args.batch, cuda))
            if found:
                d["phases"][page] = found
            if cuda:
                found = part(f"profile_{page}", lambda row=row: prefill_profile(
                    torch, engine, row, args.batch))
                if found:
                    d["profile"][page] = found
                grid = row.image_grid_thw[0].tolist()
                patches = grid[1] * grid[2]
                vc = engine.model.config.vision_config
                heads = getattr(vc, "attention_heads", None) or vc.num_attention_heads
                dim = vc.hidden_size // heads
                for a in part(f"attention_{page}", lambda p=patches, hh=heads, dd=dim:
                              vision_attention_backends(torch, args.batch, p, hh, dd)) or []:
                    d["attention"].append(dict(a, shape=f"{args.batch}x{heads}x{patches}x{dim}"))
                mm = part(f"matmul_{page}", lambda p=patches, vc=vc: matmul_rate(
                    torch, args.batch * p, vc.hidden_size, vc.intermediate_size))
                if mm:
                    d["matmul"].append(mm)
            torch.cuda.empty_cache() if cuda else None
            pre = part(f"preprocess_{page}", lambda page=page: preprocessing(
                engine, page, args.batch, args.threads))
            if pre:
                d["preprocess"].append(pre)
            if cuda:
                d["contention"] += part(f"contention_{page}", lambda page=page: contention(
                    torch, engine, page, args.batch, args.threads)) or []
        d["meta"]["total_s"] = round(time.perf_counter() - started, 1)
        write()
        print(markdown(d), flush=True)


if __name__ == "__main__":
    main()
