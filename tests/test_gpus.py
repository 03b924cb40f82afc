"""`ocrq worker --gpus`: one worker process per GPU, each on its own.

The selection and environment tests run in-process. The supervisor tests start the real
`ocrq worker --gpus 0,1` on this CPU machine with the rapid engine (which ignores
CUDA_VISIBLE_DEVICES) against real Redis and PostgreSQL: what is checked is what the supervisor
does with its children (their environments, names, restarts, recycles and stops), which is the
same with or without a GPU behind them. The one fake is `nvidia-smi` (no driver here).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery

from ocrq.api.client import Client
from ocrq.core import workers_table
from ocrq.core.db import get_engine
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from ocrq.worker import gpus
from ocrq.worker.gpus import Gpu, GpuSelectionError, label_of, select
from ocrq.worker.main import node_name
from ocrq.worker.supervisor import child_env, node_with_label, worker_children
from tests.conftest import BIN, FIGURES, WorkerProcess
from tests.servers import free_port
from tests.test_faults import make_images, report, wait_all

STARTED = re.compile(r"ocrq supervisor: (gpu\d+): started worker process pid (\d+)")
RECYCLED = re.compile(r"ocrq supervisor: (gpu\d+): worker recycled")

# Fast liveness, so the killed child's running jobs are re-sent by its sibling's sweep.
LIVENESS = {
    "OCRQ_HEARTBEAT_S": "1",
    "OCRQ_STALLED_AFTER_S": "5",
    "OCRQ_STALLED_SWEEP_S": "1",
    "OCRQ_VISIBILITY_TIMEOUT_S": "90",
    "OCRQ_MAX_BATCH": "4",
}


# --- which GPUs, and each child's environment --------------------------------------------


def fake_smi(folder: Path, body: str, code: int = 0) -> dict[str, str]:
    """A PATH whose `nvidia-smi` prints `body` (this machine has no NVIDIA driver)."""
    folder.mkdir(parents=True, exist_ok=True)
    smi = folder / "nvidia-smi"
    (folder / "out.txt").write_text(body + "\n")
    smi.write_text(f"#!/bin/sh\n/bin/cat '{folder}/out.txt'\nexit {code}\n")
    smi.chmod(0o755)
    return {"PATH": str(folder)}


def test_all_lists_whole_gpus_from_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpus, "PROC_GPUS", tmp_path / "no-proc")
    env = fake_smi(
        tmp_path / "bin",
        "GPU 0: NVIDIA H200 (UUID: GPU-0a1b2c3d-0000-1111-2222-333344445555)\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-9f8e7d6c-0000-1111-2222-333344445555)\n"
        "  MIG 1g.18gb     Device  0: (UUID: MIG-1234)",
    )
    assert select("all", env) == [Gpu("0", "gpu0"), Gpu("1", "gpu1")]
    broken = fake_smi(
        tmp_path / "broken",
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
        code=9,
    )
    with pytest.raises(GpuSelectionError, match="couldn't communicate with the NVIDIA driver"):
        select("all", broken)
    # Without nvidia-smi, the driver's /proc entries (one folder per GPU, by PCI bus id).
    proc = tmp_path / "proc-gpus"
    for bus in ("0000:18:00.0", "0000:2a:00.0", "0000:3b:00.0"):
        (proc / bus).mkdir(parents=True)
    monkeypatch.setattr(gpus, "PROC_GPUS", proc)
    assert [g.visible for g in select("all", {"PATH": str(tmp_path / "empty")})] == ["0", "1", "2"]


def test_gpus_are_read_within_cuda_visible_devices() -> None:
    assert select("0,1", {}) == [Gpu("0", "gpu0"), Gpu("1", "gpu1")]
    assert select("all", {"CUDA_VISIBLE_DEVICES": "2,3"}) == [Gpu("2", "gpu2"), Gpu("3", "gpu3")]
    # An index means the device at that position, as CUDA would read it.
    assert select("1", {"CUDA_VISIBLE_DEVICES": "2,3"}) == [Gpu("3", "gpu3")]
    with pytest.raises(GpuSelectionError, match="no index 2"):
        select("0,2", {"CUDA_VISIBLE_DEVICES": "5,6"})
    with pytest.raises(GpuSelectionError, match="empty"):
        select("all", {"CUDA_VISIBLE_DEVICES": ""})
    uuid_label = label_of("MIG-GPU-8f3c2b1a-1234/1/0")
    assert "/" not in uuid_label and uuid_label.startswith("mig-gpu-8f3c")
    assert Settings(gpus=" 0, 1 ").gpus == "0,1" and Settings(gpus="ALL").gpus == "all"


def test_each_child_gets_its_gpu_and_nothing_else_changes_without_gpus() -> None:
    base = {"PATH": "/bin", "OCRQ_GPUS": "all"}
    given = {"engine": "rapid", "gpus": "0,1", "concurrency": None}
    plain = child_env({"PATH": "/bin"}, {"engine": "rapid", "concurrency": None})
    assert plain == {"PATH": "/bin", "OCRQ_ENGINE": "rapid"}  # as before --gpus existed
    envs = [child_env(base, given, Gpu(d, f"gpu{d}")) for d in "01"]
    for i, env in enumerate(envs):
        assert env["CUDA_VISIBLE_DEVICES"] == str(i)
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # indices are nvidia-smi's
        assert env["OCRQ_DEVICE"] == "cuda:0"  # a missing GPU fails, never falls back to CPU
        assert "OCRQ_GPUS" not in env and env["OCRQ_ENGINE"] == "rapid"
    kept = child_env({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, {}, Gpu("1", "gpu1"))
    assert kept["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"
    with pytest.raises(GpuSelectionError, match="OCRQ_DEVICE=cpu"):
        child_env({"OCRQ_DEVICE": "cpu"}, {}, Gpu("0", "gpu0"))
    children = worker_children(["worker"], "ocrq-rapid-7@%h", base, given, select("0,1", {}))
    assert [c.argv for c in children] == [
        ("worker", "--hostname", "ocrq-rapid-7-gpu0@%h"),
        ("worker", "--hostname", "ocrq-rapid-7-gpu1@%h"),
    ]
    (one,) = worker_children(["worker"], "w@%h", {"PATH": "/bin"}, {})
    assert one.argv == ("worker", "--hostname", "w@%h") and one.env == {"PATH": "/bin"}
    assert node_with_label("mybox", "gpu3") == "mybox-gpu3"
    host = node_name(["worker", "--hostname", "ocrq-rapid-7-gpu1@%h"]) or ""
    assert host.startswith("ocrq-rapid-7-gpu1@") and "%h" not in host
    assert node_name(["worker"]) is None


# --- the real supervisor ----------------------------------------------------------------


def started(sup: WorkerProcess) -> dict[str, list[int]]:
    """Each GPU's worker pids, in the order the supervisor started them."""
    pids: dict[str, list[int]] = defaultdict(list)
    for label, pid in STARTED.findall(sup.text()):
        pids[label].append(int(pid))
    return dict(pids)


def wait_for(check: Callable[[], bool], timeout: float, sup: WorkerProcess, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout} s:\n{sup.text()[-4000:]}")
        if not sup.alive():
            raise RuntimeError(f"supervisor exited {sup.proc.returncode}:\n{sup.text()[-4000:]}")
        time.sleep(0.2)


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0


def gpu_of(worker_name: str) -> str:
    """`ocrq-rapid-7-gpu1@host/8-ab12cd` -> `gpu1`."""
    match = re.search(r"-(gpu\d+)@", worker_name)
    assert match, worker_name
    return match.group(1)


def two_free_ports() -> int:
    """A port whose next one is free too (each GPU's worker is served on its own)."""
    for _ in range(50):
        base = free_port()
        if free_port() == base + 1:  # taken from free_port's sequence, so it is not given again
            return base
    raise RuntimeError("no two consecutive free ports")


def served(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def jobs_done(port: int) -> float:
    _, body = served(port, "/metrics")
    found = re.findall(r'^ocrq_jobs_total\{[^}]*status="done"[^}]*\} (\S+)$', body, re.MULTILINE)
    return sum(float(v) for v in found)


def start_two(env: dict[str, str], log: Path, *args: str) -> WorkerProcess:
    sup = WorkerProcess(env, log, "--gpus", "0,1", "--concurrency", "4", *args)
    wait_for(lambda: sup.text().count(" ready.") >= 2, 180, sup, "two workers not ready")
    return sup


def test_two_gpu_workers_spread_jobs_restart_alone_and_stop_warm(
    service_env: dict[str, str], private_database: str, image_root: Path, tmp_path: Path
) -> None:
    queue = f"ocr-gpus-{uuid.uuid4().hex[:6]}"
    port = two_free_ports()
    database_url = private_database  # its sweeps would re-run rows other tests left queued
    env = {**service_env, **LIVENESS, "OCRQ_QUEUE": queue, "OCRQ_METRICS_PORT": str(port),
           "OCRQ_DATABASE_URL": database_url}
    settings = Settings(broker_url=env["OCRQ_BROKER_URL"], database_url=database_url, queue=queue)
    client = Client(settings)
    store = JobStore(get_engine(database_url))
    sup = start_two(env, tmp_path / "sup.log")
    rescuer: WorkerProcess | None = None
    try:
        first = started(sup)
        assert sorted(first) == ["gpu0", "gpu1"] and all(len(p) == 1 for p in first.values())
        # Distinct environments: each child sees its own GPU; the supervisor saw no CUDA.
        for label, (pid,) in first.items():
            child = environ(pid)
            assert child["CUDA_VISIBLE_DEVICES"] == label.removeprefix("gpu")
            assert child["OCRQ_DEVICE"] == "cuda:0" and "OCRQ_GPUS" not in child
        maps = Path(f"/proc/{sup.proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "libcuda" not in maps and "onnxruntime" not in maps
        # Distinct Celery nodes (what Flower shows) and heartbeat rows, the GPU in each name.
        app = Celery(broker=env["OCRQ_BROKER_URL"])
        nodes = {n for reply in app.control.ping(timeout=5) for n in reply}
        mine = sorted(gpu_of(n + "/") for n in nodes if f"-{sup.proc.pid}-gpu" in n)
        assert mine == ["gpu0", "gpu1"], nodes
        beating = [n for n in workers_table.heartbeats(store.engine) if f"-{sup.proc.pid}-" in n]
        assert sorted(gpu_of(n) for n in beating) == ["gpu0", "gpu1"]
        assert {int(n.split("/")[1].split("-")[0]) for n in beating} == {
            p for (p,) in first.values()
        }

        # Each GPU's worker has its own /readyz and /metrics, served by the supervisor.
        assert f"metrics on :{port + 1})" in sup.text()
        for p in (port, port + 1):
            wait_for(lambda p=p: served(p, "/readyz")[0] == 200, 60, sup, f"not ready on {p}")

        # Jobs go to both; kill -9 gpu1's worker mid-run: only it comes back.
        ids = [client.submit({"path": str(p)}) for p in make_images(image_root / "gpus", 60, 3)]

        def both_busy() -> bool:
            rows = store.get(ids).values()
            done = {gpu_of(r["worker"]) for r in rows if r["status"] == "done"}
            running = {gpu_of(r["worker"]) for r in rows if r["status"] == "running"}
            return done == {"gpu0", "gpu1"} and "gpu1" in running

        wait_for(both_busy, 180, sup, "jobs not spread over both workers")
        t0 = time.monotonic()
        os.kill(first["gpu1"][0], signal.SIGKILL)
        wait_for(lambda: len(started(sup).get("gpu1", [])) == 2, 60, sup, "gpu1 not restarted")
        try:
            rows = wait_all(store, ids, timeout=180)
        except TimeoutError:  # a message popped but not yet marked unacked died with it
            FIGURES.append(f"[gpus kill-9] re-sent by ocrq requeue: {len(client.requeue(30))}")
            rows = wait_all(store, ids, timeout=120)
        figures = report("gpus kill-9", ids, rows, store, time.monotonic() - t0)
        assert figures["done"] == 60 and figures["lost"] == 0 and figures["duplicated"] == 0
        after = started(sup)
        assert after["gpu0"] == first["gpu0"] and alive(first["gpu0"][0])  # untouched
        assert after["gpu1"][0] == first["gpu1"][0] and alive(after["gpu1"][1])
        assert "gpu1: worker exited with -9; restarting" in sup.text()
        by_gpu = defaultdict(set)
        for row in rows.values():
            by_gpu[gpu_of(row["worker"])].add(row["worker"])
        assert set(by_gpu) == {"gpu0", "gpu1"}, by_gpu  # rows say which worker and GPU ran them
        gpu0_rows = sum(gpu_of(r["worker"]) == "gpu0" for r in rows.values())
        assert jobs_done(port) == gpu0_rows and jobs_done(port + 1) > 0  # figures kept apart

        # SIGTERM to the supervisor alone, jobs in flight: it stops both children warm.
        more = [client.submit({"path": str(p)}) for p in make_images(image_root / "more", 80, 3)]
        wait_for(
            lambda: sum(r["status"] == "done" for r in store.get(more).values()) >= 8,
            180,
            sup,
            "second round not started",
        )
        stop_at = time.monotonic()
        os.kill(sup.proc.pid, signal.SIGTERM)
        assert sup.proc.wait(120) == 0, sup.text()[-4000:]
        live = [first["gpu0"][0], after["gpu1"][1]]
        assert not [pid for pid in live if alive(pid)]
        assert sup.text().count("Warm shutdown") >= 2, sup.text()[-4000:]
        statuses = [r["status"] for r in store.get(more).values()]
        assert "running" not in statuses  # jobs in flight were finished and stored
        stopped_with = statuses.count("done")
        assert stopped_with < len(more)  # the stop came mid-run
        # The rest were handed back to the queue: a plain worker finishes them, each once.
        rescuer = WorkerProcess(env, tmp_path / "rescuer.log", "--concurrency", "4").wait_ready()
        rows = wait_all(store, more, timeout=300)
    finally:
        sup.stop()
        if rescuer is not None:
            rescuer.stop()
    figures = report("gpus sigterm", more, rows, store, time.monotonic() - stop_at)
    FIGURES.append(f"[gpus sigterm] done before the stop: {stopped_with} of {len(more)}")
    assert figures["done"] == 80 and figures["lost"] == 0 and figures["duplicated"] == 0
    assert figures["rerun"] == 0  # a warm stop abandons no job


def test_two_gpu_workers_recycle_independently(
    service_env: dict[str, str], private_database: str, image_root: Path, tmp_path: Path
) -> None:
    queue = f"ocr-gpus-recycle-{uuid.uuid4().hex[:6]}"
    database_url = private_database  # its sweeps would re-run rows other tests left queued
    env = {**service_env, **LIVENESS, "OCRQ_QUEUE": queue, "OCRQ_DATABASE_URL": database_url}
    client = Client(
        Settings(
            broker_url=env["OCRQ_BROKER_URL"], database_url=env["OCRQ_DATABASE_URL"], queue=queue
        )
    )
    store = JobStore(get_engine(database_url))
    sup = start_two(env, tmp_path / "sup.log", "--max-images", "12")
    try:
        t0 = time.monotonic()
        ids = [client.submit({"path": str(p)}) for p in make_images(image_root / "rc", 100)]
        rows = wait_all(store, ids, timeout=600)
        seconds = time.monotonic() - t0
    finally:
        sup.stop()
    text = sup.text()
    recycles: dict[str, int] = defaultdict(int)
    for label in RECYCLED.findall(text):
        recycles[label] += 1
    figures = report("gpus recycle", ids, rows, store, seconds, sum(recycles.values()))
    assert figures["done"] == 100 and figures["lost"] == 0 and figures["duplicated"] == 0
    pids = started(sup)
    assert recycles["gpu0"] >= 1 and recycles["gpu1"] >= 1, text[-4000:]
    for label in ("gpu0", "gpu1"):  # each restarted once per recycle of its own
        assert len(set(pids[label])) == recycles[label] + 1
    names = {row["worker"] for row in rows.values()}
    for label in ("gpu0", "gpu1"):  # one worker name per process, its GPU in it
        assert len({n for n in names if gpu_of(n) == label}) >= 2


def test_every_child_refusing_to_start_stops_the_supervisor_with_78(
    service_env: dict[str, str],
) -> None:
    """A configuration error common to all GPUs (here no OCRQ_ALLOWED_ROOTS) stops each child
    once, and the supervisor exits 78 instead of restarting them."""
    env = {k: v for k, v in service_env.items() if k != "OCRQ_ALLOW_ANY_PATH"}
    proc = subprocess.run(
        [str(BIN / "ocrq"), "worker", "--gpus", "0,1"],
        env={**env, "OCRQ_ALLOWED_ROOTS": "", "OCRQ_QUEUE": f"ocr-none-{uuid.uuid4().hex[:6]}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert sorted(label for label, _ in STARTED.findall(proc.stderr)) == ["gpu0", "gpu1"]
    assert "OCRQ_ALLOWED_ROOTS is not set" in proc.stderr
    for label in ("gpu0", "gpu1"):
        assert f"{label}: worker cannot start (see above); not restarting it" in proc.stderr


def test_one_child_refusing_to_start_leaves_the_other_running(
    service_env: dict[str, str], private_database: str, image_root: Path, tmp_path: Path
) -> None:
    """A GPU that cannot be used (no such device, a driver fault) fails its worker at start-up
    with 78. Here no GPU exists, so a sitecustomize makes the interpreter started with
    CUDA_VISIBLE_DEVICES=1 exit as such a worker does (the one fake of this file; the real
    78 path of every child is the test above). gpu1 is not restarted, gpu0 goes on taking
    jobs, and the supervisor, stopped later, says with 78 that a worker could not start."""
    broken = tmp_path / "broken-gpu1"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if os.environ.get('CUDA_VISIBLE_DEVICES') == '1':\n"
        "    print('worker cannot start: RuntimeError: OCRQ_DEVICE=cuda:0 but torch sees no "
        "CUDA device', file=sys.stderr, flush=True)\n"
        "    os._exit(78)\n"
    )
    queue = f"ocr-gpus-half-{uuid.uuid4().hex[:6]}"
    path = os.pathsep.join(p for p in (str(broken), service_env.get("PYTHONPATH")) if p)
    database_url = private_database  # its sweeps would re-run rows other tests left queued
    env = {**service_env, **LIVENESS, "OCRQ_QUEUE": queue, "PYTHONPATH": path,
           "OCRQ_DATABASE_URL": database_url}
    client = Client(
        Settings(broker_url=env["OCRQ_BROKER_URL"], database_url=database_url, queue=queue)
    )
    store = JobStore(get_engine(database_url))
    sup = WorkerProcess(env, tmp_path / "sup.log", "--gpus", "0,1", "--concurrency", "4")
    try:
        wait_for(lambda: " ready." in sup.text(), 180, sup, "gpu0 not ready")
        wait_for(
            lambda: (
                "gpu1: worker cannot start (see above); not restarting it (the other 1 go on)"
                in sup.text()
            ),
            60,
            sup,
            "gpu1 did not give up",
        )
        ids = [client.submit({"path": str(p)}) for p in make_images(image_root / "half", 6)]
        rows = wait_all(store, ids, timeout=180)
        assert {gpu_of(r["worker"]) for r in rows.values()} == {"gpu0"}
        assert all(r["status"] == "done" for r in rows.values())
        assert sorted(label for label, _ in STARTED.findall(sup.text())) == ["gpu0", "gpu1"]
        os.kill(sup.proc.pid, signal.SIGTERM)
        assert sup.proc.wait(120) == 78, sup.text()[-4000:]
    finally:
        sup.stop()


def test_gpus_all_without_a_gpu_fails_clearly(service_env: dict[str, str]) -> None:
    if gpus.PROC_GPUS.exists():
        pytest.skip("this host has NVIDIA GPUs: test_all_lists_whole_gpus covers discovery")
    env = {k: v for k, v in service_env.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = subprocess.run(
        [str(BIN / "ocrq"), "worker", "--gpus", "all"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 78
    assert "no NVIDIA GPU found on this host" in proc.stderr, proc.stderr
    assert "started worker process" not in proc.stderr
    bad = subprocess.run(
        [str(BIN / "ocrq"), "worker", "--gpus", "0,1", "--no-supervise"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 78 and "needs the supervisor" in bad.stderr, bad.stderr
