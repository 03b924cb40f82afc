"""Tables of bench/control_plane.py's JSON, for the results' .md: per-job costs side by side.

Why a script: the .md must say exactly what the JSON holds, so it is made from it, not typed:
`python bench/control_plane_report.py RESULT.json [LABEL=OTHER.json ...]`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def phases_table(results: dict[str, Any]) -> list[str]:
    """One row per phase: the counts per job, the CPU per job, the rate."""
    head = [
        "phase",
        "workers",
        "jobs/s (loaded 2-core)",
        "Redis cmds",
        "Redis reads",
        "Redis B in/out",
        "SQL stmts (worker+producer)",
        "explicit COMMITs",
        "sessions opened",
        "WAL B",
        "CPU ms Redis",
        "CPU ms PostgreSQL",
        "CPU ms workers",
        "PG conns peak/worker",
    ]
    out = [_row(head), _row(["---"] * len(head))]
    for ph in results["phases"]:
        cpu = ph["cpu_ms_per_job"]
        out.append(
            _row(
                [
                    ph["label"],
                    ph["workers"],
                    ph["jobs_per_s"],
                    ph["redis_commands_per_job"],
                    ph["redis_reads_per_job"],
                    f"{ph['redis_bytes_in_per_job']} / {ph['redis_bytes_out_per_job']}",
                    ph["sql_calls_per_job_total"],
                    sum(ph["transactions_per_job"].values()),
                    ph.get("pg_sessions_per_job", "-"),
                    ph["wal_bytes_per_job"],
                    cpu["redis"],
                    cpu["postgres"],
                    cpu["workers"],
                    max(ph["pg_connections_peak_per_worker"].values() or [0]),
                ]
            )
        )
    return out


def detail(ph: dict[str, Any]) -> list[str]:
    """One phase's Redis commands by type and SQL statements by normalised query."""
    out = [f"#### {ph['label']}, {ph['workers']} worker(s): {ph['jobs']} jobs", ""]
    cmds = ", ".join(f"{k} {v}" for k, v in ph["redis_commands_per_job_by_type"].items())
    out += [f"Redis commands per job: {cmds}.", ""]
    by_kind = ph.get("postgres_cpu_ms_per_job_by_process")
    if by_kind:
        kinds = ", ".join(f"{k} {v}" for k, v in by_kind.items())
        out += [f"PostgreSQL CPU ms per job by process: {kinds}.", ""]
    out += [_row(["role", "calls/job", "rows/job", "exec ms", "statement"])]
    out += [_row(["---"] * 5)]
    for s in ph["sql_statements"]:
        if s["calls_per_job"] >= 0.005:
            query = s["query"].replace("|", "\\|")
            query = query if len(query) <= 110 else query[:107] + "..."
            out.append(
                _row([s["role"], s["calls_per_job"], s["rows_per_job"], s["exec_ms"], query])
            )
    return [*out, ""]


def main(argv: list[str]) -> None:
    results = json.loads(Path(argv[0]).read_text())
    lines = phases_table(results)
    for extra in argv[1:]:
        label, _, path = extra.partition("=")
        lines += ["", f"**{label}**", "", *phases_table(json.loads(Path(path).read_text()))]
    idle = results["idle_one_worker"]
    secs = idle["seconds"]
    lines += [
        "",
        f"Idle, one worker, {secs} s: Redis {idle['redis_commands']} "
        f"({round(sum(idle['redis_commands'].values()) / secs, 2)} commands/s), SQL "
        + ", ".join(f"{s['calls']} x {s['query'][:60]}" for s in idle["sql_statements"])
        + f"; CPU s: {idle['cpu_s']}.",
        "",
    ]
    for ph in results["phases"]:
        lines += detail(ph)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
