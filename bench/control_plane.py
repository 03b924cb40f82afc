"""What one job costs the control plane (Redis, PostgreSQL, the worker), counted by the servers.

Why a bench of its own: a user with 100 GPUs needs producers -> Redis -> Celery -> claim/finish
in PostgreSQL -> ack to carry ~3,000 jobs/s, and only the servers' own counters say what a job
costs them (issue 33). The engine is replaced by `fixed`, which returns one fixed OcrResult at
once: what is left is the control plane (the issue allows it for this benchmark only). The
engine is registered by `worker_main`, the launcher each worker process runs, so production
code knows nothing of it.

It starts a private redis-server and a private PostgreSQL 15 (pg_stat_statements loaded) on
free ports, migrates, and for each phase:

- fills a holding queue with K jobs while the workers idle (so the rate measured is the
  workers', not the producer's), then RENAMEs it onto the queue the workers consume;
- waits until every row is final, sampling pg_stat_activity for connections per worker;
- takes deltas of INFO commandstats / INFO stats, pg_stat_statements (per role: the producer
  and the workers log in as different roles), pg_stat_database, pg_stat_wal, and the CPU
  seconds of redis-server, of every postgres process (the postmaster's reaped children
  included) and of each worker process, from /proc.

Phases: an idle window (background cost per second: heartbeats, BRPOP polls, worker events),
image jobs by path, pages of P-page PDFs by path, URL jobs against a local HTTP server, each with
one worker process; then image jobs with several worker processes for the sustained rate.

Run: `PYTHONPATH=. .venv/bin/python bench/control_plane.py` (as root: PostgreSQL runs as the
`postgres` user). Results go to bench/results/control_plane/.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_OS_USER = "postgres"
HOLD = "cp-hold"  # the queue jobs wait in until a phase starts
QUEUE = "ocr"
CLK = os.sysconf("SC_CLK_TCK")
# A result of realistic size: ~1.6 KB of text in 20 lines with boxes, as a printed page gives.
LINE_TEXT = "The quick brown fox jumps over the lazy dog; 0123456789 ABCDEFGHIJKLMN."
N_LINES = 20


# -- the bench-only engine -------------------------------------------------------------------


def _fixed_engine(settings: Any) -> Any:
    """A factory for ENGINES: an engine that returns the same result for every image at once."""
    from ocrq.core.pixel_budget import PixelBudget
    from ocrq.models.base import Engine, Line, OcrResult, PreparedImage
    from ocrq.models.costs import CostModel, ItemCost

    result = OcrResult(
        text="\n".join(LINE_TEXT for _ in range(N_LINES)),
        lines=[Line(LINE_TEXT, (10, 10 + 30 * i, 600, 36 + 30 * i), 0.99) for i in range(N_LINES)],
    )

    class FixedEngine(Engine):
        name = "fixed"

        def load(self) -> None:
            pass

        def estimate(self, item: PreparedImage) -> ItemCost:
            w, h = item.size
            return ItemCost(tokens=0, patches=1, pixels=w * h)

        def cost_model(self) -> CostModel:
            return CostModel(fixed_bytes=0, per_item_bytes=1.0)

        def pixel_budget(self, task: str, job_cap: int | None) -> PixelBudget:
            # Pages rendered small (the PDF's lowest DPI): rendering is not the control plane.
            # A limit far above every image: nothing is shrunk while it waits.
            return PixelBudget(task_preset=64 * 64, model_limit=2**31)

        def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
            return [result for _ in batch]

    return FixedEngine()


def worker_main() -> None:
    """One worker process as `ocrq worker --no-supervise --engine fixed` runs it, with the
    bench engine registered first (this process only)."""
    from ocrq.cli import app
    from ocrq.models.registry import ENGINES

    ENGINES["fixed"] = _fixed_engine
    sys.argv = ["ocrq", "worker", "--no-supervise", "--engine", "fixed", "--loglevel", "WARNING"]
    app()


# -- private servers ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing on port {port}")


def as_pg(cmd: str) -> list[str]:
    """A command run as the postgres OS user (PostgreSQL refuses root)."""
    return ["su", PG_OS_USER, "-s", "/bin/sh", "-c", cmd]


@dataclass
class Servers:
    work: Path
    redis_port: int = 0
    pg_port: int = 0
    redis: subprocess.Popen[bytes] | None = None
    pg_data: Path | None = None
    bouncer_port: int = 0
    bouncer: subprocess.Popen[bytes] | None = None

    def start_pgbouncer(self, pool_size: int = 20) -> None:
        """PgBouncer in transaction mode in front of the private PostgreSQL (the workers'
        connections go through it): what a GPU fleet would put in front of one database."""
        conf = self.work / "bouncer"
        conf.mkdir(mode=0o755)
        (conf / "users.txt").write_text('"worker" ""\n"producer" ""\n"postgres" ""\n')
        self.bouncer_port = free_port()
        (conf / "pgbouncer.ini").write_text(
            f"[databases]\nocrq = host=127.0.0.1 port={self.pg_port} dbname=ocrq\n"
            f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {self.bouncer_port}\n"
            f"unix_socket_dir =\nauth_type = trust\nauth_file = {conf}/users.txt\n"
            f"pool_mode = transaction\ndefault_pool_size = {pool_size}\n"
            "max_client_conn = 2000\nignore_startup_parameters = extra_float_digits\n"
        )
        shutil.chown(conf, PG_OS_USER, PG_OS_USER)
        self.bouncer = subprocess.Popen(
            as_pg(f"exec pgbouncer {conf}/pgbouncer.ini"),
            stdout=(self.work / "pgbouncer.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        wait_port(self.bouncer_port)

    def start(self) -> Servers:
        self.redis_port = free_port()
        self.redis = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
                str(self.work),
            ],
            stdout=(self.work / "redis.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        wait_port(self.redis_port)
        self.pg_data = self.work / "pg"
        sock = self.work / "pgsock"
        for d in (self.pg_data, sock):
            d.mkdir(mode=0o700)
            shutil.chown(d, PG_OS_USER, PG_OS_USER)
        os.chmod(self.work, 0o755)
        subprocess.run(
            as_pg(f"{PG_BIN}/initdb -D {self.pg_data} -A trust -U postgres"),
            check=True,
            capture_output=True,
            timeout=120,
        )
        self.pg_port = free_port()
        # PostgreSQL's defaults (synchronous_commit on: every job's commit is durable, as in
        # production) but for the statement counter and enough connections for the workers.
        opts = (
            f"-p {self.pg_port} -k {sock} -c listen_addresses=127.0.0.1 "
            "-c max_connections=300 -c shared_preload_libraries=pg_stat_statements "
            "-c pg_stat_statements.track_utility=on"
        )
        subprocess.run(
            as_pg(f"{PG_BIN}/pg_ctl -D {self.pg_data} -o '{opts}' -l {self.pg_data}/log -w start"),
            check=True,
            capture_output=True,
            timeout=120,
        )
        return self

    def stop(self) -> None:
        if self.pg_data is not None:
            subprocess.run(
                as_pg(f"{PG_BIN}/pg_ctl -D {self.pg_data} -m fast stop"),
                check=False,
                capture_output=True,
                timeout=60,
            )
        for proc in (self.redis, self.bouncer):
            if proc is not None:
                proc.terminate()
                proc.wait(20)

    def url(
        self, role: str, db: str = "ocrq", app_name: str | None = None, bouncer: bool = False
    ) -> str:
        tail = f"?application_name={app_name}" if app_name else ""
        port = self.bouncer_port if bouncer else self.pg_port
        return f"postgresql+psycopg://{role}@127.0.0.1:{port}/{db}{tail}"

    def broker(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def postmaster_pid(self) -> int:
        assert self.pg_data is not None
        return int((self.pg_data / "postmaster.pid").read_text().split()[0])


# -- counters ----------------------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on


def cpu_s(pid: int, children: bool = False) -> float:
    """utime + stime of a process (and of its reaped children)."""
    f = _stat(pid)
    ticks = int(f[11]) + int(f[12]) + ((int(f[13]) + int(f[14])) if children else 0)
    return ticks / CLK


def _pg_role(pid: int) -> str:
    """What a PostgreSQL process is, from the title it sets (`postgres: walwriter`, `postgres:
    worker ocrq 127.0.0.1(5555) idle`: a backend of the role `worker`)."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "other"
    words = title.removeprefix("postgres: ").split()
    if not words:
        return "other"
    if words[0] in ("producer", "worker", "postgres") and len(words) > 1 and words[1] == "ocrq":
        return f"backend:{words[0]}"
    return " ".join(words[:2]) if words[0] == "autovacuum" else words[0]


def postgres_cpu(postmaster: int) -> dict[str, float]:
    """CPU seconds of every PostgreSQL process by kind: the postmaster, each live child (a
    backend by role, walwriter, checkpointer, ...), and the children it has reaped (backends
    that exited, autovacuum workers), which the kernel adds to its cutime/cstime."""
    f = _stat(postmaster)
    out: dict[str, float] = defaultdict(float)
    out["postmaster"] = (int(f[11]) + int(f[12])) / CLK
    out["reaped children"] = (int(f[13]) + int(f[14])) / CLK
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat(int(entry.name))[1]) == postmaster:
                    out[_pg_role(int(entry.name))] += cpu_s(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return dict(out)


@dataclass
class Snapshot:
    t: float
    redis_cmds: dict[str, int]
    redis_stats: dict[str, int]
    # (role, query): calls, rows, WAL bytes, exec ms
    statements: dict[tuple[str, str], tuple[int, int, int, float]]
    database: dict[str, int]
    wal_bytes: int
    cpu: dict[str, float]


def snapshot(r: Any, pg: Any, servers: Servers, workers: dict[str, int]) -> Snapshot:
    cmds = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}
    stats = {k: int(v) for k, v in r.info("stats").items() if isinstance(v, int)}
    stats["used_memory"] = int(r.info("memory")["used_memory"])  # results kept, messages
    rows = pg.execute(
        "SELECT r.rolname, s.query, sum(s.calls), sum(s.rows), sum(s.wal_bytes), "
        "sum(s.total_exec_time) "
        "FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid "
        "WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = 'ocrq') "
        "AND r.rolname IN ('producer', 'worker') GROUP BY 1, 2"
    ).fetchall()
    statements = {(role, q): (int(c), int(n), int(w), float(ms)) for role, q, c, n, w, ms in rows}
    db = pg.execute(
        "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted, "
        "tup_returned, tup_fetched, sessions FROM pg_stat_database WHERE datname = 'ocrq'"
    ).fetchone()
    names = (
        "xact_commit",
        "xact_rollback",
        "tup_inserted",
        "tup_updated",
        "tup_deleted",
        "tup_returned",
        "tup_fetched",
        "sessions",  # connections opened: a pool that closes and reopens them shows here
    )
    wal = int(pg.execute("SELECT wal_bytes FROM pg_stat_wal").fetchone()[0])
    assert servers.redis is not None
    # Less the backend serving these snapshots and the bench's polls.
    by_kind = postgres_cpu(servers.postmaster_pid())
    by_kind["backend:postgres"] = by_kind.get("backend:postgres", 0.0) - cpu_s(pg.info.backend_pid)
    cpu = {"redis": cpu_s(servers.redis.pid), "postgres": sum(by_kind.values())}
    cpu.update({f"pg {k}": v for k, v in by_kind.items()})
    for name, pid in workers.items():
        cpu[name] = cpu_s(pid, children=True)
    cpu["bench"] = time.process_time()  # the producer (and the HTTP server) run here
    # exec time per statement, summed: the backends' share of PostgreSQL's CPU is mostly this
    return Snapshot(
        time.monotonic(), cmds, stats, statements, dict(zip(names, db, strict=True)), wal, cpu
    )


def delta(a: Snapshot, b: Snapshot, jobs: int) -> dict[str, Any]:
    """Per-job costs between two snapshots (totals too)."""
    per = 1 / jobs if jobs else 0.0

    def sub(x: dict[Any, int], y: dict[Any, int]) -> dict[Any, int]:
        return {k: y[k] - x.get(k, 0) for k in y if y[k] - x.get(k, 0)}

    cmds = sub(a.redis_cmds, b.redis_cmds)
    cmds.pop("info", None)  # the bench's own snapshots
    stmts = []
    for key, (calls, rows, wal, ms) in b.statements.items():
        c0, r0, w0, ms0 = a.statements.get(key, (0, 0, 0, 0.0))
        if calls - c0:
            stmts.append(
                {
                    "role": key[0],
                    "query": " ".join(key[1].split())[:300],
                    "calls": calls - c0,
                    "rows": rows - r0,
                    "wal_bytes": wal - w0,
                    "exec_ms": round(ms - ms0, 1),
                    "calls_per_job": round((calls - c0) * per, 3),
                    "rows_per_job": round((rows - r0) * per, 3),
                }
            )
    stmts.sort(key=lambda s: (s["role"], -s["calls"]))
    st = sub(a.redis_stats, b.redis_stats)
    redis_keys = (
        "total_net_input_bytes",
        "total_net_output_bytes",
        "total_reads_processed",
        "total_writes_processed",
        "total_commands_processed",
    )
    cpu = {k: round(b.cpu[k] - a.cpu.get(k, 0.0), 3) for k in b.cpu}
    workers_cpu = sum(v for k, v in cpu.items() if k[0] == "w" and k[1:].isdigit())
    by_role: dict[str, int] = defaultdict(int)
    xacts: dict[str, int] = defaultdict(int)
    for s in stmts:
        by_role[s["role"]] += s["calls"]
        if s["query"] in ("COMMIT", "ROLLBACK"):
            xacts[s["role"]] += s["calls"]
    return {
        "jobs": jobs,
        "seconds": round(b.t - a.t, 2),
        "redis_commands": dict(sorted(cmds.items(), key=lambda kv: -kv[1])),
        "redis_commands_per_job": round(sum(cmds.values()) * per, 2),
        "redis_commands_per_job_by_type": {
            k: round(v * per, 3) for k, v in sorted(cmds.items(), key=lambda kv: -kv[1])
        },
        "redis_stats": {k: st.get(k, 0) for k in redis_keys},
        # What stays in Redis per job once it is done (the result backend's keys, kept for
        # OCRQ_RESULT_EXPIRES_S): the Redis memory a sustained rate needs.
        "redis_memory_bytes_per_job": round(
            (b.redis_stats["used_memory"] - a.redis_stats["used_memory"]) * per
        ),
        "redis_bytes_in_per_job": round(st.get("total_net_input_bytes", 0) * per),
        "redis_bytes_out_per_job": round(st.get("total_net_output_bytes", 0) * per),
        "redis_reads_per_job": round(st.get("total_reads_processed", 0) * per, 2),
        "sql_statements": stmts,
        "sql_calls_per_job": {k: round(v * per, 2) for k, v in by_role.items()},
        "sql_calls_per_job_total": round(sum(by_role.values()) * per, 2),
        "database": sub(a.database, b.database),
        # pg_stat_database counts the bench's own polls too: the roles' COMMITs are exact.
        "transactions_per_job": {k: round(v * per, 2) for k, v in xacts.items()},
        "pg_sessions_per_job": round((b.database["sessions"] - a.database["sessions"]) * per, 3),
        "wal_bytes_per_job": round((b.wal_bytes - a.wal_bytes) * per),
        "cpu_s": cpu,
        "postgres_cpu_ms_per_job_by_process": {
            k.removeprefix("pg "): round(v * 1000 * per, 3)
            for k, v in cpu.items()
            if k.startswith("pg ") and abs(v) > 0.001
        },
        "sql_exec_ms_per_job": round(sum(s["exec_ms"] for s in stmts) * per, 3),
        "cpu_ms_per_job": {
            "redis": round(cpu["redis"] * 1000 * per, 3),
            "postgres": round(cpu["postgres"] * 1000 * per, 3),
            "workers": round(workers_cpu * 1000 * per, 3),
            "producer_and_bench": round(cpu["bench"] * 1000 * per, 3),
        },
    }


# -- inputs ------------------------------------------------------------------------------------


def make_inputs(folder: Path, pages: int) -> tuple[Path, Path]:
    """A small PNG (rendering and decoding are not the control plane) and a PDF of `pages`."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (320, 240), "white")
    ImageDraw.Draw(img).text((10, 10), "control plane bench", fill="black")
    png = folder / "page.png"
    img.save(png)
    pdf = folder / "doc.pdf"
    frames = [Image.new("RGB", (144, 144), "white") for _ in range(pages)]
    frames[0].save(pdf, save_all=True, append_images=frames[1:], resolution=72.0)
    return png, pdf


def serve_folder(folder: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=str(folder), **kw)

        def log_message(self, *a: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, int(httpd.server_address[1])


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Bench:
    servers: Servers
    folder: Path
    env: dict[str, str]
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start_workers(self, n: int) -> None:
        self.stop_workers()
        for i in range(n):
            name = f"w{i}"
            env = {
                **self.env,
                "OCRQ_DATABASE_URL": self.servers.url(
                    "worker", app_name=f"cp-{name}", bouncer=self.servers.bouncer is not None
                ),
            }
            log = (self.folder / f"worker-{n}-{name}.log").open("wb")
            self.workers[name] = subprocess.Popen(
                [sys.executable, "-c", "import bench.control_plane as c; c.worker_main()"],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop_workers(self) -> None:
        for proc in self.workers.values():
            proc.terminate()
        for proc in self.workers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.workers.clear()

    def pids(self) -> dict[str, int]:
        return {k: p.pid for k, p in self.workers.items()}


def wait_ready(pg: Any, n: int, timeout: float = 120) -> None:
    """Until `n` workers have registered their heartbeat rows (their engine is loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pg.execute("SELECT count(*) FROM ocr_workers").fetchone()[0] >= n:
            time.sleep(2.0)  # Celery's consumer starts just after the heartbeat registers
            return
        time.sleep(0.2)
    raise TimeoutError("workers did not start")


def run_phase(
    bench: Bench, r: Any, pg: Any, label: str, submit: Callable[[], int], units: int
) -> dict[str, Any]:
    """Fill the holding queue, start the clock, release it onto the workers' queue, wait."""
    before = snapshot(r, pg, bench.servers, bench.pids())
    ids = submit()
    pre_rename = snapshot(r, pg, bench.servers, bench.pids())
    peak: dict[str, int] = defaultdict(int)
    peak_total = 0
    last_pending, progressed = -1, time.monotonic()
    t0 = time.monotonic()
    r.rename(HOLD, QUEUE)
    while True:
        for app_name, n in pg.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity "
            "WHERE usename = 'worker' GROUP BY 1"
        ).fetchall():
            peak[app_name] = max(peak[app_name], int(n))
        total = sum(
            int(n)
            for (n,) in pg.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE usename = 'worker'"
            ).fetchall()
        )
        peak_total = max(peak_total, total)
        pending = pg.execute(
            "SELECT (SELECT count(*) FROM ocr_jobs WHERE status NOT IN ('done', 'failed')) + "
            "(SELECT count(*) FROM ocr_documents WHERE status NOT IN ('done', 'failed', "
            "'partial'))"
        ).fetchone()[0]
        if pending == 0 and r.llen(QUEUE) == 0:
            break
        if pending != last_pending:
            last_pending, progressed = pending, time.monotonic()
        if time.monotonic() - progressed > 60:  # jobs that raised leave their rows running
            raise TimeoutError(f"{label}: {pending} jobs not final, none for 60 s")
        time.sleep(0.25)
    wall = time.monotonic() - t0
    after = snapshot(r, pg, bench.servers, bench.pids())
    failed = pg.execute("SELECT count(*) FROM ocr_jobs WHERE status = 'failed'").fetchone()[0]
    times = pg.execute(
        "SELECT extract(epoch FROM min(started_at)), extract(epoch FROM max(finished_at)), "
        "count(*) FROM ocr_jobs WHERE page IS NOT NULL OR document_id IS NULL"
    ).fetchone()
    out = delta(before, after, units)
    release = delta(pre_rename, after, units)
    out.update(
        {
            "label": label,
            "workers": len(bench.workers),
            "submitted_messages": ids,
            "failed": int(failed),
            "wall_s_after_release": round(wall, 2),
            "jobs_per_s": round(units / wall, 1),
            "rows_span_s": round(float(times[1]) - float(times[0]), 2),
            "jobs_per_s_rows": round(units / (float(times[1]) - float(times[0])), 1),
            "worker_cpu_ms_per_job_after_release": release["cpu_ms_per_job"]["workers"],
            "pg_connections_peak_per_worker": dict(peak),
            "pg_connections_peak_total": peak_total,
        }
    )
    pg.execute("TRUNCATE ocr_jobs, ocr_documents")  # each phase starts from an empty table
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=600, help="jobs per single-worker phase")
    ap.add_argument("--pages", type=int, default=10, help="pages per PDF")
    ap.add_argument("--workers", default="2,4", help="worker processes for the rate phases")
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument(
        "--kinds",
        default="image,page,url",
        help="single-worker phases to run (a subset for quick A/B runs)",
    )
    ap.add_argument(
        "--pool",
        default="",
        help="SIZE,OVERFLOW of the workers' pool (OCRQ_DATABASE_POOL_SIZE / _MAX_OVERFLOW)",
    )
    ap.add_argument(
        "--pgbouncer",
        action="store_true",
        help="the workers reach PostgreSQL through PgBouncer in transaction mode",
    )
    ap.add_argument(
        "--bouncer-pool",
        type=int,
        default=20,
        help="PgBouncer's default_pool_size: server connections for all the workers together",
    )
    ap.add_argument(
        "--no-prepare",
        action="store_true",
        help="the workers' psycopg prepares no statements (prepare_threshold=None)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/control_plane")
    args = ap.parse_args()

    import psycopg
    import redis

    started = time.time()
    # A SIGTERM (`timeout`) still runs the `finally` below: the private servers stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="ocrq-cp-"))
    servers = Servers(work).start()
    httpd = None
    bench: Bench | None = None
    try:
        with psycopg.connect(
            f"host=127.0.0.1 port={servers.pg_port} user=postgres", autocommit=True
        ) as admin:
            admin.execute("CREATE DATABASE ocrq")
            for role in ("producer", "worker"):
                admin.execute(f"CREATE ROLE {role} LOGIN SUPERUSER")
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OCRQ_BROKER_URL": servers.broker(),
            "OCRQ_DATABASE_URL": servers.url("postgres"),
            "OCRQ_QUEUE": QUEUE,
            "OCRQ_ALLOWED_ROOTS": str(work),
            "OCRQ_URL_ALLOW_NETWORKS": "127.0.0.1/32",
            "OCRQ_MEMORY_BUDGET_GIB": "4",
            "OCRQ_MAX_IMAGES": "100000000",
        }
        if args.pool:
            size, overflow = args.pool.split(",")
            env["OCRQ_DATABASE_POOL_SIZE"], env["OCRQ_DATABASE_MAX_OVERFLOW"] = size, overflow
        if args.no_prepare:
            env["OCRQ_DATABASE_PREPARED_STATEMENTS"] = "false"
        if args.pgbouncer:
            servers.start_pgbouncer(args.bouncer_pool)
        subprocess.run(
            [sys.executable, "-m", "ocrq.cli", "migrate"],
            env=env,
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
        pg = psycopg.connect(
            f"host=127.0.0.1 port={servers.pg_port} user=postgres dbname=ocrq", autocommit=True
        )
        pg.execute("CREATE EXTENSION pg_stat_statements")
        r = redis.Redis(port=servers.redis_port)
        png, pdf = make_inputs(work, args.pages)
        httpd, http_port = serve_folder(work)

        os.environ.update({k: v for k, v in env.items() if k.startswith("OCRQ_")})
        from ocrq.api.client import Client
        from ocrq.core.contract import JobRequest
        from ocrq.core.settings import Settings

        client = Client(Settings(database_url=servers.url("producer"), queue=HOLD))

        def submitter(image: dict[str, Any], count: int) -> Callable[[], int]:
            def submit() -> int:
                # The api's batch submit: one enqueue_many (rows) per 100, then a message each.
                for start in range(0, count, 100):
                    client.submit_many(
                        [
                            JobRequest.model_validate({"image": image})
                            for _ in range(min(100, count - start))
                        ]
                    )
                return count

            return submit

        bench = Bench(servers, work, env)
        results: dict[str, Any] = {"phases": []}
        bench.start_workers(1)
        wait_ready(pg, 1)
        idle0 = snapshot(r, pg, servers, bench.pids())
        time.sleep(args.idle_s)
        idle = delta(idle0, snapshot(r, pg, servers, bench.pids()), 1)
        results["idle_one_worker"] = idle
        k, p = args.jobs, args.pages
        phases: dict[str, tuple[str, dict[str, Any], int, int]] = {
            "image": ("image (path)", {"path": str(png)}, k, k),
            "page": (
                f"document page (path PDF, {p} pages)",
                {"path": str(pdf)},
                k // p,
                (k // p) * p,
            ),
            "url": ("url", {"url": f"http://127.0.0.1:{http_port}/page.png"}, k, k),
        }
        for kind in args.kinds.split(","):
            label, image, count, units = phases[kind]
            print(f"phase: {label}, 1 worker", flush=True)
            results["phases"].append(run_phase(bench, r, pg, label, submitter(image, count), units))
        for n in [int(x) for x in args.workers.split(",") if x]:
            print(f"phase: image, {n} workers", flush=True)
            bench.start_workers(n)
            pg.execute("DELETE FROM ocr_workers")
            wait_ready(pg, n)
            count = k * 2
            results["phases"].append(
                run_phase(
                    bench,
                    r,
                    pg,
                    f"image (path), {n} workers",
                    submitter({"path": str(png)}, count),
                    count,
                )
            )
        results["meta"] = meta(args, time.time() - started)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "control_plane_cpu.json").write_text(json.dumps(results, indent=1) + "\n")
        print(
            json.dumps(
                {
                    ph["label"]: {
                        "jobs_per_s": ph["jobs_per_s"],
                        "cpu_ms": ph["cpu_ms_per_job"],
                        "redis": ph["redis_commands_per_job"],
                        "sql": ph["sql_calls_per_job_total"],
                    }
                    for ph in results["phases"]
                },
                indent=1,
            )
        )
    finally:
        if bench is not None:
            bench.stop_workers()
        if httpd is not None:
            httpd.shutdown()
        servers.stop()
        shutil.rmtree(work, ignore_errors=True)


def meta(args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """How to repeat it and what it ran on (the machine is shared: the load says how much)."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    redis_v = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
    pg_v = subprocess.run([str(PG_BIN / "postgres"), "--version"], capture_output=True, text=True)
    return {
        "command": "PYTHONPATH=. .venv/bin/python bench/control_plane.py " + " ".join(sys.argv[1:]),
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "loadavg_at_end": os.getloadavg(),
        "redis": redis_v.stdout.strip(),
        "postgres": pg_v.stdout.strip(),
        "python": platform.python_version(),
        "bench_seconds": round(seconds, 1),
        "jobs_per_phase": args.jobs,
        "pgbouncer": (
            f"transaction mode, default_pool_size {args.bouncer_pool}" if args.pgbouncer else "none"
        ),
        "psycopg_prepare": "off" if args.no_prepare else "psycopg's default (after 5 uses)",
        "worker_pool": args.pool or "ocrq's default (pool_size 10, max_overflow 0)",
        "pages": args.pages,
        "result_text_chars": len(LINE_TEXT) * N_LINES + N_LINES - 1,
        "result_lines": N_LINES,
    }


if __name__ == "__main__":
    main()
