"""`hunyuan` (ocrq's fast path) against `vllm` (HunyuanOCR on vLLM) on the same images, one run.

For a user with vLLM installed beside ocrq (scripts/vllm-venv.sh builds such a venv on a CPU;
on a GPU, vLLM's own CUDA build): both engines load the same random-weight checkpoint
(ocrq/testing/tiny_hunyuan.py) through their production code, OCR the same pages, and the report
gives, per engine: load seconds, images/s and generated tokens/s at a forced length, and peak
memory (on a GPU the device's used memory, which counts vLLM's preallocated KV cache; on a CPU
the resident memory of this process and its children, vLLM's engine processes included).
The engines run one after the other, each closed before the next loads.

`--check` first runs the token check the tests rely on: for a few distinct images at their
natural length, transformers' `generate()` (the reference) and vLLM must give the same token
ids per image, and the references must differ between images (so that swapped or ignored
images would show).

vLLM could not run on the lent H200 (it is not in its image and pins another torch): no vLLM
figures were measured for this repository; its results folder holds none.

    python bench/engines_gpu.py --out bench/results/engines_gpu   # a GPU, full 1.5 shape
    .venv-vllm/bin/python bench/engines_gpu.py --shape tiny --device cpu --dtype float32 \\
        --pages tiny-120x150 --batches 2 --new-tokens 8 --check --out /tmp/eg   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import PAGES, add_model_args, page_image, run_meta, run_part  # noqa: E402
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.costs import GiB  # noqa: E402

SIZES = {**PAGES, "tiny-120x150": (120, 150), "tiny-160x90": (160, 90)}
# Mixed sizes on purpose: vLLM 0.32 split several images' embeddings by patch counts instead of
# token counts (ocrq/models/vllm/plugin.py), which showed only on some sizes in one batch.
CHECK_IMAGES = (
    (120, 150, "text"),
    (160, 90, "spotting"),
    (64, 64, "text"),
    (150, 100, "parse"),
    (64, 96, "text"),
    (192, 192, "text"),
    (160, 96, "text"),
)


class Report:
    def __init__(self, out: Path, stem: str) -> None:
        self.out, self.stem = out, stem
        self.data: dict[str, Any] = {"meta": {}, "check": [], "runs": [], "errors": []}
        out.mkdir(parents=True, exist_ok=True)

    def write(self) -> None:
        (self.out / f"{self.stem}.json").write_text(json.dumps(self.data, indent=1))
        (self.out / f"{self.stem}.md").write_text(markdown(self.data))


def markdown(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = [
        f"# hunyuan (fast path) vs vllm ({meta.get('gpu', '?')})",
        "",
        f"`{meta.get('command', '')}`; random weights ({meta.get('shape')} "
        f"{meta.get('version')}), {meta.get('dtype')}, torch {meta.get('torch')}, transformers "
        f"{meta.get('transformers')}, vLLM {meta.get('vllm')}; {meta.get('new_tokens')} forced "
        "new tokens per image.",
        "",
    ]
    if data["check"]:
        same = sum(c["equal"] for c in data["check"])
        lines += [f"Token check: {same}/{len(data['check'])} images equal to generate().", ""]
    lines += [
        "| engine | page | batch | load s | images/s | tokens/s | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        lines.append(
            f"| {r['engine']} | {r['page']} | {r['batch']} | {r['load_s']:.1f} | "
            f"{r['images_per_s']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.2f} |"
        )
    for e in data["errors"]:
        lines.append(f"\nerror in {e['part']}: `{e['error']}`")
    return "\n".join(lines) + "\n"


def build_checkpoint(directory: Path, args: argparse.Namespace) -> Path:
    """The version's full shape, or its tiny head_dim-32 one (vLLM's CPU attention needs 32)."""
    from ocrq.testing.tiny_hunyuan import SHAPES, TINY_VLLM_SHAPES, build_checkpoint

    shape = SHAPES[args.version] if args.shape == "full" else TINY_VLLM_SHAPES[args.version]
    path = directory / f"ckpt-{args.version}"
    try:
        return build_checkpoint(path, shape, device=args.device, dtype=args.dtype)
    except Exception as exc:
        print(f"building on {args.device} failed ({exc!r}); building on the CPU", flush=True)
        return build_checkpoint(path, shape, device="cpu", dtype=args.dtype)


def settings(args: argparse.Namespace, ckpt: Path) -> Settings:
    return Settings(
        model=str(ckpt),
        dtype=args.dtype,
        device=args.device,
        max_new_tokens=args.new_tokens,
        memory_budget_gib=args.budget_gib,
        vllm_max_num_seqs=max(args.batches),
        # vLLM 0.32 runs HunYuanVL through its transformers backend, so it has transformers'
        # image-token numerics (ocrq/models/hunyuan/fidelity.py): the reference must too.
        hunyuan_rope="transformers",
        hunyuan_vit_positions="transformers",
    )


def make_engine(name: str, s: Settings, decode: str | None = None) -> Any:
    if name == "vllm":
        from ocrq.models.vllm import VllmEngine

        return VllmEngine(s)
    from ocrq.models.hunyuan import HunyuanEngine

    return HunyuanEngine(s, decode=decode)


def rows_of(engine: Any, items: list[PreparedImage], force: int | None) -> list[Any]:
    """Generated rows (token ids, text) of either engine."""
    if engine.name == "vllm":
        return engine.generate_rows(items, force_tokens=force)
    return engine.generate(items, max_new_tokens=force, min_new_tokens=force).items


def check_items() -> list[PreparedImage]:
    from bench.common import page_image as noise

    return [
        PreparedImage(f"check{i}", noise(w, h), (w, h), task=task)
        for i, (w, h, task) in enumerate(CHECK_IMAGES)
    ]


def token_check(s: Settings) -> list[dict[str, Any]]:
    """generate()'s and vLLM's token ids per image (see the module docstring)."""
    ids: dict[str, list[list[int]]] = {}
    for name, decode in (("generate", "generate"), ("vllm", None)):
        engine = make_engine(name if name == "vllm" else "hunyuan", s, decode)
        engine.load()
        try:
            items = check_items()
            for item in items:
                engine.prepare(item)
            ids[name] = [r.token_ids for r in rows_of(engine, items, None)]
        finally:
            engine.close()
    return [
        {"image": f"{w}x{h} {task}", "generate": g, "vllm": v, "equal": g == v}
        for (w, h, task), g, v in zip(CHECK_IMAGES, ids["generate"], ids["vllm"], strict=True)
    ]


class Peak:
    """Peak memory while a run goes: the device's used bytes (CUDA) or the resident bytes of
    this process and its children (CPU), sampled by a thread."""

    def __init__(self, cuda: bool) -> None:
        import threading

        self.cuda, self.peak, self._stop = cuda, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _now(self) -> int:
        if self.cuda:
            import torch

            free, total = torch.cuda.mem_get_info()
            return total - free
        return tree_rss(os.getpid())

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._now())
            self._stop.wait(0.05)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
            rss[int(entry.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total


def measure(engine_name: str, s: Settings, args: argparse.Namespace) -> list[dict[str, Any]]:
    cuda = args.device.startswith("cuda")
    t = time.perf_counter()
    engine = make_engine(engine_name, s)
    engine.load()
    load_s = time.perf_counter() - t
    out = []
    try:
        for page in args.pages:
            w, h = SIZES[page]
            for batch in args.batches:
                items = [
                    PreparedImage(f"{page}-{i}", page_image(w, h), (w, h), task=args.task)
                    for i in range(batch)
                ]
                for item in items:
                    engine.prepare(item)  # the prefetch threads' part, off the clock
                rows_of(engine, items[:1], 2)  # warm-up
                with Peak(cuda) as peak:
                    t = time.perf_counter()
                    rows = rows_of(engine, items, args.new_tokens)
                    seconds = time.perf_counter() - t
                failed = [r for r in rows if isinstance(r, Exception)]
                if failed:
                    raise RuntimeError(f"{len(failed)} rows failed: {failed[0]!r}")
                tokens = sum(len(r.token_ids) for r in rows)
                out.append(
                    {
                        "engine": engine_name,
                        "page": page,
                        "batch": batch,
                        "load_s": load_s,
                        "seconds": seconds,
                        "images_per_s": batch / seconds,
                        "tokens_per_s": tokens / seconds,
                        "peak_gib": peak.peak / GiB,
                    }
                )
                print(json.dumps(out[-1]), flush=True)
    finally:
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--version", choices=("1.0", "1.5"), default="1.5")
    ap.add_argument("--pages", type=lambda v: v.split(","), default=["page-1024", "a4-1248x1760"])
    ap.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], default=[64, 256])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--task", default="text")
    ap.add_argument("--engines", type=lambda v: v.split(","), default=["hunyuan", "vllm"])
    ap.add_argument("--budget-gib", type=float, default=None, help="OCRQ_MEMORY_BUDGET_GIB")
    ap.add_argument("--check", action="store_true", help="token check against generate() first")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "engines_gpu")
    ap.add_argument("--stem", default="engines_gpu")
    args = ap.parse_args()
    started = time.perf_counter()
    report = Report(args.out, args.stem)
    meta = report.data["meta"]
    meta.update(run_meta(args, "bench/engines_gpu.py"))
    meta.update(shape=args.shape, version=args.version, new_tokens=args.new_tokens)
    try:
        import vllm

        meta["vllm"] = vllm.__version__
    except ImportError:
        meta["vllm"] = "not installed"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint(Path(tmp), args)
        s = settings(args, ckpt)
        if args.check:
            report.data["check"] = run_part(report, started, "check", lambda: token_check(s)) or []
        for name in args.engines:
            runs = run_part(report, started, name, lambda n=name: measure(n, s, args))
            report.data["runs"].extend(runs or [])
            report.write()
    print(markdown(report.data))


if __name__ == "__main__":
    main()
