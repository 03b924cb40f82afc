"""Shared fixtures: a fresh PostgreSQL database migrated by `ocrq migrate`, a Redis database of
its own, real `ocrq worker` processes, and text images drawn on the fly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from ocrq.core.samples import draw_text_image

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EVAL_DATA = Path(os.environ.get("OCRQ_EVAL_DATA", REPO.parent / "shared" / "data" / "ocr-eval"))
# Unset: each test session gets a Redis server of its own (see `broker_url`).
TEST_BROKER = os.environ.get("OCRQ_TEST_BROKER_URL")
# Unset: the session starts a PostgreSQL server of its own (see `pytest_configure`), and this
# becomes its admin URL before any test module reads it.
TEST_PG = os.environ.get("OCRQ_TEST_PG_URL", "")
_PRIVATE_PG: list[object] = []  # the session's own server, stopped in `pytest_unconfigure`


# Figures the fault tests measure (jobs, done, lost, ...), printed at the end of every run.
FIGURES: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Without OCRQ_TEST_PG_URL, start a throw-away PostgreSQL cluster on a free loopback port
    (tests/servers.py `PrivatePostgres`, ~3 s) and point every test at it.

    Why: the suite creates and drops databases, kills workers mid-transaction and fills tables;
    on a developer's machine none of that should reach the PostgreSQL that holds their data, and
    sessions side by side must not share one server's connection limit. A given server is still
    used when OCRQ_TEST_PG_URL names it (a CI service container, say).
    """
    global TEST_PG
    if TEST_PG or hasattr(config, "workerinput"):
        return
    from tests.servers import PrivatePostgres

    server = PrivatePostgres()
    server.init()
    _PRIVATE_PG.append(server)
    TEST_PG = f"postgresql+psycopg://postgres@127.0.0.1:{server.port}/postgres"
    os.environ["OCRQ_TEST_PG_URL"] = TEST_PG  # for modules that read it themselves


def pytest_unconfigure(config: pytest.Config) -> None:
    for server in _PRIVATE_PG:
        server.destroy()  # type: ignore[attr-defined]
    _PRIVATE_PG.clear()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("ocrq fault-test figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


def eval_data() -> Path:
    """The shared evaluation images; their absence is a setup error, not a skip."""
    if not (EVAL_DATA / "manifest.tsv").is_file():
        pytest.fail(f"evaluation data not found at {EVAL_DATA} (set OCRQ_EVAL_DATA)")
    return EVAL_DATA


@pytest.fixture(scope="session")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis server of this session's own, on a free loopback port.

    Why not a database of the machine's Redis: sessions run side by side here (engineers on
    one host, a loop beside a single test), and each used to FLUSHDB the shared database 15
    as it started, wiping another session's queue and `unacked` mid-test; its jobs then waited
    forever (a fault test "hung" with its worker idle). OCRQ_TEST_BROKER_URL still picks a
    given server, flushed as before.
    """
    if TEST_BROKER is not None:
        redis.Redis.from_url(TEST_BROKER).flushdb()
        yield TEST_BROKER
        return
    from tests.servers import PrivateRedis

    server = PrivateRedis(tmp_path_factory.mktemp("redis"), persist=False)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def _database(name: str) -> str:
    return make_url(TEST_PG).set(database=name).render_as_string(hide_password=False)


def _drop(name: str) -> None:
    admin = create_engine(TEST_PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@contextmanager
def migrated(prefix: str) -> Iterator[str]:
    """A new database created and migrated by the real `ocrq migrate`, dropped afterwards;
    its name."""
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OCRQ_DATABASE_URL": _database(name)}
    subprocess.run([str(BIN / "ocrq"), "migrate"], env=env, check=True, timeout=120)
    try:
        yield name
    finally:
        _drop(name)


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A new database per test session, created and migrated by the real `ocrq migrate`."""
    with migrated("ocrq_test_") as name:
        yield _database(name)


@pytest.fixture(scope="session")
def migrated_template() -> Iterator[str]:
    """An empty migrated database, copied by `private_database` (PostgreSQL copies a template
    in a fraction of a migration's time); nothing connects to it after the migration, as a
    template's copy needs."""
    with migrated("ocrq_test_tpl_") as name:
        yield name


@contextmanager
def copy_of(template: str) -> Iterator[str]:
    """A new database copied from `template`, dropped afterwards; its URL."""
    name = f"ocrq_test_{uuid.uuid4().hex[:8]}"
    admin = create_engine(TEST_PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
    admin.dispose()
    try:
        yield _database(name)
    finally:
        _drop(name)


@pytest.fixture
def private_database(migrated_template: str) -> Iterator[str]:
    """A migrated, empty database of this test's own. For tests whose workers sweep for lost
    messages and count what they ran: the sweep re-sends every `queued` row whose message its
    broker does not hold, to the sweeping worker's queue, so in the session's shared database
    it re-ran rows other tests left queued (a Redis of the test's own holds none of their
    messages), ahead of the test's own, and the counts and times asserted were theirs."""
    with copy_of(migrated_template) as url:
        yield url


@pytest.fixture(scope="module")
def module_database(migrated_template: str) -> Iterator[str]:
    """`private_database` for a module's fixtures."""
    with copy_of(migrated_template) as url:
        yield url


@pytest.fixture(scope="session")
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The only folder (besides the eval data) workers may read `path` images from."""
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="session")
def service_env(broker_url: str, database_url: str, image_root: Path) -> dict[str, str]:
    return {
        **os.environ,
        "OCRQ_BROKER_URL": broker_url,
        "OCRQ_DATABASE_URL": database_url,
        "OCRQ_ALLOWED_ROOTS": os.pathsep.join([str(image_root), str(EVAL_DATA)]),
        "OCRQ_ENGINE": "rapid",
        "PYTHONUNBUFFERED": "1",
    }


class WorkerProcess:
    """A real `ocrq worker` in its own process, its log in a file the test can read."""

    def __init__(self, env: dict[str, str], log: Path, *args: str, bin_dir: Path = BIN) -> None:
        """`bin_dir`: the venv whose `ocrq` runs (.venv-vllm's for the vLLM engine)."""
        self.log = log
        self.env = env
        self._fh = log.open("w")
        self.proc = subprocess.Popen(
            [str(bin_dir / "ocrq"), "worker", *args],
            env=env,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 120) -> WorkerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}:\n{self.text()}")
            if " ready." in self.text():
                return self
            time.sleep(0.2)
        raise TimeoutError(f"worker not ready after {timeout} s:\n{self.text()}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60, send: bool = True) -> None:
        """`sig` to the whole group, then wait; `send=False`: it was sent already."""
        if self.proc.poll() is None:
            if send:
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # Stuck in a warm shutdown: Celery's SIGUSR1 handler writes every thread's
                # stack to the log first, so a failing test shows where it hung.
                os.killpg(self.proc.pid, signal.SIGUSR1)
                time.sleep(3)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._fh.close()


@pytest.fixture(scope="module")
def worker(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("worker") / "ocrq.worker.log"
    proc = WorkerProcess(service_env, log, "--concurrency", "8").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def text_images(image_root: Path) -> dict[str, Path]:
    """A few drawn images whose text is known, inside the allowed root."""
    specs = {
        "hello": ["HELLO WORLD"],
        "invoice": ["INVOICE 2026", "TOTAL 134.90"],
        "word": ["STATION"],
    }
    out = {}
    for name, lines in specs.items():
        path = image_root / f"{name}.png"
        draw_text_image(lines, margin=4 if len(lines) == 1 else 30).save(path)
        out[name] = path
    return out
