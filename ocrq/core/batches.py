"""A producer's batch (`ocr_jobs.batch`), summed up: what `GET /batches/{id}` and `ocrq wait`
report.

Counted from the rows, in one grouped query over the batch's index: never from counters, which
redelivered messages would make drift. A batch's units of work are its images and its
documents' pages; a document not split yet (or refused whole) counts as one unit, since its
pages are not known until its own job has run.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, case, func, select

from ocrq.core.db import ocr_documents, ocr_jobs

# Final units: cancelled and expired ones too, so a batch cancelled (DELETE /batches) ends.
JOB_FINAL = ("done", "failed", "cancelled", "expired")


def _aware(value: dt.datetime | None) -> dt.datetime | None:
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value


@dataclass
class BatchSummary:
    batch: str
    images: dict[str, int] = field(default_factory=dict)  # image jobs by status
    pages: dict[str, int] = field(default_factory=dict)  # documents' page jobs by status
    splits: dict[str, int] = field(default_factory=dict)  # documents' own jobs by status
    documents: dict[str, int] = field(default_factory=dict)  # ocr_documents rows by status
    created_at: dt.datetime | None = None
    started_at: dt.datetime | None = None
    first_finished_at: dt.datetime | None = None
    last_finished_at: dt.datetime | None = None

    @property
    def jobs(self) -> dict[str, int]:
        """Units of work by status: images and pages, and documents not split into pages."""
        out: dict[str, int] = {}
        for counts in (self.images, self.pages, self._unsplit):
            for status, n in counts.items():
                out[status] = out.get(status, 0) + n
        return out

    @property
    def _unsplit(self) -> dict[str, int]:
        """A document's own job that is done has become its pages; any other is one unit."""
        return {s: n for s, n in self.splits.items() if s != "done"}

    @property
    def total(self) -> int:
        return sum(self.jobs.values())

    @property
    def finished(self) -> int:
        return sum(n for s, n in self.jobs.items() if s in JOB_FINAL)

    @property
    def final(self) -> bool:
        """Every unit final, and no document still waiting to be assembled."""
        return self.finished == self.total and not self.documents.get("running", 0)

    @property
    def rate_per_s(self) -> float | None:
        """Units finished per second since the batch's first unit started: the batch's own
        measured rate (None until one has finished after a measurable time)."""
        if not self.finished or self.started_at is None or self.last_finished_at is None:
            return None
        span = (self.last_finished_at - self.started_at).total_seconds()
        return self.finished / span if span > 0 else None

    @property
    def eta_s(self) -> float | None:
        """Seconds until the units left are final, at the measured rate; 0 once final."""
        left = self.total - self.finished
        if not left:
            return 0.0
        rate = self.rate_per_s
        return None if rate is None else left / rate

    def as_json(self) -> dict[str, Any]:
        rate = self.rate_per_s
        eta = self.eta_s
        return {
            "batch": self.batch,
            "final": self.final,
            "total": self.total,
            "finished": self.finished,
            "jobs": self.jobs,
            "images": self.images,
            "pages": self.pages,
            "documents": {
                **self.documents,
                # documents whose own job has not split them yet (or failed before it could)
                **({"unsplit": sum(self._unsplit.values())} if self._unsplit else {}),
            },
            "created_at": _iso(self.created_at),
            "started_at": _iso(self.started_at),
            "first_finished_at": _iso(self.first_finished_at),
            "last_finished_at": _iso(self.last_finished_at),
            "rate_per_s": None if rate is None else round(rate, 4),
            "eta_s": None if eta is None else round(eta, 1),
        }


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def summary(engine: Engine, batch: str) -> BatchSummary | None:
    """The batch's counts and times; None when no row names the batch."""
    kind = case(
        (ocr_jobs.c.page.is_not(None), "page"),
        (ocr_jobs.c.document_id == ocr_jobs.c.id, "split"),
        else_="image",
    ).label("kind")
    unit = ocr_jobs.c.page.is_not(None) | (ocr_jobs.c.document_id.is_distinct_from(ocr_jobs.c.id))
    grouped = (
        select(
            kind,
            ocr_jobs.c.status,
            func.count(),
            func.min(ocr_jobs.c.created_at),
            func.min(case((unit, ocr_jobs.c.started_at))),
            func.min(case((unit, ocr_jobs.c.finished_at))),
            func.max(case((unit, ocr_jobs.c.finished_at))),
        )
        .where(ocr_jobs.c.batch == batch)
        .group_by(kind, ocr_jobs.c.status)
    )
    splits = select(ocr_jobs.c.id).where(
        ocr_jobs.c.batch == batch,
        ocr_jobs.c.document_id == ocr_jobs.c.id,
        ocr_jobs.c.page.is_(None),
    )
    documents = (
        select(ocr_documents.c.status, func.count())
        .where(ocr_documents.c.id.in_(splits.scalar_subquery()))
        .group_by(ocr_documents.c.status)
    )
    with engine.connect() as conn:
        rows = conn.execute(grouped).all()
        if not rows:
            return None
        out = BatchSummary(batch)
        out.documents = {status: n for status, n in conn.execute(documents)}
    by_kind = {"image": out.images, "page": out.pages, "split": out.splits}
    for kind_, status, n, created, started, first, last in rows:
        by_kind[kind_][status] = n
        out.created_at = _min(out.created_at, _aware(created))
        out.started_at = _min(out.started_at, _aware(started))
        out.first_finished_at = _min(out.first_finished_at, _aware(first))
        out.last_finished_at = _max(out.last_finished_at, _aware(last))
    return out


def _min(a: dt.datetime | None, b: dt.datetime | None) -> dt.datetime | None:
    return b if a is None else a if b is None else min(a, b)


def _max(a: dt.datetime | None, b: dt.datetime | None) -> dt.datetime | None:
    return b if a is None else a if b is None else max(a, b)


def known(engine: Engine, names: list[str]) -> set[str]:
    """Which of `names` are batches (some row names them)."""
    if not names:
        return set()
    stmt = select(ocr_jobs.c.batch).where(ocr_jobs.c.batch.in_(names)).distinct()
    with engine.connect() as conn:
        return set(conn.execute(stmt).scalars())
