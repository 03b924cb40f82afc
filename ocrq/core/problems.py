"""Infrastructure failures told in one line: what is wrong, and what to do about it.

Why here: the CLI is the place that prints them, but what a failure *means* (PostgreSQL not
running, its database not created, Redis down, a setting that cannot work) is read off the
exception chain the way the rest of core sees those services, so the api may reuse it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import ValidationError

ProblemKind = Literal["database", "broker", "config"]


@dataclass(frozen=True)
class Problem:
    kind: ProblemKind
    message: str


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0].strip().rstrip(".") if text else type(exc).__name__


def infrastructure_problem(exc: BaseException) -> Problem | None:
    """The Problem `exc` stands for, or None for anything else (a bug keeps its traceback)."""
    import kombu.exceptions
    import redis.exceptions
    import sqlalchemy.exc

    from ocrq.core.migrate import SchemaNotAtHead

    for link in _chain(exc):
        if isinstance(link, SchemaNotAtHead):
            return Problem("database", str(link))
        if isinstance(link, sqlalchemy.exc.ProgrammingError) and "prepared statement" in str(
            link
        ):  # psycopg's own statements, lost or doubled by a pooler between us and PostgreSQL
            return Problem(
                "database",
                f"{_first_line(link)}: a pooler in transaction mode (PgBouncer) sits in front "
                "of PostgreSQL; set OCRQ_DATABASE_PREPARED_STATEMENTS=false",
            )
        if isinstance(link, sqlalchemy.exc.ProgrammingError) and "does not exist" in str(link):
            return Problem(
                "database",
                f"the database has no ocrq tables ({_first_line(link)}): run `ocrq migrate`",
            )
        if isinstance(link, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
            line = _first_line(link)
            if "does not exist" in line and "database" in line:
                return Problem(
                    "database",
                    f"{line}: run `ocrq migrate` (it creates the database), or set "
                    "OCRQ_DATABASE_URL",
                )
            return Problem(
                "database",
                f"cannot reach the database: {line}. Start PostgreSQL or set "
                "OCRQ_DATABASE_URL",
            )
        if isinstance(
            link,
            kombu.exceptions.OperationalError
            | redis.exceptions.ConnectionError
            | redis.exceptions.TimeoutError,
        ):
            return Problem(
                "broker",
                f"cannot reach the broker: {_first_line(link)}. Start Redis or set "
                "OCRQ_BROKER_URL",
            )
        if isinstance(link, ValidationError) and link.title == "Settings":
            # A field's error is named by its variable; a check across fields (no `loc`) names
            # its variables in its own message ("OCRQ_STALLED_AFTER_S (15.0) must be ...").
            errors = "; ".join(
                f"OCRQ_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}"
                if e["loc"]
                else str(e["msg"]).removeprefix("Value error, ")
                for e in link.errors()
            )
            return Problem("config", f"invalid settings: {errors}")
        if type(link).__name__ == "ConfigProblem":  # the CLI's own (core does not import it)
            return Problem("config", str(link))
        # an engine's (core imports no engine): ocrq/models/base.py, hunyuan/checkpoint.py
        if type(link).__name__ in ("ModelNotFound", "EngineMisconfigured"):
            return Problem("config", " ".join(str(link).split()))
    return None
