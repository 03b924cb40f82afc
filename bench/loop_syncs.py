"""Where the running loop still makes the host wait for the GPU, with rows arriving as a
service hands them over (a few at a time, between steps).

Why: every host sync empties the queue of decode steps the loop thread has launched ahead, and
in a worker that thread then competes for the GIL before it can launch the next one; the
service kept an H200 57% busy where the loop fed all at once kept it 92%
(bench/results/service_gpu/service_gpu_reading.md). torch's sync debug mode warns at each
synchronising call; this script counts them by the innermost ocrq/transformers frame, after a
warm-up that captures the CUDA graphs, and reports the loop's GPU time (CUDA events) against the
wall time.

    python bench/loop_syncs.py --out bench/results/loop_syncs  # on a GPU
    python bench/loop_syncs.py --smoke --out /tmp/ls  # tiny model on the CPU: no syncs
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_model_args, page_image, random_checkpoint  # noqa: E402
from ocrq.core.settings import Settings  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.hunyuan import HunyuanLoopEngine  # noqa: E402
from ocrq.models.hunyuan.loop_types import LoopRow  # noqa: E402
from ocrq.models.hunyuan.running import RunningLoop  # noqa: E402
from ocrq.models.slots import RunningBudget  # noqa: E402

GiB = 1024**3
SIZES = {"crop": ((240, 64), 12), "receipt": ((886, 1699), 300), "a4": ((1248, 1760), 1000)}


def site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of ocrq or transformers (else the innermost) of a warning."""
    for frame in reversed(stack):
        if "/ocrq/" in frame.filename or "/transformers/" in frame.filename:
            path = frame.filename.split("/ocrq/")[-1].split("/transformers/")[-1]
            return f"{path}:{frame.lineno} {frame.name}"
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} {frame.name}"


def host_layout_check(torch: Any, engine: HunyuanLoopEngine, rows: list[LoopRow]) -> dict:
    """The running loop's sync-free prefill (image features placed by host indices, the grid
    on the CPU) against the same fused prefill asking the device, and against the library's
    own forward: first-token logits of a padded batch."""
    from ocrq.models.hunyuan.inputs import collate, host_layout
    from ocrq.models.hunyuan.prefill import prompt_pass

    decoder = engine._decoder
    text = decoder.text
    encoded = [r.encoded for r in rows]
    with torch.inference_mode():
        inputs = collate(encoded, engine.tokens.pad, device=decoder.device, dtype=text.dtype)
        positions = inputs.pop("position_ids")
        host = host_layout(encoded, text.model.model.config.image_token_id, decoder.device)
        out = {}
        for name, fused, layout in (("host", decoder.fused, host), ("device", decoder.fused, None),
                                    ("library", False, None)):
            _, logits = prompt_pass(text, dict(inputs), positions, fused, layout)
            out[name] = logits.float()
    return {
        "fused": decoder.fused,
        "host_vs_device": float((out["host"] - out["device"]).abs().max()),
        "host_vs_library": float((out["host"] - out["library"]).abs().max()),
        "logit_scale": float(out["library"].abs().max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="loop_syncs_h200")
    ap.add_argument("--version", choices=("1.0", "1.5"), default="1.5")
    ap.add_argument("--budget-gib", type=float, default=60.0)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--arrive", type=int, default=3, help="rows added every 2 steps")
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--probe-steps", type=int, default=300)
    ap.add_argument("--work", type=Path, default=Path("/tmp/loop_syncs_work"))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.device, args.dtype = "tiny", "cpu", "float32"
        args.budget_gib, args.slots, args.rows = 8.0, 8, 24  # a 16,384-token pass fits
        args.warmup_steps, args.probe_steps = 10, 20
        for name, (size, _) in list(SIZES.items()):
            SIZES[name] = ((max(32, size[0] // 8), max(32, size[1] // 8)), 6)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    cuda = args.device.startswith("cuda")
    ckpt = random_checkpoint(args.work, args, args.version)
    new_tokens = max(n for _, n in SIZES.values()) + 24
    settings = Settings(model=str(ckpt), device=args.device, dtype=args.dtype,
                        max_new_tokens=new_tokens)
    engine = HunyuanLoopEngine(settings, decode="fast")
    engine.load()
    model = engine.cost_model()
    running = RunningBudget.plan(model, int(args.budget_gib * GiB) - model.fixed_bytes,
                                 slots=args.slots, prefill_tokens=settings.prefill_chunk_tokens,
                                 state_bytes_per_slot=engine.state_bytes_per_slot())
    loop = RunningLoop(engine._decoder, engine.tokens, engine.loop_config(running))
    rng = random.Random(5)
    kinds = rng.choices(list(SIZES), weights=[5, 3, 2], k=args.rows)
    rows = []
    for i, kind in enumerate(kinds):
        (w, h), n = SIZES[kind]
        item = PreparedImage(key=str(i), image=page_image(w, h), original_size=(w, h),
                             task="parse" if kind == "a4" else "spotting")
        engine.prepare(item)
        assert item.encoded is not None
        rows.append(LoopRow(str(i), item.encoded, n, min_new_tokens=n))

    same = host_layout_check(torch, engine, rows[:6])
    fed = 0
    seen: Counter[str] = Counter()

    def feed() -> None:
        nonlocal fed
        if fed < len(rows):
            loop.add(rows[fed : fed + args.arrive])
            fed += args.arrive

    def steps(n: int) -> int:
        done = 0
        for _ in range(n):
            if loop.stats.steps % 2 == 0:
                feed()
            if loop.idle():
                break
            done += len(loop.run(0.0))
        return done

    steps(args.warmup_steps)  # graphs captured for the buckets seen, queue filled
    before = loop.collect_stats(wait=True)
    base = {"prefill": before.prefill_s, "decode": before.decode_s, "steps": before.steps,
            "prefills": before.prefills}

    def record(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        seen[site(traceback.extract_stack()[:-1])] += 1

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        finished = steps(args.probe_steps)
        wall = time.perf_counter() - t0
    if cuda:
        torch.cuda.set_sync_debug_mode("default")
    after = loop.collect_stats(wait=True)
    total = time.perf_counter() - t0
    gpu = (after.prefill_s - base["prefill"]) + (after.decode_s - base["decode"])
    result = {
        "command": " ".join(["python", "bench/loop_syncs.py", *sys.argv[1:]]),
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "slots": running.slots, "pool_tokens": running.pool_tokens,
        "probe_steps": after.steps - base["steps"], "prefills": after.prefills - base["prefills"],
        "rows_finished": finished, "rows_fed": fed,
        "host_s": round(wall, 3), "wall_s_incl_drain": round(total, 3),
        "gpu_s": round(gpu, 3), "gpu_busy_pct": round(100 * gpu / max(total, 1e-9), 1),
        "syncs": sum(seen.values()), "sync_sites": dict(seen.most_common(30)),
        "host_layout_check": same,
    }
    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Host syncs in the running loop, rows arriving between steps (bench/loop_syncs.py)",
        "", f"`{result['command']}`", "",
        f"{result['gpu']}, torch {result['torch']}; {result['slots']} slots, "
        f"{result['pool_tokens']} pool tokens; {result['probe_steps']} steps probed with "
        f"{result['prefills']} prefill passes, {args.arrive} rows added every 2 steps.", "",
        f"GPU time (CUDA events) {result['gpu_s']} s of {result['wall_s_incl_drain']} s wall: "
        f"{result['gpu_busy_pct']}% busy. Synchronising calls: {result['syncs']}.", "",
        f"Prefill with the host layout against without it and against the library's forward "
        f"(first-token logits, max abs difference): `{json.dumps(same)}`", "",
        "| calls | site |", "|---:|---|",
    ] + [f"| {n} | `{s}` |" for s, n in seen.most_common(30)]
    (args.out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
