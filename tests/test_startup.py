"""A worker's start-up (issue 29): its timeline, its engine started beside the rest, the running
loop's warm-up.

* The timeline (ocrq/core/startup.py): phases per lane, an engine's own account replacing the
  whole, the lines it logs read back as written.
* A real `ocrq worker` (tiny HunyuanOCR 1.5, the running loop in an engine process: a GPU
  worker's defaults, on the CPU): it logs its timeline once ready, each lane's phases add up to
  no more than the time to ready, its engine process started before the worker's own imports
  ended (the two ran side by side), and it logs its first stored result.
* The warm-up (ocrq/models/hunyuan/warm_up.py): a made-up row run through and every bucket's
  step run over empty slots leave later rows' tokens and logits as they would be without it,
  and the loop's books empty; a passed deadline stops it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from ocrq.core.startup import Phase, Timeline, parse, process_started
from tests.conftest import WorkerProcess
from tests.servers import free_port
from tests.test_service import _wait_rows

# -- the timeline ---------------------------------------------------------------------------------


def test_the_timeline_is_written_as_it_is_read() -> None:
    """Lanes from the recording thread, an outer phase dropped where inner ones were recorded,
    begin/end across threads, another process's phases in a lane of their own, and the log
    lines parsed back to the same figures."""
    import threading

    origin = time.time() - 5.0
    timeline = Timeline(origin)
    timeline.imported()
    with timeline.phase("engine load", unless_inner=True), timeline.phase("checkpoint read"):
        pass
    with timeline.phase("cost model", unless_inner=True):  # nothing inside: kept
        pass
    timeline.begin("celery start")
    ended = threading.Thread(target=lambda: timeline.end("celery start"))
    ended.start()
    ended.join()

    def in_lane() -> None:
        with timeline.lane("engine"), timeline.phase("torch import"):
            pass

    other = threading.Thread(target=in_lane)
    other.start()
    other.join()
    timeline.extend([Phase("worker", "imports", origin + 1.0, origin + 2.5)], lane="engine process")
    names = [(p.lane, p.name) for p in timeline.taken()]
    assert names == [
        ("worker", "imports"), ("worker", "checkpoint read"), ("worker", "cost model"),
        ("worker", "celery start"), ("engine", "torch import"), ("engine process", "imports"),
    ]
    text = "\n".join(["noise", *timeline.lines(), "startup: ready at 7.25 s (...)",
                      "startup: first result stored at 8.50 s, 1.25 s after ready"])
    got = parse(text)
    assert got["ready_at_s"] == 7.25 and got["first_result_at_s"] == 8.5
    by_name = {(p["lane"], p["name"]): p for p in got["phases"]}
    assert by_name[("worker", "imports")]["start"] == 0.0
    assert by_name[("worker", "imports")]["seconds"] == pytest.approx(5.0, abs=0.05)
    assert by_name[("engine process", "imports")] == {
        "lane": "engine process", "name": "imports", "seconds": 1.5, "start": 1.0, "end": 2.5,
    }


def test_a_process_start_is_when_the_kernel_started_it() -> None:
    """Its own start, not this module's import: a fresh interpreter's age is its own."""
    import subprocess
    import sys

    code = ("import time; t = time.time(); from ocrq.core.startup import process_started; "
            "print(t - process_started())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, cwd=Path(__file__).resolve().parents[1])
    age = float(out.stdout)
    assert 0.0 < age < 10.0  # the interpreter's own start-up, at 10 ms resolution
    assert process_started() <= time.time()


# -- a real worker --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ocrq.testing.tiny_hunyuan import TINY_SHAPES, build_checkpoint
    from tests.tiny_hunyuan import fake_hf_cache

    root = tmp_path_factory.mktemp("hf")
    return fake_hf_cache(root, lambda p, version: build_checkpoint(p, TINY_SHAPES[version]))


@pytest.fixture(scope="module")
def started_worker(
    service_env: dict[str, str], tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, float, str]]:
    """`ocrq worker` as a GPU runs it (the running loop in an engine process), its thread count
    from its batch cap (no --concurrency: it waits for its engine before Celery starts); with
    the seconds from its spawn to " ready." as this test saw them."""
    pytest.importorskip("torch")
    queue = f"ocr-startup-{uuid.uuid4().hex[:6]}"
    env = {
        **service_env,
        "OCRQ_ENGINE": "hunyuan",
        "OCRQ_QUEUE": queue,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tiny_cache),
        "OCRQ_DEVICE": "cpu",
        "OCRQ_DTYPE": "float32",
        "OCRQ_MAX_NEW_TOKENS": "4",
        "OCRQ_SCHEDULER": "continuous",
        "OCRQ_ENGINE_PROCESS": "on",
        "OCRQ_MAX_BATCH": "4",
        "OCRQ_MEMORY_BUDGET_GIB": "3.4",
        "OCRQ_PREFILL_TOKENS": "1024",
        "OCRQ_PREFILL_CHUNK_TOKENS": "1024",
        "OCRQ_PROFILE_DIR": str(tmp_path_factory.mktemp("profiles")),
        "OCRQ_METRICS_PORT": str(free_port()),
    }
    log = tmp_path_factory.mktemp("worker") / "ocrq.worker.log"
    spawned = time.time()
    proc = WorkerProcess(env, log).wait_ready(timeout=180)
    seen_ready = time.time() - spawned
    yield proc, seen_ready, queue
    proc.stop()


def lanes(phases: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for p in phases:
        out.setdefault(p["lane"], {})[p["name"]] = p
    return out


def test_a_worker_accounts_for_its_start(
    started_worker: tuple[WorkerProcess, float, str],
    broker_url: str,
    database_url: str,
    text_images: dict[str, Path],
) -> None:
    proc, seen_ready, queue = started_worker
    timeline = parse(proc.text())
    ready = timeline["ready_at_s"]
    assert ready is not None, proc.text()[-3000:]
    # Counted from the worker process's own start: after its supervisor's, before this test saw
    # " ready." (the log is polled every 0.2 s).
    assert 0 < ready <= seen_ready + 0.5
    by_lane = lanes(timeline["phases"])
    assert set(by_lane) == {"worker", "engine process"}, by_lane.keys()
    worker, engine = by_lane["worker"], by_lane["engine process"]
    for name in ("imports", "settings", "worker imports", "database check", "celery app",
                 "waiting for the engine", "heartbeat", "job runner", "celery start"):
        assert name in worker, name
    for name in ("imports", "torch import", "checkpoint read", "model to device",
                 "engine set-up", "cost model", "loop open", "warm-up"):
        assert name in engine, name
    # A lane's phases run one after another: together no longer than the time to ready, each
    # inside it.
    slack = 0.05  # two decimals per figure
    for lane, phases in by_lane.items():
        assert sum(p["seconds"] for p in phases.values()) <= ready + slack, lane
        for p in phases.values():
            assert -slack <= p["start"] <= p["end"] <= ready + slack, (lane, p)
    # The engine process started before the worker's own imports ended: side by side.
    assert engine["imports"]["start"] < worker["worker imports"]["end"]
    # The worker waited only for what was left of the engine's start once its own was done.
    assert worker["waiting for the engine"]["end"] >= engine["warm-up"]["end"] - slack
    assert timeline["first_result_at_s"] is None  # nothing stored yet

    job_id = str(uuid.uuid4())
    Celery(broker=broker_url).send_task(
        "ocrq.recognize", kwargs={"image": {"path": str(text_images["word"])},
                                  "job_id": job_id}, queue=queue, task_id=job_id)
    assert _wait_rows(database_url, [job_id], timeout=120)[job_id]["status"] == "done"
    deadline = time.monotonic() + 30
    while parse(proc.text())["first_result_at_s"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    first = parse(proc.text())["first_result_at_s"]
    assert first is not None and first > ready


# -- the running loop's warm-up ----------------------------------------------------------------


MAX_NEW = 12
TOLERANCE = 1e-3  # as tests/test_running_loop.py


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("torch")
    from ocrq.models.hunyuan import HunyuanLoopEngine
    from tests.tiny_hunyuan import cpu_settings, tiny_checkpoint

    path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "1.5")
    eng = HunyuanLoopEngine(cpu_settings(str(path), MAX_NEW, prefill_tokens=1024,
                                     prefill_chunk_tokens=1024), decode="fast")
    eng.load()
    return eng


def test_a_warmed_loop_makes_the_tokens_an_unwarmed_one_makes(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the warm-up captures each bucket's step after running it once over empty slots;
    here the step runs over them for every bucket (the capture recorded, not made). The rows
    that follow make the tokens and logits a fresh loop makes, and its books hold only them."""
    from ocrq.models.hunyuan import warm_up as warm
    from ocrq.models.hunyuan.loop_types import LoopRow
    from ocrq.models.hunyuan.running import RunningLoop
    from ocrq.models.slots import RunningBudget
    from tests.tiny_hunyuan import item

    def loop() -> RunningLoop:
        config = engine.loop_config(RunningBudget(20, 2048, 4096, 0, 0, 0, 0), keep_logits=True)
        return RunningLoop(engine._decoder, engine.tokens, config)

    items = [item(160, 150, 1), item(64, 64, 3), item(300, 40, 4)]

    def rows() -> list[LoopRow]:
        return [LoopRow(it.key, engine.preprocess(it), MAX_NEW) for it in items]

    unwarmed = loop()
    unwarmed.add(rows())
    fresh = {d.row.key: d for d in unwarmed.drain()}

    warmed = loop()
    captured: list[int] = []
    monkeypatch.setattr(warm, "graphed", lambda _: True)
    monkeypatch.setattr(warmed.runner, "capture", captured.append)
    made_up = LoopRow("warm", engine.preprocess(item(64, 64, 9)), 2)
    assert warmed.warm_up(made_up, time.monotonic() + 60) == []
    assert warmed.warm_up(None, time.monotonic() + 60) == []  # nothing graphed on a CPU
    assert captured == [8, 16, 20]  # every bucket of 20 slots, each once
    assert warmed.idle() and warmed.pool.free_tokens == 2048
    assert warmed.stats.steps == warmed.stats.prefills == warmed.stats.prefilled_rows == 0
    warmed.add(rows())
    done = {d.row.key: d for d in warmed.drain()}
    assert set(done) == set(fresh)
    for key, want in fresh.items():
        assert done[key].tokens == want.tokens, key
        assert float((done[key].logits - want.logits).abs().max()) < TOLERANCE, key
    assert warmed.stats.prefilled_rows == len(items)

    late = loop()
    captured.clear()
    monkeypatch.setattr(late.runner, "capture", captured.append)
    late.warm_up(None, time.monotonic() - 1)  # the deadline has passed: nothing
    assert captured == []
    late.add(rows()[:1])
    with pytest.raises(RuntimeError, match="before its first row"):
        late.warm_up(None, time.monotonic() + 60)


def test_the_engine_warms_its_loop_up_only_on_a_gpu(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU `warm_up` does nothing; where the engine is on a GPU (as far as `_cuda` says)
    a made-up row goes through its loop, a phase of the start-up timeline, and the loop is
    left idle with empty books."""
    from ocrq.core.process import STATE

    engine.open(int(0.4 * 2**30), engine.cost_model())
    loop = engine.loop
    engine.warm_up()
    assert loop.stats.prefills == 0 and not loop.runner.graphs
    before = len(STATE.timeline.taken())
    monkeypatch.setattr(engine, "_cuda", lambda: True)
    prefills: list[int] = []
    real_run = loop.runner.passes.run
    monkeypatch.setattr(loop.runner.passes, "run", lambda *a: (prefills.append(1), real_run(*a)))
    engine.warm_up()
    assert prefills == [1]  # the made-up row went through a prefill pass
    assert loop.idle() and loop.stats.prefills == 0 and loop.stats.steps == 0
    names = [p.name for p in STATE.timeline.taken()[before:]]
    assert names == ["warm-up: a row through the loop", "warm-up: decode graphs"]
