"""Private Redis and PostgreSQL servers that a fault test may stop and start at will.

The machine's own servers are shared by every test, so faults are injected into servers the
test owns: a Redis with an append-only file (so a restart keeps the queue), a PostgreSQL cluster
in a temporary folder.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, up: bool, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                if up:
                    return
        except OSError:
            if not up:
                return
        time.sleep(0.1)
    raise TimeoutError(f"port {port} not {'up' if up else 'down'} after {timeout} s")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux)."""
    import ctypes
    import signal

    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class PrivateRedis:
    def __init__(self, folder: Path, persist: bool = True) -> None:
        """`persist`: an append-only file synced on every write (a restart keeps the queue);
        off for a session's broker, which is never restarted."""
        self.folder = folder
        self.persist = persist
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                "--appendonly",
                "yes" if self.persist else "no",
                "--appendfsync",
                "always",
                "--save",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # A session killed outright (pytest-timeout's thread method exits at once) takes
            # its broker along rather than leaving it running.
            preexec_fn=None if self.persist else _die_with_parent,
        )
        _wait_port(self.port, up=True)

    def stop(self) -> None:
        """A clean SHUTDOWN: the append-only file keeps every message."""
        if self.proc and self.proc.poll() is None:
            import redis

            with contextlib.suppress(redis.ConnectionError):
                redis.Redis(port=self.port).shutdown()
            self.proc.wait(30)
        _wait_port(self.port, up=False)


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"PostgreSQL's {name} not found (Debian package postgresql)")
    return found[-1]


class PrivatePostgres:
    """A throw-away cluster run as the `postgres` user (the server refuses to run as root)."""

    def __init__(self) -> None:
        # Its own folder under /tmp: pytest's tmp folders are private to root, and the server
        # runs as `postgres`.
        self.folder = Path(tempfile.mkdtemp(prefix="ocrq-pg-"))
        self.folder.chmod(0o755)
        self.data = self.folder / "pgdata"
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/ocrq"

    def _as_pg(self, *cmd: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run(
            [*prefix, *cmd],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )

    def init(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
        self._as_pg(
            _pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync"
        )
        self.start()

    def start(self) -> None:
        self._as_pg(
            _pg_bin("pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.folder / "pg.log"),
            "-w",
            "-o",
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1",
            "start",
        )
        _wait_port(self.port, up=True)

    def stop(self) -> None:
        self._as_pg(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        _wait_port(self.port, up=False)

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
