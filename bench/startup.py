"""Worker start-up: from `ocrq worker` starting to " ready." and to the first stored result, with
jobs already waiting, and where those seconds go (issue 29).

Why: on the H200 a worker took 21.0 s to " ready." and 32.7 s to its first result with 2,400
jobs waiting (bench/results/service_gpu/service_gpu_h200_run18.md), with no account of either.
The worker now logs its start-up timeline (ocrq/core/startup.py: one `startup:` line per phase,
seconds since its process started, the engine's phases included, then `startup: ready at` and
`startup: first result stored at`); this script starts a real worker against Redis and
PostgreSQL, with the jobs queued before it starts, and reads the timeline and the database:

* `ready_s`: the spawn to " ready." in its log (what bench/service_gpu.py measures);
* `first_result_s`: the spawn to the first row stored `done` (its `finished_at`);
* `all_done_s`: the spawn to the last of the N jobs stored;
* the phases the worker logged, per lane (phases of a lane run one after another; lanes overlap).

    # CPU, tiny random 1.5 weights, the GPU's default path (running loop, engine process):
    python bench/startup.py --out bench/results/startup --stem startup_cpu --runs 3 \\
        --broker-url redis://127.0.0.1:6379/11 \\
        --database-url postgresql://postgres@127.0.0.1:5432/ocrq_startup
    # the GPU machine (Redis and PostgreSQL from the wheels bench/local_services.py starts),
    # a checkpoint already on disk (bench/service_gpu.py's work folder keeps one):
    python bench/startup.py --checkpoint /tmp/w/ckpt-1.5 --device cuda --dtype bfloat16 \\
        --jobs 2400 --max-new-tokens 64 --out OUT --stem startup_h200

Without `--checkpoint` a random-weight 1.5 checkpoint of `--shape` is built under `--work` first
(not timed: the worker is measured with its checkpoint warm on disk, as issue 29 asks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The running loop and an engine process, as a GPU worker runs by default, on the CPU; sized for
# the tiny model (a CPU plans with the GPU's default cost model: ~0.4 GiB above its fixed part).
CPU_ENV = {
    "OCRQ_SCHEDULER": "continuous",
    "OCRQ_ENGINE_PROCESS": "true",
    "OCRQ_MAX_BATCH": "8",
    "OCRQ_MEMORY_BUDGET_GIB": "3.4",
    "OCRQ_PREFILL_TOKENS": "1024",
    "OCRQ_PREFILL_CHUNK_TOKENS": "1024",
}
# Image kinds of the workload: (width, height, lines of text, task).
KINDS = {
    "word": (240, 64, ["STATION"], "text"),
    "receipt": (420, 640, ["RECEIPT 0042", "COFFEE 3.50", "TOTAL 3.50"], "parse"),
    "a4": (1248, 1760, ["INVOICE 2026"] * 40, "parse"),
}

# -- the worker's `startup:` lines (ocrq/core/startup.py writes and parses them) ------------


def parse_timeline(text: str) -> dict[str, Any]:
    """A worker log's start-up timeline (`ocrq.core.startup.parse`); empty for a checkout from
    before the timeline (the bench then measures that one from outside only)."""
    try:
        from ocrq.core.startup import parse
    except ImportError:
        return {"phases": [], "ready_at_s": None, "first_result_at_s": None}
    return parse(text)


def timeline_table(timeline: dict[str, Any]) -> list[str]:
    """Markdown rows: one per phase, by lane, then ready and the first result."""
    rows = ["| lane | phase | s | from s | to s |", "|---|---|---:|---:|---:|"]
    for p in timeline.get("phases") or []:
        rows.append(f"| {p['lane']} | {p['name']} | {p['seconds']:.2f} | {p['start']:.2f} | "
                    f"{p['end']:.2f} |")
    if timeline.get("ready_at_s") is not None:
        rows.append(f"| | **ready** | | | {timeline['ready_at_s']:.2f} |")
    if timeline.get("first_result_at_s") is not None:
        rows.append(f"| | **first result stored** | | | {timeline['first_result_at_s']:.2f} |")
    return rows


# -- the workload -------------------------------------------------------------------------------


def draw(path: Path, kind: str) -> None:
    from PIL import Image, ImageDraw

    width, height, lines, _ = KINDS[kind]
    image = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        pen.text((12, 12 + 36 * i), line, fill="black")
    image.save(path)


def workload(work: Path, jobs: int, mix: dict[str, float]) -> list[tuple[str, str]]:
    """(path, task) per job: the kinds of `mix` in its shares, interleaved (the first jobs are
    a mix too)."""
    images = work / "images"
    images.mkdir(parents=True, exist_ok=True)
    for kind in mix:
        if not (images / f"{kind}.png").exists():
            draw(images / f"{kind}.png", kind)
    total = sum(mix.values())
    out: list[tuple[str, str]] = []
    credit = dict.fromkeys(mix, 0.0)
    for _ in range(jobs):
        for kind, share in mix.items():
            credit[kind] += share / total
        kind = max(credit, key=lambda k: credit[k])
        credit[kind] -= 1.0
        out.append((str(images / f"{kind}.png"), KINDS[kind][3]))
    return out


# -- one run ------------------------------------------------------------------------------------


def worker_env(args: argparse.Namespace, ckpt: Path, work: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "OCRQ_ENGINE": "hunyuan",
        "OCRQ_MODEL": str(ckpt),
        "OCRQ_DEVICE": args.device,
        "OCRQ_DTYPE": args.dtype,
        "OCRQ_MAX_NEW_TOKENS": str(args.max_new_tokens),
        "OCRQ_ALLOWED_ROOTS": str(work.resolve()),
        "OCRQ_PROFILE_DIR": str(work / "profiles"),
        "OCRQ_BROKER_URL": args.broker_url,
        "OCRQ_DATABASE_URL": args.database_url,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(args.code.resolve()), os.environ.get("PYTHONPATH", "")]),
    }
    if args.device == "cpu":
        env.update(CPU_ENV)
    env.update(dict(kv.split("=", 1) for kv in args.env))
    return env


def submit(args: argparse.Namespace, jobs: list[tuple[str, str]]) -> list[str]:
    from ocrq.api.client import Client
    from ocrq.core.contract import JobRequest
    from ocrq.core.settings import Settings

    client = Client(Settings(broker_url=args.broker_url, database_url=args.database_url))
    requests = [
        JobRequest.model_validate({"image": {"path": p}, "task": t, "job_id": str(uuid.uuid4())})
        for p, t in jobs
    ]
    for i in range(0, len(requests), 500):
        client.submit_many(requests[i : i + 500])
    return [r.job_id for r in requests]


def clear(args: argparse.Namespace, db: Any) -> None:
    import redis
    from sqlalchemy import text

    redis.Redis.from_url(args.broker_url).flushdb()
    with db.begin() as conn:
        conn.execute(text("DELETE FROM ocr_jobs"))


def stored(db: Any) -> tuple[int, float | None, float | None]:
    """Rows done, and the first and last `finished_at` among them (epoch seconds)."""
    from sqlalchemy import text

    with db.connect() as conn:
        n, first, last = conn.execute(text(
            "SELECT count(*), extract(epoch from min(finished_at)),"
            " extract(epoch from max(finished_at)) FROM ocr_jobs WHERE status = 'done'"
        )).one()
    return int(n), None if first is None else float(first), None if last is None else float(last)


def one_run(args: argparse.Namespace, env: dict[str, str], jobs: list[tuple[str, str]],
            db: Any, log: Path) -> dict[str, Any]:
    clear(args, db)
    if args.submit == "before":
        submit(args, jobs)
    cmd = [sys.executable, "-m", "ocrq.cli", "worker", "--no-supervise"]
    spawned = time.time()
    with log.open("wb") as fh:
        # cwd: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH;
        # from here, `--code` would be shadowed by this checkout's ocrq.
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=args.code.resolve())
    out: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + args.timeout_s
        while " ready." not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        out["ready_s"] = round(time.time() - spawned, 2)
        if args.submit == "ready":
            submitted = time.time()
            submit(args, jobs)
            out["submit_s"] = round(time.time() - submitted, 2)
        n = 0
        while n < len(jobs) and time.monotonic() < deadline:
            n, first, last = stored(db)
            if n and "first_result_s" not in out and first is not None:
                out["first_result_s"] = round(first - spawned, 2)
            if n < len(jobs):
                time.sleep(0.1)
        if n == len(jobs) and last is not None:
            out["all_done_s"] = round(last - spawned, 2)
        out["done"] = n
        # The `first result stored` line follows the row's commit: give the worker a moment.
        wait_line = time.monotonic() + 10
        while ("startup: first result stored" not in log.read_text(errors="replace")
               and time.monotonic() < wait_line):
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out["timeline"] = parse_timeline(log.read_text(errors="replace"))
    return out


# -- the report ---------------------------------------------------------------------------------


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs; per phase too (by lane and name)."""
    out: dict[str, Any] = {}
    for key in ("ready_s", "first_result_s", "all_done_s"):
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(median(values), 2) if values else None
    phases: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        for p in r["timeline"]["phases"]:
            phases.setdefault((p["lane"], p["name"]), []).append(p)
    out["phases"] = [
        {"lane": lane, "name": name,
         "seconds": round(median(p["seconds"] for p in ps), 2),
         "start": round(median(p["start"] for p in ps), 2),
         "end": round(median(p["end"] for p in ps), 2)}
        for (lane, name), ps in phases.items()
    ]
    for key in ("ready_at_s", "first_result_at_s"):
        values = [r["timeline"][key] for r in runs if r["timeline"].get(key) is not None]
        out[key] = round(median(values), 2) if values else None
    return out


def render(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = [
        "# Worker start-up (bench/startup.py)", "",
        f"`{m['command']}`", "",
        f"Machine: {m['machine']}; {m['cpus']} CPU cores; torch {m.get('torch')}, "
        f"transformers {m.get('transformers')}; checkpoint {m['checkpoint']} "
        f"({m['device']}, {m['dtype']}); {m['jobs']} jobs ({m['mix']}) queued "
        f"{'before the worker starts' if m['submit'] == 'before' else 'once it is ready'}, "
        f"OCRQ_MAX_NEW_TOKENS={m['max_new_tokens']}; worker settings: `{m['worker_env']}`.", "",
        "Seconds from the spawn of `ocrq worker --no-supervise`: to \" ready.\" in its log, to the "
        "first row stored `done`, to the last.", "",
        "| run | ready s | first result s | all done s | ready (its own line) s | first result "
        "(its own line) s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(report["runs"], 1):
        t = r["timeline"]
        lines.append(f"| {i} | {r.get('ready_s')} | {r.get('first_result_s')} | "
                     f"{r.get('all_done_s')} | {t.get('ready_at_s')} | "
                     f"{t.get('first_result_at_s')} |")
    s = report["summary"]
    lines.append(f"| median | {s['ready_s']} | {s['first_result_s']} | {s['all_done_s']} | "
                 f"{s['ready_at_s']} | {s['first_result_at_s']} |")
    if s["phases"]:
        lines += ["", "## The timeline (medians over the runs; seconds since the worker's process "
                  "started)", "", *timeline_table({"phases": s["phases"],
                                                   "ready_at_s": s["ready_at_s"],
                                                   "first_result_at_s": s["first_result_at_s"]})]
    return "\n".join(lines) + "\n"


def main() -> None:
    from bench.common import add_model_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.set_defaults(shape="tiny", device="cpu", dtype="float32")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="a HunyuanOCR checkpoint folder; default: build a random 1.5 of --shape")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="startup")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--mix", default="word=0.7,receipt=0.25,a4=0.05",
                    help="image kinds and their shares (word, receipt, a4)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--submit", choices=("before", "ready"), default="before",
                    help="queue the jobs before the worker starts, or once it is ready")
    ap.add_argument("--env", nargs="*", default=[], help="NAME=VALUE settings for the worker")
    ap.add_argument("--broker-url", default=None, help="use this Redis instead of starting one")
    ap.add_argument("--database-url", default=None, help="use this PostgreSQL instead")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--code", type=Path, default=REPO,
                    help="the checkout whose ocrq the worker runs (another commit's, to compare "
                         "start-ups side by side in one call); default: this one")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = (args.work or args.out / "work").resolve()
    work.mkdir(parents=True, exist_ok=True)
    mix = {k: float(v) for k, v in (kv.split("=", 1) for kv in args.mix.split(","))}
    if unknown := set(mix) - set(KINDS):
        raise SystemExit(f"--mix: unknown kinds {sorted(unknown)}")

    ckpt = args.checkpoint
    if ckpt is None:
        from bench.common import random_checkpoint

        ckpt = work / "ckpt-1.5"
        if not (ckpt / "config.json").exists():
            random_checkpoint(work, args, "1.5")
    services = None
    if not (args.broker_url and args.database_url):
        from bench.local_services import start_services

        services = start_services(work)
        args.broker_url, args.database_url = services.broker_url, services.database_url
    try:
        from sqlalchemy import create_engine

        from ocrq.core.db import sqlalchemy_url

        env = worker_env(args, ckpt, work)
        subprocess.run([sys.executable, "-m", "ocrq.cli", "migrate"], env=env, check=True,
                       timeout=120, capture_output=True)
        db = create_engine(sqlalchemy_url(args.database_url))
        jobs = workload(work, args.jobs, mix)
        runs = []
        for i in range(args.runs):
            log = work / f"{args.stem}-worker-{i + 1}.log"
            runs.append(one_run(args, env, jobs, db, log))
            print(f"run {i + 1}: ready {runs[-1].get('ready_s')} s, first result "
                  f"{runs[-1].get('first_result_s')} s, all done {runs[-1].get('all_done_s')} s",
                  flush=True)
        db.dispose()
    finally:
        if services is not None:
            services.stop()
    versions: dict[str, str] = {}
    try:
        import torch
        import transformers

        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    except ImportError:
        gpu = None
    shown = {k: v for k, v in env.items()
             if k.startswith("OCRQ_") and k not in ("OCRQ_BROKER_URL", "OCRQ_DATABASE_URL",
                                                    "OCRQ_ALLOWED_ROOTS", "OCRQ_PROFILE_DIR",
                                                    "OCRQ_MODEL")}
    report = {
        "meta": {
            "command": " ".join(["python", "bench/startup.py", *sys.argv[1:]]),
            "machine": gpu or platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), **versions,
            "checkpoint": "given" if args.checkpoint else f"random 1.5 ({args.shape})",
            "code": str(args.code),
            "device": args.device, "dtype": args.dtype, "jobs": args.jobs, "mix": args.mix,
            "submit": args.submit, "max_new_tokens": args.max_new_tokens,
            "worker_env": " ".join(f"{k}={v}" for k, v in sorted(shown.items())),
        },
        "runs": runs,
        "summary": summary(runs),
    }
    (args.out / f"{args.stem}.json").write_text(json.dumps(report, indent=2))
    (args.out / f"{args.stem}.md").write_text(render(report))
    print(render(report))


if __name__ == "__main__":
    main()
