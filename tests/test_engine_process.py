"""A worker whose engine runs in a process of its own (OCRQ_ENGINE_PROCESS=on): real `ocrq
worker` supervisors, Redis, PostgreSQL and the CPU engine in its engine process.

What must hold: the jobs run there and their results are stored by the worker; the engine's
libraries are loaded there and not in the worker; what the batcher counts reaches the worker's
metrics once (not twice, not never); an error raised there fails its job alone with its own
type; a group SIGTERM stops both warmly; and the engine process dying takes its worker with it,
so the supervisor starts a fresh pair and every job is still done exactly once.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
from celery import Celery

from ocrq.api.client import Client
from ocrq.core.db import get_engine
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from tests.conftest import WorkerProcess
from tests.servers import free_port
from tests.test_faults import (
    child_pids,
    done_mid_run,
    make_images,
    report,
    wait_all,
    worker_env,
)
from tests.test_service import _wait_rows
from tests.waiting import Budget

ENGINE_HOST = "ocrq.engine_process.host"


def engine_pids(worker_pid: int) -> list[int]:
    """Processes running the engine host whose parent is `worker_pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ENGINE_HOST in cmdline and ppid == worker_pid:
            found.append(int(entry.name))
    return found


def maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def metric_values(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ocrq_") and " " in line
    }


def test_jobs_run_in_the_engine_process(
    service_env: dict[str, str],
    broker_url: str,
    database_url: str,
    text_images: dict[str, Path],
    tmp_path: Path,
) -> None:
    queue = f"ocr-engproc-{uuid.uuid4().hex[:6]}"
    port = free_port()
    env = worker_env(service_env, engine_process="on", queue=queue, metrics_port=str(port))
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "8").wait_ready(180)
    try:
        assert "in its own process" in worker.text()
        worker_pid = child_pids(worker)[-1]
        hosts = engine_pids(worker_pid)
        assert len(hosts) == 1, worker.text()[-2000:]
        # The CPU engine's runtime is mapped where the engine runs, and only there.
        assert "onnxruntime" in maps(hosts[0])
        assert "onnxruntime" not in maps(worker_pid)

        app = Celery(broker=broker_url)
        paths = list(text_images.values())
        images = []
        for i in range(9):
            job_id = str(uuid.uuid4())
            image = {"path": str(paths[i % len(paths)])}
            app.send_task("ocrq.recognize", kwargs={"image": image, "job_id": job_id},
                          queue=queue, task_id=job_id)
            images.append(job_id)
        # A free prompt, which the CPU engine refuses: the error is raised in the engine
        # process and must fail this job alone, its type intact.
        custom = str(uuid.uuid4())
        app.send_task(
            "ocrq.recognize",
            kwargs={"image": {"path": str(paths[0])}, "job_id": custom, "task": "custom",
                    "prompt": "read it"},
            queue=queue, task_id=custom,
        )
        rows = _wait_rows(database_url, [*images, custom], timeout=180)
        assert all(rows[j]["status"] == "done" and rows[j]["text"] for j in images), rows
        assert rows[custom]["status"] == "failed"
        assert rows[custom]["error"].startswith("UnsupportedTask:"), rows[custom]["error"]
        hello = [rows[j] for i, j in enumerate(images) if paths[i % len(paths)].stem == "hello"]
        assert any("HELLO" in r["text"].upper() for r in hello), hello

        # What the batcher counted there reaches this worker's metrics exactly once per image
        # (the supervisor serves its children's registries: a second copy would double them).
        values = metric_values(port)
        assert values['ocrq_stage_seconds_count{stage="preprocess"}'] == len(images) + 1
        assert values['ocrq_stage_seconds_count{stage="gpu"}'] == len(images) + 1
        # Every image the batcher ran (the refused one too) is in a batch record sent from there.
        assert values["ocrq_batch_images_sum"] == len(images) + 1
        assert values["ocrq_batches_total"] == values["ocrq_batch_images_count"] >= 1
    finally:
        worker.stop()  # SIGTERM to the whole group, the engine process included
    assert worker.proc.returncode == 0, worker.text()[-3000:]
    assert "engine process" in worker.text() and "died" not in worker.text()
    assert engine_pids(worker_pid) == []


def test_engine_process_death_loses_nothing(
    service_env: dict[str, str],
    database_url: str,
    broker_url: str,
    image_root: Path,
    tmp_path: Path,
) -> None:
    paths = make_images(image_root / "engine-kill", 60, lines=6)
    store = JobStore(get_engine(database_url))
    queue = f"ocr-engkill-{uuid.uuid4().hex[:6]}"
    env = worker_env(
        service_env, engine_process="on", visibility_timeout_s="20", max_batch="8", queue=queue
    )
    # Waits: ready 90 + mid-run 90 + all final (120, then after a requeue the rest) in 480 s,
    # under pytest's 600 s (tests/waiting.py).
    budget = Budget(480, "engine-kill-9")
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "16").wait_ready(90)
    t0 = time.monotonic()
    try:
        settings = Settings(broker_url=broker_url, database_url=database_url, queue=queue)
        client = Client(settings)
        ids = [client.submit({"path": str(p)}) for p in paths]
        before = done_mid_run(store, ids, budget)
        first = child_pids(worker)[-1]
        (victim,) = engine_pids(first)
        os.kill(victim, signal.SIGKILL)
        try:
            rows = wait_all(store, ids, timeout=120, budget=budget, log=worker)
        except TimeoutError:
            client.requeue(30)
            rows = wait_all(store, ids, timeout=budget.left(), budget=budget, log=worker)
        seconds = time.monotonic() - t0
    finally:
        worker.stop()
    text = worker.text()
    figures = report("engine-kill-9", ids, rows, store, seconds)
    # The worker left with the engine process, and the supervisor started another pair.
    assert re.search(r"engine process \(pid \d+\) died", text), text[-3000:]
    assert "worker exited with 70" in text, text[-3000:]
    assert len(set(child_pids(worker))) >= 2
    assert figures["done"] == len(ids) and figures["lost"] == 0 and figures["duplicated"] == 0
    for job_id, (done_text, finished) in before.items():  # no done result regressed
        assert (rows[job_id]["text"], rows[job_id]["finished_at"]) == (done_text, finished)


def test_engine_process_is_the_default_for_hunyuan_on_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset, OCRQ_ENGINE_PROCESS follows the engine and the host's GPUs (found as `--gpus all`
    finds them: nvidia-smi is the one fake, this machine has no driver); set, it is obeyed."""
    from ocrq.worker import gpus
    from ocrq.worker.runtime import engine_in_own_process
    from tests.test_gpus import fake_smi

    monkeypatch.setattr(gpus, "PROC_GPUS", tmp_path / "no-proc")
    smi = fake_smi(tmp_path / "bin", "GPU 0: NVIDIA H200 (UUID: GPU-0a1b2c3d)")
    monkeypatch.setenv("PATH", smi["PATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engine_in_own_process(Settings(engine="hunyuan"))
    assert not engine_in_own_process(Settings(engine="hunyuan", device="cpu"))
    assert not engine_in_own_process(Settings(engine="rapid"))
    assert not engine_in_own_process(Settings(engine="hunyuan", engine_process="off"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # every GPU hidden
    assert not engine_in_own_process(Settings(engine="hunyuan"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no driver at all
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert not engine_in_own_process(Settings(engine="hunyuan"))
    assert engine_in_own_process(Settings(engine="rapid", engine_process="on"))


def test_readings_leave_the_device_alone_unless_a_recycler_watches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine process reads its figures after every round of the running loop. HunyuanOCR's
    fragmentation reading empties the CUDA cache, a device sync: taken every round, it made the
    engine process no faster than the worker on the H200 (runs 8-9). It is read only when
    OCRQ_MAX_FRAGMENTATION_GIB asks for it."""
    from multiprocessing import Pipe

    from ocrq.engine_process.host import EngineHost

    for limit, reads in ((None, 0), (4.0, 1)):
        ours, theirs = Pipe()
        host = EngineHost(Settings(engine="rapid", max_fragmentation_gib=limit), theirs)
        calls: list[int] = []
        monkeypatch.setattr(host.memory, "fragmentation_bytes", lambda c=calls: c.append(1) or 7)
        try:
            readings = host.readings()
            host.readings()  # the next round, at once: no second reading within 5 s
        finally:
            host.batcher.stop()
            host.engine.close()
            ours.close()
            theirs.close()
        assert len(calls) == reads
        assert readings.fragmentation == (7 if reads else None)
        assert readings.rss > 0


def test_a_dead_engine_process_fails_no_row_before_the_worker_exits(
    text_images: dict[str, Path],
) -> None:
    """The link's own reader sees the engine process die. It must call `on_lost` (the worker
    exits there) before it fails a single waiting row: a task thread woken by that failure would
    store it and ack the message, losing a job that Redis should deliver again."""
    from PIL import Image

    from ocrq.engine_process.link import EngineLink
    from ocrq.models.base import PreparedImage

    at_loss: list[list[bool]] = []
    futures: list = []
    link = EngineLink.start(
        Settings(engine="rapid"), on_lost=lambda: at_loss.append([f.done() for f in futures])
    )
    image = Image.open(text_images["invoice"]).convert("RGB").resize((2400, 1600))
    for i in range(16):
        item = PreparedImage(key=f"row-{i}", image=image, original_size=image.size)
        futures.append(link.submit(item))
    os.kill(link.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not all(f.done() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(at_loss) == 1
    assert not all(at_loss[0]), "every row had finished before the kill: nothing tested"
    failed = [f for f in futures if f.exception() is not None]
    assert failed and all(not at_loss[0][futures.index(f)] for f in failed)
    link.stop()
    assert link.proc.poll() is not None


def test_an_engine_that_cannot_load_fails_the_start_with_its_reason(tmp_path: Path) -> None:
    """A missing model is a start-up failure (the worker exits 78, not restarted): the engine
    process's error reaches the worker whole, and the process is gone."""
    from ocrq.engine_process.link import EngineLink, EngineStartError

    missing = tmp_path / "no-such-model"
    settings = Settings(engine="hunyuan", model=str(missing), device="cpu")
    with pytest.raises(EngineStartError, match="no-such-model"):
        EngineLink.start(settings)
    assert engine_pids(os.getpid()) == []


def test_a_frozen_engine_process_shows_in_the_liveness_gauge(
    service_env: dict[str, str], image_root: Path, database_url: str, tmp_path: Path
) -> None:
    """`/healthz` fails when the engine's progress gauge grows older than a job may take. With
    the engine in its own process, the worker keeps that gauge from what comes back: frozen
    (SIGSTOP) with rows in it, the gauge stops moving; thawed, the rows finish and it clears."""
    paths = make_images(image_root / "engine-freeze", 24, lines=6)
    store = JobStore(get_engine(database_url))
    queue = f"ocr-engfreeze-{uuid.uuid4().hex[:6]}"
    port = free_port()
    env = worker_env(
        service_env, engine_process="on", max_batch="4", queue=queue, metrics_port=str(port)
    )
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "8").wait_ready(180)
    since = "ocrq_batch_running_since_timestamp_seconds"
    try:
        settings = Settings(broker_url=service_env["OCRQ_BROKER_URL"], database_url=database_url,
                            queue=queue)
        ids = [Client(settings).submit({"path": str(p)}) for p in paths]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(r["status"] == "done" for r in store.get(ids).values()):
                break
            time.sleep(0.05)
        (host,) = engine_pids(child_pids(worker)[-1])
        os.kill(host, signal.SIGSTOP)
        frozen_at = time.time()
        try:
            time.sleep(2)
            first = metric_values(port)[since]
            time.sleep(3)
            second = metric_values(port)[since]
        finally:
            os.kill(host, signal.SIGCONT)
        rows = wait_all(store, ids, timeout=180)
        deadline = time.monotonic() + 30
        while metric_values(port)[since] and time.monotonic() < deadline:
            time.sleep(0.2)
        after = metric_values(port)[since]
    finally:
        worker.stop()
    assert 0 < first == second <= frozen_at + 1, (first, second, frozen_at)
    assert all(r["status"] == "done" for r in rows.values())
    assert after == 0


class _NeedsArgs(Exception):
    """Pickles, but does not unpickle: its __init__ wants two arguments."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def test_an_error_that_would_not_unpickle_arrives_by_name() -> None:
    """An engine's own exception class may not survive the pipe (required arguments): it would
    break the worker's reader thread. It arrives as its type's name and message instead."""
    from multiprocessing import Pipe

    from ocrq.engine_process import wire
    from ocrq.engine_process.host import EngineHost
    from ocrq.scheduling.vocabulary import ItemOutcome

    ours, theirs = Pipe()
    host = EngineHost(Settings(engine="rapid"), theirs)
    try:
        host._done(7, ItemOutcome(None, _NeedsArgs("page 3", "unreadable"), "", "rapid"), 0.1)
        host._done(8, ItemOutcome(None, ValueError("plain"), "", "rapid"), 0.1)
        first, second = ours.recv(), ours.recv()
    finally:
        host.batcher.stop()
        host.engine.close()
        ours.close()
        theirs.close()
    assert isinstance(first, wire.Done) and first.seq == 7
    assert type(first.outcome.error) is RuntimeError
    assert str(first.outcome.error) == "_NeedsArgs: page 3: unreadable"
    assert type(second.outcome.error) is ValueError  # one that travels keeps its type
