"""The lanes on the CPU: the running loop's own scheduler driven through a modelled GPU clock.

Why: issue 49 made the running loop's decisions one pure object (`LoopScheduler`,
ocrq/models/loop/scheduler.py) so that a lane lever could be tried without a GPU. This bench is
that try: it feeds the scheduler the workload of `bench/lanes.py` (the same jobs, the same
seeds: the bulk backlog queued at once, interactive jobs at a fixed rate once it drains) and
carries out each `StepPlan` on a clock instead of a device, with what a prefill pass and a
decode step cost on a measured card. It reports what `bench/lanes.py` reports (interactive p95
with the backlog against alone, bulk images/s with the stream against alone), for any
`LanePolicy` and for `OCRQ_BULK_MAX_WAIT_S`, in seconds of CPU.

What is the scheduler's and what is modelled:

* every decision is `LoopScheduler`'s, through the same `scheduler_config` the worker's loop
  uses, with the loop shape and lanes built from the worker's settings as
  `HunyuanLoopEngine.loop_config` builds them (slots = OCRQ_MAX_BATCH or 256, plus the reserve);
* the runner is modelled: a pass costs `max(pass_floor_ms, pass_ms_per_token * tokens)`; a full
  step `step_fixed_ms + step_ms_per_kv_token * live KV tokens`; an interactive-only step
  `extra_step_ms` (after each full step while a reserved interactive row lives, as
  `LoopRunner._extra_steps` does, `extra_steps` of them at most). A row's first token comes
  from its pass; it ends at its scripted length (the bench's lengths) or its cap. The runner's
  harvest lag (a finished row is seen at the next slot-state copy, up to 8 steps later) is left
  out, as are the side stream and CUDA graphs;
* prompt tokens: the processor's resize rule (`ImageGeometry`) under the task's pixel preset
  (ocrq/models/hunyuan/resolution.py: 1536² for documents, 2048² for scene text) over each
  image's size, plus the prompt template's rough count.

Calibration (defaults, `--card h200`): the H200 runs of bench/results/scheduler_guard/
(`lanes_h200_stage3_before.json`: full step 1.34 ms at 1.9k KV tokens, 5.88 ms at 159k; an
interactive-only step 1.39 ms; a pass 94.6 ms at 1,019 tokens and at 2,851, 463 ms at
14,578). The pool is not in those files: 1M tokens (bf16 KV of the 1B model is ~100 KB a token;
an H200 holds ~100 GB of it), so rows are held by slots and prefill, not KV. A model, not a
measurement: it ranks lane rules and levers and shows their mechanism; the GPU run
(`bench/lanes.py`) is what a goal is judged by (bench/results/lanes_sim/README.md compares).

    python bench/lanes_sim.py --out bench/results/lanes_sim --stem lanes_sim_h200_600 \\
        --bulk-max-wait-s 2.5 10 --extra-steps 0 2 8 --extra-step-ms 0.9 0.58
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.lanes import interactive_jobs, q, ratio_interval  # noqa: E402
from bench.service_gpu import A4, TASK_OF_KIND, Job, build_workload  # noqa: E402
from ocrq.models.loop.lane_pass import LanePolicy  # noqa: E402
from ocrq.models.loop.plan import Request, StepOutput  # noqa: E402
from ocrq.models.loop.scheduler import LoopScheduler, SchedulerConfig  # noqa: E402


@dataclass(frozen=True)
class Card:
    """What a prefill pass and a decode step cost on one card (module docstring)."""

    step_fixed_ms: float
    step_ms_per_kv_token: float
    extra_step_ms: float
    pass_floor_ms: float
    pass_ms_per_token: float
    pool_tokens: int

    def step_ms(self, kv_tokens: int) -> float:
        return self.step_fixed_ms + self.step_ms_per_kv_token * kv_tokens

    def pass_ms(self, tokens: int) -> float:
        return max(self.pass_floor_ms, self.pass_ms_per_token * tokens)


# From lanes_h200_stage3_before.json (module docstring): steps through their two points; a
# pass at the larger of the small passes' 94.6 ms (1,019 and 2,851 tokens both took it) and
# the bulk passes' 0.0318 ms a token.
CARDS = {
    "h200": Card(step_fixed_ms=1.29, step_ms_per_kv_token=2.89e-5, extra_step_ms=1.39,
                 pass_floor_ms=94.6, pass_ms_per_token=0.03176, pool_tokens=1_000_000),
    # From bench/results/lanes/lanes_h100_defaults_256.json (stop 50's code, 4,000 bulk jobs):
    # steps 1.414 ms at 1.9k KV tokens and 12.09 at 312k; an interactive-only step 1.41 ms;
    # passes 34.1 ms at 1,004 tokens, 71.7 at 3,338, 122 at 5,861 (0.0208 ms a token). Pool:
    # 600k tokens (the bulk run held 312k a step; 80 GB less weights and workspace).
    "h100": Card(step_fixed_ms=1.35, step_ms_per_kv_token=3.44e-5, extra_step_ms=1.41,
                 pass_floor_ms=34.1, pass_ms_per_token=0.0208, pool_tokens=600_000),
}


@dataclass
class Row:
    job: Job
    interactive: bool
    arrives: float
    prompt_tokens: int
    made: int = 0
    slot: int = -1
    finished: float | None = None


def prompt_tokens(path: str, task: str, version: str) -> int:
    """The row's prompt: its image span after the processor's resize, and the template."""
    from PIL import Image

    from ocrq.core.pixel_budget import Stage
    from ocrq.models.hunyuan.geometry import ImageGeometry
    from ocrq.models.hunyuan.prompts import rough_prompt_tokens
    from ocrq.models.hunyuan.resolution import pixel_budget
    from ocrq.models.hunyuan.versions import VERSIONS

    v = VERSIONS[version]
    if Path(path).name.startswith("a4-"):
        size = A4
    else:
        with Image.open(path) as im:
            size = im.size
    model = ImageGeometry(max_pixels=v.max_pixels)
    view = pixel_budget(task, None, {}, model.min_pixels, model.max_pixels).at(Stage.MODEL)
    geometry = ImageGeometry(max_pixels=view or model.max_pixels)
    return geometry.image_tokens(*size) + rough_prompt_tokens(v.prompts.get(task, ""))


def scheduler_config(card: Card, max_new: int, policy: LanePolicy) -> SchedulerConfig:
    """The loop's shape and rule as a worker with default settings on `card` builds them
    (`HunyuanLoopEngine.loop_config`, `running.scheduler_config`)."""
    from ocrq.core.settings import Settings

    s = Settings(_env_file=None)
    slots = (s.max_batch or 256) + s.interactive_slots
    pass_tokens = s.prefill_tokens if s.prefill_schedule == "alternate" \
        else s.prefill_chunk_tokens
    return SchedulerConfig(
        slots=slots, pool_tokens=card.pool_tokens, max_new_tokens=max_new,
        schedule=s.prefill_schedule, pass_tokens=pass_tokens, prefill_gap=s.prefill_gap_steps,
        packed=s.prefill_packed,
        lanes=replace(policy, reserved_slots=policy.reserved_slots or s.interactive_slots),
    )


def default_policy() -> LanePolicy:
    """The lane policy of a worker with default settings (`LanePolicy.of`, as the loop's)."""
    from ocrq.core.settings import Settings

    return LanePolicy.of(Settings(_env_file=None))


def simulate(rows: list[Row], config: SchedulerConfig, card: Card, held: int,
             limit_s: float = 3600.0) -> tuple[float, dict[str, float]]:
    """Run every row through the scheduler on the modelled clock; the clock at the end and
    the loop's counts (passes, steps and their seconds: `loop_figures`). Each
    row's `finished` is set (None: not done within `limit_s`). The worker holds at most `held`
    rows (its task threads: the rest wait in Redis); an interactive job is fetched first
    (ocrq/worker/lane_fetch.py), a bulk one as a held row ends, and a row is queued in the loop
    when the worker has it, so its wait in the loop (the promotion's clock) starts there."""
    sched = LoopScheduler(config)
    stats = {"passes": 0, "pass_tokens": 0, "pass_s": 0.0, "steps": 0, "extra_steps": 0,
             "row_steps": 0, "step_s": 0.0}
    stream = sorted((r for r in rows if r.interactive), key=lambda r: r.arrives)
    backlog = [r for r in rows if not r.interactive]
    by_key = {r.job.job_id: r for r in rows}
    live: dict[str, Row] = {}
    now, nxt, fed, inside = 0.0, 0, 0, 0
    extra = config.lanes.extra_steps
    reserve = config.lanes.reserved_slots

    def request(r: Row) -> Request:
        return Request(r.job.job_id, r.prompt_tokens, r.job.new_tokens, r.interactive)

    while now < limit_s:
        arrived = []
        while nxt < len(stream) and stream[nxt].arrives <= now:
            arrived.append(request(stream[nxt]))
            nxt += 1
        while fed < len(backlog) and inside + len(arrived) < held:
            arrived.append(request(backlog[fed]))
            fed += 1
        inside += len(arrived)
        if arrived:
            sched.add(arrived, now)
        if sched.idle():
            if nxt == len(stream) and fed == len(backlog):
                return now, stats
            now = max(now, stream[nxt].arrives) if nxt < len(stream) else now
            continue
        plan = sched.schedule(now)
        finished: list[str] = []
        if plan.admit:
            tokens = sum(a.prompt_tokens for a in plan.admit)
            now += card.pass_ms(tokens) / 1000
            stats["passes"] += 1
            stats["pass_tokens"] += tokens
            stats["pass_s"] += card.pass_ms(tokens) / 1000
            for a in plan.admit:
                r = by_key[a.key]
                r.slot, r.made = a.slot, 1  # the pass makes the first token
                live[a.key] = r
        steps = 0
        for _ in range(plan.decode_steps):
            for key in [k for k, r in live.items() if r.made >= r.job.new_tokens]:
                live.pop(key).finished = now
                finished.append(key)
            if not live:
                break
            kv = sum(r.prompt_tokens + r.made for r in live.values())
            now += card.step_ms(kv) / 1000
            steps += 1
            stats["steps"] += 1
            stats["row_steps"] += len(live)
            stats["step_s"] += card.step_ms(kv) / 1000
            for r in live.values():
                r.made += 1
            lane = [r for r in live.values() if r.interactive and r.slot < reserve]
            for _ in range(extra if lane else 0):
                if all(r.made >= r.job.new_tokens for r in lane):
                    break
                now += card.extra_step_ms / 1000
                stats["extra_steps"] += 1
                for r in lane:
                    r.made += r.made < r.job.new_tokens
        for key in [k for k, r in live.items() if r.made >= r.job.new_tokens]:
            live.pop(key).finished = now
            finished.append(key)
        sched.update(StepOutput(steps, tuple(finished)))
        inside -= len(finished)
    return now, stats


def sustained_rate(rows: list[Row]) -> float | None:
    """Bulk completions a second over the 10th-90th percentile of their finishes (the loop is
    saturated there: the backlog still waits)."""
    times = sorted(r.finished for r in rows if not r.interactive and r.finished is not None)
    if len(times) < 10:
        return None
    lo, hi = times[len(times) // 10], times[9 * len(times) // 10]
    return (9 * len(times) // 10 - len(times) // 10) / (hi - lo) if hi > lo else None


def run(label: str, bulk: list[Job], stream: list[Job], tokens: dict[str, int],
        config: SchedulerConfig, card: Card, rate: float, start_after: float,
        held: int) -> dict[str, Any]:
    """One of bench/lanes.py's three runs on the modelled clock."""
    rows = [Row(j, False, 0.0, tokens[j.job_id]) for j in bulk]
    rows += [Row(j, True, (start_after if bulk else 0.0) + i / rate, tokens[j.job_id])
             for i, j in enumerate(stream)]
    end, stats = simulate(rows, config, card, held)
    lat = [r.finished - r.arrives for r in rows if r.interactive and r.finished is not None]
    return {
        "run": label,
        "modelled_s": round(end, 2),
        "done": sum(r.finished is not None for r in rows),
        "interactive_latency_s": lat,
        "interactive_p50_s": q(lat, 0.5),
        "interactive_p95_s": q(lat, 0.95),
        "bulk_images_per_s": sustained_rate(rows),
        "loop": loop_figures(stats),
    }


def loop_figures(stats: dict[str, float]) -> dict[str, float | None]:
    """The run's loop in `bench/lanes.py`'s words, to set beside a GPU run's."""
    steps = stats["steps"] + stats["extra_steps"]
    return {
        "steps": steps,
        "extra_steps": stats["extra_steps"],
        "full_step_ms": round(1000 * stats["step_s"] / stats["steps"], 3)
        if stats["steps"] else None,
        "rows_per_full_step": round(stats["row_steps"] / stats["steps"], 2)
        if stats["steps"] else None,
        "prefills": stats["passes"],
        "pass_ms": round(1000 * stats["pass_s"] / stats["passes"], 1)
        if stats["passes"] else None,
        "pass_tokens": round(stats["pass_tokens"] / stats["passes"], 1)
        if stats["passes"] else None,
        "prefill_ms_per_step": round(1000 * stats["pass_s"] / steps, 3) if steps else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "ocr-eval")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="lanes_sim_h200")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ocrq-lanes-sim"))
    ap.add_argument("--card", choices=sorted(CARDS), default="h200")
    ap.add_argument("--version", choices=("1.0", "1.5"), default="1.5")
    ap.add_argument("--bulk-jobs", type=int, default=600)
    ap.add_argument("--a4-share", type=float, default=0.15)
    ap.add_argument("--interactive-jobs", type=int, default=64)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--start-after", type=float, default=5.0,
                    help="seconds of the backlog draining before the stream starts")
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--held", type=int, default=520,
                    help="rows the worker holds at once (its task threads: a GPU's 512 "
                         "prefetched images and 8 more)")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--bulk-max-wait-s", type=float, nargs="+", default=None,
                    help="one variant per value (default: the setting's)")
    ap.add_argument("--extra-steps", type=int, nargs="+", default=None,
                    help="one variant per value of OCRQ_INTERACTIVE_EXTRA_STEPS")
    ap.add_argument("--policy", nargs="+", default=None,
                    help="one variant per comma-separated set of LanePolicy fields, e.g. "
                         "bulk_prefill_tokens=2048,bulk_gap=8")
    ap.add_argument("--pass-floor-ms", type=float, nargs="+", default=None,
                    help="one variant per floor of a prefill pass's cost (the H200's: 94.6)")
    ap.add_argument("--extra-step-ms", type=float, nargs="+", default=None,
                    help="one variant per cost of an interactive-only step (and one per "
                         "--extra-steps value with it)")
    args = ap.parse_args()
    card = CARDS[args.card]
    bulk = build_workload(args.data, args.work, args.bulk_jobs, args.a4_share,
                          args.max_new_tokens, args.seed)
    stream = interactive_jobs(args.data, args.interactive_jobs, args.max_new_tokens, args.seed)
    cache: dict[str, int] = {}
    tokens = {}
    for j in [*bulk, *stream]:
        key = f"{j.path}|{j.task}"
        if key not in cache:
            cache[key] = prompt_tokens(j.path, j.task, args.version)
        tokens[j.job_id] = cache[key]
    base = default_policy()
    variants: list[tuple[str, LanePolicy, Card]] = [("defaults", base, card)]
    for w in args.bulk_max_wait_s or []:
        variants.append((f"OCRQ_BULK_MAX_WAIT_S={w:g}", replace(base, bulk_max_wait_s=w), card))
    for e in args.extra_steps or []:
        variants.append((f"OCRQ_INTERACTIVE_EXTRA_STEPS={e}", replace(base, extra_steps=e), card))
    for spec in args.policy or []:  # e.g. bulk_prefill_tokens=2048,bulk_gap=8
        fields = {k: type(getattr(base, k))(v) for k, v in
                  (part.split("=", 1) for part in spec.split(","))}
        variants.append((spec, replace(base, **fields), card))
    for ms in args.pass_floor_ms or []:  # a cheaper small prefill pass
        variants.append((f"small pass {ms:g} ms", base, replace(card, pass_floor_ms=ms)))
    for ms in args.extra_step_ms or []:  # a faster small step (issue 50's fused step)
        variants.append((f"interactive-only step {ms:g} ms", base,
                         replace(card, extra_step_ms=ms)))
        for e in args.extra_steps or []:
            variants.append((f"interactive-only step {ms:g} ms, {e} of them",
                             replace(base, extra_steps=e), replace(card, extra_step_ms=ms)))
    report: dict[str, Any] = {"meta": {
        "command": " ".join(["python", "bench/lanes_sim.py", *sys.argv[1:]]),
        "card_model": card.__dict__, "bulk_jobs": len(bulk), "interactive_jobs": len(stream),
        "rate": args.rate, "prompt_tokens_mean": round(statistics.mean(tokens.values()), 1),
        "kinds": sorted({j.kind for j in bulk}), "tasks": sorted(set(TASK_OF_KIND.values())),
    }, "variants": []}
    for label, policy, model in variants:
        config = scheduler_config(model, args.max_new_tokens, policy)
        runs = {name: run(name, b, s, tokens, config, model, args.rate, args.start_after,
                          args.held)
                for name, b, s in (("alone", [], stream), ("bulk", bulk, []),
                                   ("mixed", bulk, stream))}
        alone, mixed = runs["alone"]["interactive_latency_s"], runs["mixed"][
            "interactive_latency_s"]
        b_alone, b_mixed = runs["bulk"]["bulk_images_per_s"], runs["mixed"]["bulk_images_per_s"]
        report["variants"].append({
            "variant": label,
            "policy": policy.__dict__,
            "extra_step_ms": model.extra_step_ms,
            "pass_floor_ms": model.pass_floor_ms,
            "slots": config.slots,
            "p95_mixed_over_alone": round(q(mixed, 0.95) / q(alone, 0.95), 2)
            if mixed and alone else None,
            "p95_ratio_90pct_interval": ratio_interval(mixed, alone, 0.95),
            "bulk_mixed_over_alone": round(b_mixed / b_alone, 3) if b_alone and b_mixed
            else None,
            "runs": {k: {kk: vv for kk, vv in v.items() if kk != "interactive_latency_s"}
                     for k, v in runs.items()},
        })
        v = report["variants"][-1]
        print(f"{label}: p95 x{v['p95_mixed_over_alone']} {v['p95_ratio_90pct_interval']}, "
              f"bulk x{v['bulk_mixed_over_alone']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(report, indent=2))
    (args.out / f"{args.stem}.md").write_text(render(report))


def render(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = [
        "# The lanes on a modelled clock (bench/lanes_sim.py)", "",
        f"`{m['command']}`", "",
        f"{m['bulk_jobs']} bulk jobs queued at once, {m['interactive_jobs']} interactive at "
        f"{m['rate']}/s; the running loop's own `LoopScheduler`, the card modelled as "
        f"{m['card_model']}; mean prompt {m['prompt_tokens_mean']} tokens. A model: it ranks "
        "rules, the GPU run judges goals.", "",
        "| variant | alone p95 s | mixed p95 s | p95 mixed / alone | bulk alone img/s | "
        "bulk mixed img/s | bulk mixed / alone |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in report["variants"]:
        r = v["runs"]
        rate = [r[k]["bulk_images_per_s"] for k in ("bulk", "mixed")]
        lines.append(
            f"| {v['variant']} | {r['alone']['interactive_p95_s']} | "
            f"{r['mixed']['interactive_p95_s']} | {v['p95_mixed_over_alone']} "
            f"{v['p95_ratio_90pct_interval']} | "
            + " | ".join("" if x is None else f"{x:.2f}" for x in rate)
            + f" | {v['bulk_mixed_over_alone']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
