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
import uuid
from pathlib import Path


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_FLOOR = _ephemeral_floor()
_LOW = max(1024, _FLOOR - 12768)  # 20000-32767 under Linux's default range
_next_port = _LOW + (os.getpid() * 7919) % max(_FLOOR - _LOW, 1)


def free_port() -> int:
    """A port nothing is bound to, below the kernel's ephemeral range.

    A port the kernel hands out for a bind to port 0 comes from the ephemeral range, which every
    outbound connection on the host draws from too (the tests' own clients of Redis and
    PostgreSQL, hundreds a minute): between this call and the server's bind, a connection could
    take it. Ports below the range are never given to a connection. Each call in a process moves
    on from the last (so two ports asked before either server binds differ), from a start that
    depends on the process id (so parallel test processes start apart)."""
    global _next_port
    if _FLOOR - _LOW < 256:  # a host whose ephemeral range starts low: the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(_FLOOR - _LOW):
        port = _next_port
        _next_port = _LOW + (port + 1 - _LOW) % (_FLOOR - _LOW)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_LOW}-{_FLOOR - 1}")


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
    """A redis-server of the test's own, on a free loopback port, with a password.

    Why the password: sessions run side by side on one host, and a fault test that restarts
    its server leaves its port free for a few seconds; another session may start its broker
    there meanwhile, and the first test's SHUTDOWN at its end (or its clients) would then reach
    a server that is not its own (a loop run lost its broker mid-test that way). With a
    password of its own, a stranger's command is refused; `stop` signals its own process only.
    """

    def __init__(
        self,
        folder: Path,
        persist: bool = True,
        password: str | None = None,
        replica_of: PrivateRedis | None = None,
    ) -> None:
        """`persist`: an append-only file synced on every write (a restart keeps the queue);
        off for a session's broker, which is never restarted. `replica_of`: a replica of that
        server (its password, which this one then shares, so a promoted replica answers the
        clients of the master)."""
        self.folder = folder
        self.persist = persist
        self.port = free_port()
        self.replica_of = replica_of
        self.password = replica_of.password if replica_of else (password or uuid.uuid4().hex)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

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
                "--requirepass",
                self.password,
                # a replica's first sync starts at once, not after Redis's default 5 s wait
                "--repl-diskless-sync-delay",
                "0",
                *self._replica_args(),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # A session killed outright (pytest-timeout's thread method exits at once) takes
            # its broker along rather than leaving it running.
            preexec_fn=None if self.persist else _die_with_parent,
        )
        _wait_port(self.port, up=True)
        import redis

        try:  # our password answers: the server on the port is this one, not another's
            redis.Redis.from_url(self.url).ping()
        except redis.RedisError as exc:
            raise RuntimeError(f"port {self.port} is not this test's redis-server: {exc}") from None

    def _replica_args(self) -> list[str]:
        if self.replica_of is None:
            return []
        master = self.replica_of
        return ["--replicaof", "127.0.0.1", str(master.port), "--masterauth", master.password]

    def stop(self) -> None:
        """SIGTERM to its own process (redis-server shuts down cleanly on it, syncing the
        append-only file, which keeps every message), never a command to whatever listens."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        _wait_port(self.port, up=False)

    def kill(self) -> None:
        """SIGKILL to its own process: the host dies, nothing is synced or handed over."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        _wait_port(self.port, up=False)


class PrivateSentinel:
    """A Redis Sentinel of the test's own: `redis-server <config> --sentinel` (the Debian package
    redis-sentinel adds only a service unit and a config file to the same binary), watching
    `master` under `name`, on a free loopback port, with a password (as PrivateRedis says why).
    It rewrites its config file as it learns, so each has a folder of its own."""

    def __init__(
        self,
        folder: Path,
        master: PrivateRedis,
        name: str,
        quorum: int,
        password: str,
        down_after_ms: int = 1000,
    ) -> None:
        self.folder = folder
        self.port = free_port()
        self.password = password
        self.master = master
        self.name = name
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "sentinel.conf"
        config.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    f"dir {self.folder}",
                    f"requirepass {self.password}",
                    # sentinels find each other through the master and talk with this password
                    f"sentinel sentinel-pass {self.password}",
                    f"sentinel monitor {self.name} 127.0.0.1 {self.master.port} {self.quorum}",
                    f"sentinel auth-pass {self.name} {self.master.password}",
                    f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}",
                    f"sentinel failover-timeout {self.name} 10000",
                    f"sentinel parallel-syncs {self.name} 1",
                    "",
                ]
            )
        )
        with (self.folder / "sentinel.log").open("wb") as log:
            self.proc = subprocess.Popen(
                [shutil.which("redis-server") or "redis-server", str(config), "--sentinel"],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        _wait_port(self.port, up=True)

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=2
        )

    def log(self) -> str:
        path = self.folder / "sentinel.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


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


def _pgbouncer_bin() -> str:
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/bin")
    if not found:
        raise RuntimeError(
            "pgbouncer not found (Debian package pgbouncer: scripts/services.sh --for-tests)"
        )
    return found


class PrivateBouncer:
    """PgBouncer in transaction mode on a free loopback port, in front of one database.

    `pool_size` server connections at most for all its clients together: what a GPU host puts
    in front of PostgreSQL (docs/operations.md). Started as `postgres` when the test runs as
    root (PgBouncer refuses root without `-u`); its own process, so `stop` signals only it.
    """

    def __init__(self, pg_port: int, database: str, pool_size: int) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="ocrq-pgbouncer-"))
        self.folder.chmod(0o755)
        self.port = free_port()
        self.database = database
        self.pool_size = pool_size
        self.pg_port = pg_port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{self.database}"

    @property
    def log(self) -> Path:
        return self.folder / "pgbouncer.log"

    def start(self) -> None:
        (self.folder / "users.txt").write_text('"postgres" ""\n')
        config = self.folder / "pgbouncer.ini"
        config.write_text(
            f"[databases]\n{self.database} = host=127.0.0.1 port={self.pg_port} "
            f"dbname={self.database}\n"
            f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"unix_socket_dir =\nauth_type = trust\nauth_file = {self.folder}/users.txt\n"
            f"pool_mode = transaction\ndefault_pool_size = {self.pool_size}\n"
            "max_client_conn = 500\n"
        )
        user = ["-u", "postgres"] if os.geteuid() == 0 else []
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [_pgbouncer_bin(), *user, str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        _wait_port(self.port, up=True)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        shutil.rmtree(self.folder, ignore_errors=True)
