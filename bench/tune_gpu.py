"""`ocrq tune --images` on a GPU, then the service at its recommendation against the defaults.

Issue 32's measurement. For each workload (`eval`: the evaluation images, receipts, street
scenes, word crops and scanned pages; `a4`: drawn A4 pages of ~1,100 tokens):

1. `ocrq tune --engine hunyuan --images DIR` runs as a user runs it, in its own process, with
   its own profile folder, on random HunyuanOCR weights (lengths drawn as tune draws them for a
   random checkpoint: ocrq/tuning/lengths.py). Its output is kept whole.
2. The service (producer -> Redis -> `ocrq worker` -> PostgreSQL) runs the same job list twice,
   each on a fresh worker with the queues and rows emptied: `default` (an empty profile folder,
   no OCRQ_* set) and `tuned` (the profile tune wrote, plus the `OCRQ_*` lines it printed to
   paste). Every job's length is scripted from its ground truth (bench/service_gpu.py), the
   same in both runs.
3. Throughput is bench/sustained.py's (completions while the running loop holds its slots and
   rows still wait); the tuned/default ratio is the figure (goal: >= 1, within run-to-run noise,
   and tune says when the default is already at the knee).

    # on the H200, one workload a call (each ~5 min of device time):
    PYTHONUNBUFFERED=1 python bench/tune_gpu.py --workload eval --jobs 1200 --out $OUT
    PYTHONUNBUFFERED=1 python bench/tune_gpu.py --workload a4 --jobs 400 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import add_model_args, random_checkpoint  # noqa: E402
from bench.lanes import Phase  # noqa: E402
from bench.service_gpu import build_workload, workload_summary  # noqa: E402

WORKLOADS = {  # name: (share of drawn A4 pages, the task tune runs the sample with)
    "eval": (0.0, "text"),
    "a4": (1.0, "parse"),
}


def paste_lines(stdout: str) -> dict[str, str]:
    """The `OCRQ_NAME=value` lines tune printed for the user to paste."""
    found: dict[str, str] = {}
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("OCRQ_") and "=" in line and " " not in line:
            name, value = line.split("=", 1)
            found[name] = value
    return found


def run_tune(env: dict[str, str], images: Path, task: str, profiles: Path,
             max_seconds: float, sample: int) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [sys.executable, "-m", "ocrq.cli", "tune", "--engine", "hunyuan", "--images",
           str(images), "--task", task, "--max-seconds", str(max_seconds),
           "--sample-size", str(sample), "--profile-dir", str(profiles)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env={**env, "COLUMNS": "160"}, capture_output=True, text=True,
                          timeout=max_seconds * 2 + 300)
    return proc, time.monotonic() - t0


def render(d: dict[str, Any]) -> str:
    m = d["meta"]
    lines: list[str] = [
        f"# `ocrq tune --images` and the service at its recommendation ({m['workload']})",
        "",
        f"`{m['command']}`",
        "",
        f"{m['hardware']}, {m['cpus']} CPUs; random HunyuanOCR-{m['version']} weights "
        f"({m['dtype']}); {m['jobs']} jobs ({m['workload_summary']}); tune ran "
        f"{m['tune_seconds']} s (`--max-seconds {m['max_seconds']}`), exit {m['tune_exit']}.",
        "",
        "Recommended (pasted into the tuned run): "
        f"`{' '.join(f'{k}={v}' for k, v in m['paste'].items()) or 'none'}`",
        "",
        "| run | sustained images/s | window s | wall s | done | failed | missing |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name in ("default", "tuned"):
        r = d.get(name)
        if not isinstance(r, dict):
            continue
        lines.append(
            f"| {name} | {r.get('bulk_images_per_s', '')} | {r.get('window_s', '')} | "
            f"{r.get('bulk_wall_s', '')} | {r['done']} | {r['failed']} | {r['missing']} |"
        )
    if "ratio" in d:
        lines += ["", f"Tuned over default, sustained: **{d['ratio']}x**."]
    lines += ["", "## What tune printed", "", "```", m["tune_stdout"].rstrip(), "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    ap.add_argument("--jobs", type=int, default=1200)
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "ocr-eval")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default=None)
    ap.add_argument("--work", type=Path, default=Path("/tmp/tune_gpu"))
    ap.add_argument("--version", choices=("1.0", "1.5"), default="1.5")
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--max-seconds", type=float, default=120)
    ap.add_argument("--sample-size", type=int, default=16, help="tune's --sample-size")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--runs", nargs="*", default=["default", "tuned"])
    ap.add_argument("--broker-url", default=None, help="use this Redis instead of starting one")
    ap.add_argument("--database-url", default=None, help="use this PostgreSQL instead")
    args = ap.parse_args()
    args.rate = 1.0  # Phase's interactive stream rate: no stream here
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    stem = args.stem or f"tune_{args.workload}"
    share, task = WORKLOADS[args.workload]

    import torch

    from ocrq.testing.scripted import worker_env as scripted_env
    from ocrq.testing.scripted import write_table

    jobs = build_workload(args.data, work, args.jobs, share, args.max_new_tokens, args.seed)
    images = args.data.resolve() if args.workload == "eval" else work / "a4"
    ckpt = random_checkpoint(work, args, args.version)
    write_table(ckpt, {j.job_id: j.new_tokens for j in jobs})
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    base = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")},
        "OCRQ_ENGINE": "hunyuan",
        "OCRQ_MODEL": str(ckpt),
        "OCRQ_MAX_NEW_TOKENS": str(args.max_new_tokens),
        "OCRQ_DTYPE": args.dtype,
        "OCRQ_DEVICE": "cuda" if args.device == "cuda:0" else args.device,
        "OCRQ_ALLOWED_ROOTS": os.pathsep.join([str(args.data.resolve()), str(work)]),
        "OCRQ_MAX_IMAGES": str(10 * len(jobs) + 100),  # no recycle mid-run
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
    }
    profiles = work / f"profiles-{args.workload}"
    empty = work / "profiles-none"
    empty.mkdir(exist_ok=True)
    print(f"tune on {images} ...", flush=True)
    proc, tune_s = run_tune(base, images, task, profiles, args.max_seconds,
                             args.sample_size)
    (args.out / f"{stem}_tune.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    paste = paste_lines(proc.stdout)
    for png in sorted(profiles.glob("*.png")) if profiles.exists() else []:
        (args.out / f"{stem}_sweep.png").write_bytes(png.read_bytes())  # tune's own plot
    print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
    report: dict[str, Any] = {
        "meta": {
            "command": " ".join(["python", "bench/tune_gpu.py", *sys.argv[1:]]),
            "workload": args.workload,
            "hardware": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "cpus": os.cpu_count(),
            "version": args.version,
            "dtype": args.dtype,
            "torch": torch.__version__,
            "jobs": len(jobs),
            "workload_summary": workload_summary(jobs),
            "max_seconds": args.max_seconds,
            "tune_seconds": round(tune_s, 1),
            "tune_exit": proc.returncode,
            "tune_stdout": proc.stdout,
            "paste": paste,
            "profiles": [p.name for p in profiles.glob("*.json")] if profiles.exists() else [],
        }
    }

    def write() -> None:
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
        (args.out / f"{stem}.md").write_text(render(report))

    write()
    services = None
    if args.broker_url and args.database_url:
        base.update(OCRQ_BROKER_URL=args.broker_url, OCRQ_DATABASE_URL=args.database_url)
    else:
        from bench.local_services import start_services

        services = start_services(work)
        base.update(OCRQ_BROKER_URL=services.broker_url, OCRQ_DATABASE_URL=services.database_url)
    try:
        subprocess.run([sys.executable, "-m", "ocrq.cli", "migrate"], env=base, check=True,
                       timeout=120)
        served = scripted_env(ckpt, work / "scripted", base)  # the jobs' scripted lengths
        variants = {
            "default": {**served, "OCRQ_PROFILE_DIR": str(empty)},
            "tuned": {**served, "OCRQ_PROFILE_DIR": str(profiles), **paste},
        }
        for name in args.runs:
            print(f"service, {name} ...", flush=True)
            report[name] = Phase(args, variants[name], work).run(name, jobs, [])
            write()
        a, b = report.get("default"), report.get("tuned")
        if a and b and a.get("bulk_images_per_s"):
            report["ratio"] = round(b["bulk_images_per_s"] / a["bulk_images_per_s"], 3)
        write()
    finally:
        if services is not None:
            services.stop()
    print((args.out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
