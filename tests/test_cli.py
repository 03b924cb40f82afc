"""The `ocrq` command as scripts and terminals see it (issue 15): exit codes, summary lines, full
job ids at any width, `ocrq jobs`, and where `run` puts its JSONL and its SQLite file.

Real `ocrq` processes against the module's real worker, Redis and PostgreSQL; terminal cases
run the command with its stdout on a pseudo-terminal of a given width.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import termios
import uuid
from pathlib import Path

from tests.conftest import BIN, WorkerProcess

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def ocrq(
    env: dict[str, str], *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ocrq"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        check=False,
    )


def ocrq_on_tty(
    env: dict[str, str], *args: str, columns: int = 120, cwd: Path | None = None
) -> tuple[int, str, str]:
    """Run with stdout on a pseudo-terminal `columns` wide: (exit code, stdout, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(
        [str(BIN / "ocrq"), *args],
        env={**env, "COLUMNS": str(columns), "TERM": "xterm"},
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.PIPE,
        cwd=cwd,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    _, stderr = proc.communicate(timeout=300)
    out = ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r", "")
    return proc.returncode, out, stderr.decode(errors="replace")


def test_submit_wait_fails_when_a_job_fails(
    worker: WorkerProcess,
    service_env: dict[str, str],
    text_images: dict[str, Path],
    image_root: Path,
) -> None:
    missing = image_root / f"missing-{uuid.uuid4().hex[:6]}.png"
    proc = ocrq(
        service_env,
        "submit",
        str(text_images["hello"]),
        str(missing),
        "--wait",
        "--json",
        "--timeout",
        "120",
    )
    assert proc.returncode == 1, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["status"] for r in rows] == ["done", "failed"]
    assert re.search(r"done: 1, failed: 1, total: 2 in \d+\.\d s", proc.stderr), proc.stderr
    # Every job failed: still 1; a timeout with jobs unfinished: 3 (documented codes).
    only_bad = ocrq(service_env, "submit", str(missing), "--wait", "--timeout", "120")
    assert only_bad.returncode == 1 and "done: 0, failed: 1, total: 1" in only_bad.stderr


def test_status_prints_whole_ids_and_fails_on_unknown(
    worker: WorkerProcess,
    service_env: dict[str, str],
    text_images: dict[str, Path],
    image_root: Path,
) -> None:
    done = ocrq(service_env, "submit", str(text_images["word"]), "--wait", "--json")
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)["job_id"]
    unknown = str(uuid.uuid4())
    for columns in (40, 80, 120, 200):
        code, out, err = ocrq_on_tty(service_env, "status", job, unknown, columns=columns)
        assert code == 4, (columns, out, err)
        assert job in out and unknown in out, (columns, out)
        assert unknown in err
    code, out, _ = ocrq_on_tty(service_env, "status", job, columns=40)
    assert code == 0 and job in out and "STATION" in out.upper()
    piped = ocrq(service_env, "status", job)
    assert piped.returncode == 0 and job in piped.stdout
    failed = ocrq(service_env, "submit", str(image_root / "nope.png"), "--wait", "--json")
    bad_job = json.loads(failed.stdout)["job_id"]
    status = ocrq(service_env, "status", bad_job, "--json")
    assert status.returncode == 1 and json.loads(status.stdout)["status"] == "failed"
    row = json.loads(ocrq(service_env, "status", job, "--json").stdout)
    assert row["engine"] == "rapid" and row["attempts"] == 1 and row["finished_at"]


def test_jobs_lists_and_filters(
    worker: WorkerProcess,
    service_env: dict[str, str],
    text_images: dict[str, Path],
    image_root: Path,
) -> None:
    bad = ocrq(service_env, "submit", str(image_root / "gone.png"), "--wait", "--json")
    good = ocrq(service_env, "submit", str(text_images["hello"]), "--wait", "--json")
    bad_id, good_id = (json.loads(p.stdout)["job_id"] for p in (bad, good))
    failed = ocrq(service_env, "jobs", "--status", "failed", "--since", "10m", "--json")
    assert failed.returncode == 0, failed.stderr
    rows = [json.loads(line) for line in failed.stdout.splitlines()]
    assert bad_id in {r["job_id"] for r in rows} and good_id not in {r["job_id"] for r in rows}
    assert all(r["status"] == "failed" for r in rows)
    newest = ocrq(service_env, "jobs", "--limit", "1", "--json")
    assert [json.loads(line)["job_id"] for line in newest.stdout.splitlines()] == [good_id]
    code, out, _ = ocrq_on_tty(service_env, "jobs", "--limit", "2", columns=60)
    assert code == 0 and good_id in out and bad_id in out
    assert ocrq(service_env, "jobs", "--status", "lost").returncode == 2
    assert ocrq(service_env, "jobs", "--since", "yesterday").returncode == 2


def _images(folder: Path, text_images: dict[str, Path]) -> Path:
    folder.mkdir()
    for p in text_images.values():
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "broken.png").write_bytes(b"not an image at all")
    return folder


def test_run_on_a_terminal_writes_a_results_file(
    tmp_path: Path, text_images: dict[str, Path]
) -> None:
    folder = _images(tmp_path / "imgs", text_images)
    cwd = tmp_path / "here"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")}
    code, out, err = ocrq_on_tty(env, "run", str(folder), cwd=cwd)
    assert code == 1, err  # broken.png failed
    assert '{"path"' not in out  # no JSONL through the progress bar's terminal
    match = re.search(r"results: (\S+\.jsonl)", err)
    assert match, err
    results = Path(match[1])
    assert results.parent == cwd.resolve()
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(rows) == 4 and sum(r["status"] == "failed" for r in rows) == 1
    assert re.search(r"done: 3, failed: 1, total: 4 in \d+\.\d s", err), err
    assert sorted(p.name for p in cwd.iterdir()) == [results.name]  # no ocrq-run.sqlite

    # Piped: JSONL on stdout, still no SQLite file left behind.
    piped = ocrq(env, "run", str(folder), cwd=cwd)
    assert piped.returncode == 1
    assert len([json.loads(line) for line in piped.stdout.splitlines()]) == 4
    assert sorted(p.name for p in cwd.iterdir()) == [results.name]
