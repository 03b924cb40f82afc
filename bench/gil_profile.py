"""Who holds a worker's GIL while the service runs, by thread and by the code it runs.

Why: on the H200 the service reached 0.85-0.89 of the engine alone's images/s with the same
running loop (bench/results/service_gpu/service_gpu_reading.md, runs 5-7). The loop's thread
launches the prefill from Python, and every other thread of the worker process shares one GIL with
it. This names those threads and what they do per job: Celery's consumer, the task threads storing
rows, decoding images and preprocessing, the finisher.

It runs `bench/service_gpu.py` (the service part only, Redis and PostgreSQL as given), finds
the worker once it is ready, and samples it with py-spy's `--gil` mode, which records only the
thread holding the GIL. Needs `pip install py-spy` and permission to attach (root, or ptrace
allowed).

    python bench/gil_profile.py --out bench/results/gil_profile \\
        --broker-url redis://127.0.0.1:6379/9 --database-url postgresql://postgres@127.0.0.1/ocrq_bench
    (defaults: the tiny model on this machine's CPU, OCRQ_SCHEDULER=continuous; on a GPU pass
    --device cuda --shape full and no OCRQ_SCHEDULER is needed)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker_pid(timeout: float) -> int:
    """The `ocrq worker --no-supervise` process the service bench started, once ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["pgrep", "-f", "ocrq worker --no-supervise"],
                             capture_output=True, text=True).stdout.split()
        if out:
            return int(out[0])
        time.sleep(0.5)
    raise TimeoutError("no worker started")


def summarise(raw: Path, seconds: float, rate: int, jobs_per_s: float) -> dict:
    """GIL samples by thread, and by (thread, innermost ocrq module, library running)."""
    threads: collections.Counter[str] = collections.Counter()
    places: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        n = int(count)
        total += n
        frames = stack.split(";")
        thread = re.sub(r"_\d+$", "", re.sub(r"thread \(\d+\): ", "", frames[0]))
        threads[thread] += n
        paths = [m.group(1) for f in frames[1:] if (m := re.search(r"\(([^)]*)\)", f))]
        module = next((p.split("ocrq/")[-1].split(":")[0] for p in reversed(paths)
                       if "ocrq/" in p), "-")
        library = paths[-1].split("site-packages/")[-1].split("/")[0] if paths else "native"
        places[f"{thread} · {module} · {library}"] += n
    possible = seconds * rate
    ms = 1000 / rate
    return {
        "samples": total,
        "gil_held_pct": round(100 * total / possible, 1),
        "jobs_per_s": jobs_per_s,
        "by_thread": {t: {"samples": n, "ms_per_job": round(n * ms / seconds / jobs_per_s, 2)}
                      for t, n in threads.most_common()},
        "by_place": {p: {"samples": n, "ms_per_job": round(n * ms / seconds / jobs_per_s, 2)}
                     for p, n in places.most_common(25)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stem", default="gil_profile_cpu")
    ap.add_argument("--broker-url", required=True)
    ap.add_argument("--database-url", required=True)
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "ocr-eval")
    ap.add_argument("--jobs", type=int, default=1500)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--settle-s", type=float, default=8.0, help="after ready, before sampling")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gil_profile_work"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.device == "cpu":
        env["OCRQ_SCHEDULER"] = "continuous"
    bench = subprocess.Popen([
        sys.executable, str(REPO / "bench" / "service_gpu.py"), "--shape", args.shape,
        "--device", args.device, "--dtype", "float32" if args.device == "cpu" else "bfloat16",
        "--data", str(args.data), "--out", str(work), "--jobs", str(args.jobs),
        "--a4-share", "0.05", "--max-new-tokens", str(args.max_new_tokens),
        "--broker-url", args.broker_url, "--database-url", args.database_url,
        "--skip-engine-alone", "--service-timeout-s", "600", "--stem", "service",
    ], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        pid = worker_pid(600)
        log = work / "work" / "worker-default.log"
        while " ready." not in (log.read_text(errors="replace") if log.exists() else ""):
            time.sleep(0.5)
        time.sleep(args.settle_s)
        raw = args.out / f"{args.stem}.raw.txt"
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        subprocess.run([spy, "record", "--gil", "--threads", "--nonblocking",
                        "-d", str(int(args.seconds)), "-r", str(args.rate), "-p", str(pid),
                        "-f", "raw", "-o", str(raw)], check=True, capture_output=True)
        bench.wait(900)
    finally:
        if bench.poll() is None:
            bench.kill()
    service = json.loads((work / "service.json").read_text())["service"]
    jobs_per_s = service["steady_images_per_s"]
    result = summarise(raw, args.seconds, args.rate, jobs_per_s)
    result["command"] = " ".join(["python", "bench/gil_profile.py", *sys.argv[1:]])
    raw.unlink()
    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Who holds a worker's GIL while the service runs (bench/gil_profile.py)", "",
        f"`{result['command']}`", "",
        f"{args.shape} model on {args.device}; {os.cpu_count()} cores; py-spy --gil for "
        f"{args.seconds:.0f} s at {args.rate} Hz in the steady part of a {args.jobs}-job run "
        f"({jobs_per_s} jobs/s). The GIL was held {result['gil_held_pct']}% of the time.", "",
        "| thread | samples | GIL ms per job |", "|---|---:|---:|",
    ] + [f"| {t} | {v['samples']} | {v['ms_per_job']} |" for t, v in result["by_thread"].items()]
    lines += ["", "| thread, innermost ocrq module, library running | samples | GIL ms per job |",
              "|---|---:|---:|"]
    lines += [f"| {p} | {v['samples']} | {v['ms_per_job']} |"
              for p, v in result["by_place"].items()]
    (args.out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
