"""HunyuanOCR 1.5 against 1.0 under the resolution presets, and what the repetition guard saves.

One run, one GPU, random weights of the full 1.0 and 1.5 shapes (ocrq/testing/tiny_hunyuan.py; the
backbone is the same, 1.5 takes up to ~4096² pixels where 1.0 stops at 2048²). For an A4 page at
150 dpi (1248x1760) and at 300 dpi (2480x3508), under each preset
(ocrq/models/hunyuan/resolution.py):

* "document" (task parse: 1536² pixels), "scene" (task spotting: 2048²) and "full" (a job's
  max_pixels at 4096²: the model's own limit);
* the size the model sees, its prompt tokens (image tokens included) and vision patches;
* prefill seconds per page and decode ms per step of a batch, fast path (fused prefill, graphed
  decode), and pages/s of the whole call at 1024 forced new tokens (rows preprocessed before, as
  the prefetch threads do; collate and copy included);
* the batch's peak memory increment against the cost model's prediction (the planner's
  `batch_bytes`), which the issue wants within +-10%.

Then the guard: a batch of A4 pages on 1.5 whose rows all fall into a 7-token loop at their 64th
token (a test-only lm_head hook, `ForcedLoop`), max 1024 new tokens, with the version's guard and
without; and the same with half the rows looping (a batch ends with its longest row, so there the
guard saves tokens and cache but not time).

Each (version, page, preset) is measured once; a preset that shows the model the same image with
the same prompt as one already measured reuses it ("same as"). A batch is as large as --batch
allows, fewer where a page brings more than --patch-budget vision patches in total. Results go to
--out as JSON and a markdown table after every part, so a run cut short keeps what it measured.

    # H200, ~4-5 min:
    PYTHONUNBUFFERED=1 python bench/hunyuan15_presets.py --out bench/results/hunyuan15_presets
    python bench/hunyuan15_presets.py --smoke --out /tmp/h15  # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    add_model_args,
    page_image,
    random_checkpoint,
    run_meta,
    run_part,
)
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.hunyuan import HunyuanEngine  # noqa: E402
from ocrq.models.hunyuan.versions import RepetitionGuard  # noqa: E402
from ocrq.testing.tiny_hunyuan import ForcedLoop  # noqa: E402

GiB = 1024**3
PAGES = {"a4-150dpi": (1248, 1760), "a4-300dpi": (2480, 3508)}
# preset -> (task, the job's own max_pixels)
PRESETS = {"document": ("parse", None), "scene": ("spotting", None), "full": ("parse", 4096**2)}
LOOP = 7  # tokens in the forced loop
LOOP_START = 64
# The smoke run's guard: the version's needs ~350 tokens to fire, minutes on a CPU.
SMOKE_GUARD = RepetitionGuard(every=8, min_repeats=4, max_unit=8, min_span=16)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="hunyuan15_presets_h200")
    ap.add_argument("--versions", default="1.0,1.5")
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--patch-budget", type=int, default=600_000, help="ViT patches per batch")
    ap.add_argument("--guard-batch", type=int, default=32)
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop starting runs after")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few tokens")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.device, args.dtype = "tiny", "cpu", "float32"
        args.new_tokens, args.batch, args.guard_batch = 8, 2, 2
        args.stem = "hunyuan15_presets_smoke"
    return args


class Report:
    def __init__(self, out: Path, stem: str) -> None:
        self.out, self.stem = out, stem
        self.data: dict[str, Any] = {"meta": {}, "runs": [], "guard": [], "errors": []}
        out.mkdir(parents=True, exist_ok=True)

    def write(self) -> None:
        (self.out / f"{self.stem}.json").write_text(json.dumps(self.data, indent=1))
        (self.out / f"{self.stem}.md").write_text(markdown(self.data))


def markdown(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = [
        f"# HunyuanOCR 1.5 vs 1.0 under the resolution presets ({meta.get('gpu', '?')})",
        "",
        f"`{meta.get('command', '')}`; random weights, {meta.get('dtype')}, torch "
        f"{meta.get('torch')}, transformers {meta.get('transformers')}; fast path, "
        f"{meta.get('new_tokens')} forced new tokens; {meta.get('total_s', '?')} s in all.",
        "",
        "| version | page | preset | model sees | prompt tokens | ViT patches | batch | "
        "prefill s/page | decode ms/step | pages/s | peak +GiB | predicted +GiB | pred/meas |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["runs"]:
        if "same_as" in r:
            lines.append(
                f"| {r['version']} | {r['page']} | {r['preset']} | {r['sees']} | "
                f"{r['prompt_tokens']} | {r['patches']} | same as {r['same_as']} "
                "| | | | | | |"
            )
            continue
        ratio = r.get("predicted_vs_measured")
        lines.append(
            f"| {r['version']} | {r['page']} | {r['preset']} | {r['sees']} | "
            f"{r['prompt_tokens']} | {r['patches']} | {r['batch']} | "
            f"{r['prefill_s_per_page']:.3f} | {r['decode_ms_per_step']:.2f} | "
            f"{r['pages_per_s']:.2f} | {r['increment_gib']:.2f} | "
            f"{r['predicted_increment_gib']:.2f} | {f'{ratio:.3f}' if ratio else '-'} |"
        )
    if data["guard"]:
        lines += [
            "",
            "## Repetition guard on a forced-loop batch (1.5)",
            "",
            "| rows looping | guard | batch | new tokens kept (mean) | stopped rows | decode "
            "steps | seconds | pages/s |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for g in data["guard"]:
            lines.append(
                f"| {g['looping']} | {g['guard']} | {g['batch']} | {g['mean_tokens']:.0f} | "
                f"{g['stopped']} | {g['steps']} | {g['seconds']:.2f} | {g['pages_per_s']:.2f} |"
            )
    if data["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e['part']}: `{e['error']}`" for e in data["errors"]]
    return "\n".join(lines) + "\n"


def sync(torch: Any, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure(
    torch: Any, engine: HunyuanEngine, item: PreparedImage, batch: int, new: int, cuda: bool
) -> dict[str, Any]:
    """One batch of `item` at `new` forced tokens through the fast path."""
    row = engine.preprocess(item)
    cost = engine.estimate(item)
    assert cost.patches == row.pixel_values.shape[0], (cost, row.pixel_values.shape)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    started = time.perf_counter()
    out = engine.generate(
        [item] * batch, encoded=[row] * batch, max_new_tokens=new, min_new_tokens=new
    )
    sync(torch, cuda)
    seconds = time.perf_counter() - started
    assert all(len(g.token_ids) == new for g in out.items), "forced length not reached"
    stats = engine.last_decode
    assert stats is not None
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    predicted = engine.cost_model().batch_bytes([cost] * batch)
    return {
        "batch": batch,
        "padded_prompt": out.padded_length,
        "prefill_s": stats.prefill_s,
        "prefill_s_per_page": stats.prefill_s / batch,
        "decode_ms_per_step": stats.decode_s / max(stats.timed_steps, 1) * 1e3,
        "capture_s": stats.capture_s,
        "graph": stats.graph,
        "attention": stats.attention,
        "seconds": seconds,
        "pages_per_s": batch / seconds,
        "increment_gib": (peak - before) / GiB,
        "prefill_increment_gib": (stats.prefill_peak_bytes - before) / GiB if cuda else 0.0,
        "predicted_increment_gib": predicted / GiB,
        "predicted_vs_measured": predicted / (peak - before) if peak > before else None,
    }


def guard_runs(
    torch: Any, engine: HunyuanEngine, image: Any, size: tuple[int, int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The forced-loop batch with and without the guard, all rows looping and half of them."""
    cuda = args.device.startswith("cuda")
    guard = SMOKE_GUARD if args.smoke else engine.version.guard
    item = PreparedImage("loop", image, size, task="parse")
    row = engine.preprocess(item)
    batch = args.guard_batch
    start = 2 if args.smoke else LOOP_START
    new = 40 if args.smoke else args.new_tokens
    loop = [1000 + i for i in range(LOOP)]
    long_cycle = [2000 + i for i in range(guard.max_unit + 40)]  # no loop the guard can see
    results = []
    for looping in ("all", "half"):
        cycles = [loop if looping == "all" or i % 2 == 0 else long_cycle for i in range(batch)]
        if args.smoke:  # the tiny vocabulary: ids that exist
            cycles = [[40 + (t % 200) for t in c] for c in cycles]
        for on in (True, False):
            started = time.perf_counter()
            with ForcedLoop(engine.model, cycles, start=start):
                out = engine.generate(
                    [item] * batch, encoded=[row] * batch, max_new_tokens=new,
                    guard=guard if on else False,
                )  # fmt: skip
            sync(torch, cuda)
            seconds = time.perf_counter() - started
            stats = engine.last_decode
            kept = [len(g.token_ids) for g in out.items]
            results.append(
                {
                    "looping": looping,
                    "guard": "on" if on else "off",
                    "batch": batch,
                    "max_new_tokens": new,
                    "loop_starts_at": start,
                    "mean_tokens": sum(kept) / len(kept),
                    "stopped": sum(g.truncated == "repetition" for g in out.items),
                    "steps": stats.steps if stats else None,
                    "seconds": seconds,
                    "pages_per_s": batch / seconds,
                    "guard_params": vars(guard) if on else None,
                }
            )
            print(f"guard {looping} {results[-1]['guard']}: {results[-1]}", flush=True)
    return results


def main() -> None:
    import torch

    args = parse_args()
    cuda = args.device.startswith("cuda")
    started = time.perf_counter()
    report = Report(args.out, args.stem)
    report.data["meta"] = {
        **run_meta(args, "bench/hunyuan15_presets.py"),
        "shape": "HunyuanOCR-1.0 and 1.5" if args.shape == "full" else "tiny 1.0 and 1.5",
        "new_tokens": args.new_tokens,
    }

    def part(name: str, fn: Any) -> Any:
        return run_part(report, started, name, fn)

    images = {page: page_image(w, h) for page, (w, h) in PAGES.items()}
    with tempfile.TemporaryDirectory() as tmp:
        for version in args.versions.split(","):
            ckpt = random_checkpoint(Path(tmp), args, version)
            settings = Settings(
                model=str(ckpt),
                model_subfolder=None,
                dtype=args.dtype,
                device=args.device,
                max_new_tokens=args.new_tokens,
            )
            engine = HunyuanEngine(settings, decode="fast")
            engine.load()
            assert engine.version.name == version, (engine.version.name, version)
            report.data["meta"][f"load_{version}_done_s"] = round(time.perf_counter() - started)
            warm = PreparedImage("warm", page_image(512, 512), (512, 512))
            part(f"warm_{version}", lambda e=engine, w=warm: e.generate([w, w], max_new_tokens=4))
            done: dict[tuple[Any, ...], str] = {}
            for page, (w, h) in PAGES.items():
                for preset, (task, cap) in PRESETS.items():
                    it = PreparedImage(page, images[page], (w, h), task=task, job_cap=cap)
                    cost = engine.estimate(it)
                    sees = engine.geometry.resized(*engine.geometry.shrink_to(
                        w, h, engine.view_pixels(it)))  # fmt: skip
                    row = {
                        "version": version,
                        "page": page,
                        "preset": preset,
                        "task": task,
                        "cap_pixels": engine.view_pixels(it),
                        "sees": f"{sees[0]}x{sees[1]}",
                        "prompt_tokens": cost.prompt_tokens,
                        "patches": cost.patches,
                    }
                    key = (sees,)  # the same image: the prompt differs by a few dozen tokens
                    if key in done:
                        report.data["runs"].append({**row, "same_as": done[key]})
                        continue
                    if time.perf_counter() - started > args.budget_s:
                        report.data["errors"].append(
                            {"part": f"{version} {page} {preset}", "error": "time budget"}
                        )
                        continue
                    batch = max(1, min(args.batch, args.patch_budget // max(cost.patches, 1)))
                    run = part(
                        f"{version}_{page}_{preset}",
                        lambda e=engine, i=it, b=batch: measure(
                            torch, e, i, b, args.new_tokens, cuda
                        ),
                    )
                    if run:
                        done[key] = preset
                        report.data["runs"].append({**row, **run})
                        print(f"{version} {page} {preset}: {report.data['runs'][-1]}", flush=True)
            if version == args.versions.split(",")[-1]:
                report.data["guard"] = (
                    part(
                        "guard",
                        lambda e=engine: guard_runs(
                            torch, e, images["a4-150dpi"], PAGES["a4-150dpi"], args
                        ),
                    )
                    or []
                )
            engine.close()
            del engine
    report.data["meta"]["total_s"] = round(time.perf_counter() - started, 1)
    report.write()
    print(markdown(report.data), flush=True)


if __name__ == "__main__":
    main()
