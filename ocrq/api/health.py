"""Liveness and readiness of the api, for load balancers and Kubernetes probes (no auth).

`/healthz` answers while the process serves requests and calls nothing behind it: a database
outage must not make an orchestrator restart every api replica. `/readyz` says whether a
request would succeed now: the broker answers, the database answers, and its schema is the
Alembic head this code was written for (an api on an older schema would 500 on every read).
It names what failed, never addresses or credentials.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from alembic.runtime.migration import MigrationContext
from celery import Celery
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import Engine, text
from starlette.concurrency import run_in_threadpool

from ocrq.core.migrate import head_revisions

PROBE_TIMEOUT_S = 2.0


@cache
def _head() -> tuple[str, ...]:
    return head_revisions()  # reads the migration scripts: once per process


def broker_check(app: Celery) -> str:
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(
                max_retries=1, interval_start=0, interval_step=0, timeout=PROBE_TIMEOUT_S
            )
    except Exception as exc:  # any failure is "not ready"; the type says enough
        return f"unreachable ({type(exc).__name__})"
    return "ok"


def database_checks(engine: Engine) -> dict[str, str]:
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
            current = tuple(sorted(MigrationContext.configure(conn).get_current_heads()))
    except Exception as exc:
        return {"database": f"unreachable ({type(exc).__name__})", "schema": "unknown"}
    head = _head()
    schema = (
        "ok"
        if current == head
        else (f"at {', '.join(current) or 'none'}, needs {', '.join(head)}: run `ocrq migrate`")
    )
    return {"database": "ok", "schema": schema}


def router(broker: Celery, engine: Any) -> APIRouter:
    """`engine` is a callable returning the SQLAlchemy engine (created on first use)."""
    api = APIRouter(tags=["health"])

    @api.get("/healthz")
    def healthz() -> dict[str, str]:
        """Liveness: the process answers; no auth, no backend calls."""
        return {"status": "ok"}

    @api.get("/readyz", responses={503: {"description": "a dependency is not ready"}})
    async def readyz() -> JSONResponse:
        """Readiness: Redis and PostgreSQL reachable, schema at the Alembic head."""
        checks = {"broker": await run_in_threadpool(broker_check, broker)}
        checks.update(await run_in_threadpool(database_checks, engine()))
        ready = all(v == "ok" for v in checks.values())
        return JSONResponse(
            {"status": "ready" if ready else "not ready", "checks": checks},
            status_code=200 if ready else 503,
        )

    return api
