"""`ocrq worker` and `ocrq health`: starting a worker (supervised or not, on which GPUs) and
probing one."""

from __future__ import annotations

import os
from typing import Annotated

import typer
from rich.markup import escape

from ocrq.cli.app import (
    ENGINE_HELP,
    ConfigProblem,
    app,
    err,
    load_settings,
)
from ocrq.core.process import STATE
from ocrq.core.settings import Settings


def worker_queues(settings: Settings) -> str:
    """`--queues`: the configured queue, and Celery's default one where a producer's
    `send_task` without `queue=` lands (OCRQ_CONSUME_DEFAULT_QUEUE)."""
    from ocrq.worker.queue_depth import consumed_queues

    return ",".join(consumed_queues(settings))


@app.command()
def worker(
    engine: Annotated[str | None, typer.Option(help=ENGINE_HELP)] = None,
    concurrency: Annotated[
        int | None, typer.Option(help="Task threads: images fetched + waiting for the batcher.")
    ] = None,
    queue: Annotated[str | None, typer.Option(help="Queue to consume.")] = None,
    max_images: Annotated[
        int | None,
        typer.Option(
            help="Recycle the worker process after at least this many images (the jobs in "
            "flight finish first)."
        ),
    ] = None,
    hostname: Annotated[str | None, typer.Option(help="Celery node name.")] = None,
    gpus: Annotated[
        str | None,
        typer.Option(
            help="all | 0,1,...: one worker process per GPU (nvidia-smi's indices), each "
            "restarted on its own; off: one worker process, CUDA_VISIBLE_DEVICES as it is."
        ),
    ] = None,
    supervise: Annotated[
        bool,
        typer.Option(
            help="Restart the worker process after a recycle or crash (bare metal); "
            "--no-supervise under Docker/systemd/Kubernetes, which restart it."
        ),
    ] = True,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
) -> None:
    """Consume OCR jobs from the broker, batch them through the engine, store rows."""
    from ocrq.core.problems import infrastructure_problem
    from ocrq.worker.exit_state import STARTUP_FAILED_EXIT_CODE
    from ocrq.worker.gpus import GpuSelectionError, select
    from ocrq.worker.main import announce, log_to_stderr
    from ocrq.worker.main import run as run_worker
    from ocrq.worker.supervisor import supervise as run_supervised
    from ocrq.worker.supervisor import worker_children

    # With --no-supervise this process is the worker: the first phases of its start-up timeline
    # (ocrq/core/startup.py; ocrq/worker/main.py times the rest).
    STATE.timeline.imported()
    given = {
        "engine": engine,
        "queue": queue,
        "max_images": max_images,
        "concurrency": concurrency,
        "gpus": gpus,
    }
    try:
        with STATE.timeline.phase("settings"):
            settings = load_settings(**given)  # checked here, before any process starts
    except (ValueError, ConfigProblem) as exc:
        # One line naming the variable, as every other command says it (pydantic's own text
        # names the field, `max_images`, over several lines); 78 kept, the worker's own code.
        problem = infrastructure_problem(exc)
        said = problem.message if problem else f"invalid settings: {exc}"
        err.print(f"[red]ocrq worker:[/] {escape(said)}", soft_wrap=True, highlight=False)
        raise typer.Exit(STARTUP_FAILED_EXIT_CODE) from None
    argv = [
        "worker",
        "--pool",
        "threads",
        "--queues",
        worker_queues(settings),
        "--loglevel",
        loglevel,
        "--task-events",
        "--without-gossip",
        "--without-mingle",
    ]
    if settings.concurrency is not None:  # else the worker follows its batch cap (main.py)
        argv += ["--concurrency", str(settings.concurrency)]
    # Stable across recycles, so Flower shows one worker going offline and online.
    node = hostname or f"ocrq-{settings.engine}-{os.getpid()}@%h"
    log_to_stderr()  # the worker's own lines, or the supervisor's (where it serves metrics)
    announce(settings)
    if not supervise:
        if settings.gpus:
            err.print(
                "[red]ocrq worker: --gpus/OCRQ_GPUS starts one process per GPU and needs the "
                "supervisor; under systemd or Kubernetes run one --no-supervise worker per GPU "
                "with CUDA_VISIBLE_DEVICES set",
                soft_wrap=True,
            )
            raise typer.Exit(STARTUP_FAILED_EXIT_CODE)
        raise typer.Exit(run_worker([*argv, "--hostname", node], settings))
    # A child interpreter per worker process (per GPU with --gpus), its options in its
    # environment. GPUs are found without CUDA: this process never initialises it.
    try:
        found = select(settings.gpus) if settings.gpus else []
        children = worker_children(argv, node, os.environ, given, found)
        last = (settings.metrics_port or 0) + len(children) - 1
        if settings.metrics_port is not None and last > 65_535:
            raise GpuSelectionError(
                f"OCRQ_METRICS_PORT={settings.metrics_port}: each GPU's worker is served on the "
                f"next port, and {len(children)} need ports up to {last} (> 65535)"
            )
    except GpuSelectionError as exc:
        err.print(f"[red]ocrq worker:[/] {exc}", soft_wrap=True)
        raise typer.Exit(STARTUP_FAILED_EXIT_CODE) from None
    raise typer.Exit(run_supervised(children, settings))


@app.command()
def health(
    live: Annotated[
        bool, typer.Option("--live", help="Liveness (/healthz) instead of readiness (/readyz).")
    ] = False,
    url: Annotated[
        str | None,
        typer.Option(help="Worker monitor base URL; default http://127.0.0.1:OCRQ_METRICS_PORT."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the answer.")] = 5.0,
) -> None:
    """Probe a worker: exit 0 when ready (or live, with --live), 1 when not, 2 if unreachable.

    For Docker HEALTHCHECK and exec probes, where no curl is installed."""
    import httpx

    if url is None:
        port = load_settings().metrics_port
        if port is None:
            err.print("OCRQ_METRICS_PORT is not set: the worker serves no health endpoints")
            raise typer.Exit(2)
        url = f"http://127.0.0.1:{port}"
    path = "/healthz" if live else "/readyz"
    try:
        answer = httpx.get(url.rstrip("/") + path, timeout=timeout)
    except httpx.HTTPError as exc:
        err.print(f"{url}{path}: {type(exc).__name__}: {exc}")
        raise typer.Exit(2) from None
    typer.echo(answer.text.strip())
    raise typer.Exit(0 if answer.status_code == 200 else 1)

