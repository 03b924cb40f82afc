"""The `ocrq` command: one module per group of commands, on the Typer app of `app.py`.

Why a package: one 1,400-line module held 17 commands and their helpers, and every change to
one command was a change to the hub every other one lived in. Importing a group registers its
commands; the order below is the order `ocrq --help` lists them in. The names re-exported here
are the ones other code and the tests use (`ocrq.cli:app` is the console script).
"""

from __future__ import annotations

# Imported for their commands, in `ocrq --help`'s order: the embedded run, the worker, the
# producer's commands, the operator's, then tune and the api.
# isort: off
from ocrq.cli import local, worker, jobs, operations, tuning, serve  # noqa: F401
# isort: on
from ocrq.cli.app import (
    ENGINE_HELP,
    EXIT_BROKER,
    EXIT_CONFIG,
    EXIT_DATABASE,
    EXIT_FAILED,
    EXIT_PENDING,
    EXIT_UNAVAILABLE,
    EXIT_UNKNOWN,
    EXIT_USAGE,
    app,
    duration_s,
)
from ocrq.cli.local import run
from ocrq.cli.tuning import quiet_compilers, tune

__all__ = [
    "ENGINE_HELP",
    "EXIT_BROKER",
    "EXIT_CONFIG",
    "EXIT_DATABASE",
    "EXIT_FAILED",
    "EXIT_PENDING",
    "EXIT_UNAVAILABLE",
    "EXIT_UNKNOWN",
    "EXIT_USAGE",
    "app",
    "duration_s",
    "quiet_compilers",
    "run",
    "tune",
]
