"""The `ocrq` command as scripts and terminals see it (issue 15): exit codes, summary lines, full
job ids at any width, `ocrq jobs`, and where `run` puts its JSONL and its SQLite file.

Real `ocrq` processes against the module's real worker, Redis and PostgreSQL; terminal cases
run the command with its stdout on a pseudo-terminal of a given width.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import uuid
from pathlib import Path

from tests.conftest import BIN, WorkerProcess
from tests.pdfs import text_pdf
from tests.terminal import ANSI, on_terminal


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
    return on_terminal(env, *args, stream="stdout", columns=columns, cwd=cwd)


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
    # On an 80-column terminal each result is one line that fits (every row wrapped: the path
    # and the error's text took 150+ columns); the file name and the status stay readable.
    code, shown, _ = ocrq_on_tty(
        service_env, "submit", str(missing), "--wait", "--timeout", "120", columns=80
    )
    lines = [line for line in ANSI.sub("", shown).splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, shown
    assert len(lines[0]) <= 80 and "failed" in lines[0] and missing.name in lines[0], lines


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


def test_status_shows_the_producers_batch_and_the_engine_batch_apart(
    worker: WorkerProcess,
    service_env: dict[str, str],
    text_images: dict[str, Path],
    image_root: Path,
) -> None:
    """`ocrq status ID` printed the engine's `batch_id` (a UUID) as "batch", and `ocrq wait`
    given that UUID found nothing: "batch" is now the producer's name, which `wait` takes, the
    engine's is "engine batch", and a retried job says how many times it was re-run."""
    name = f"cli-batch-{uuid.uuid4().hex[:6]}"
    word = str(text_images["word"])
    done = ocrq(service_env, "submit", word, "--batch", name, "--wait", "--json")
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)["job_id"]
    engine_batch = json.loads(ocrq(service_env, "status", job, "--json").stdout)["batch_id"]
    assert engine_batch and engine_batch != name
    code, out, err = ocrq_on_tty(service_env, "status", job, columns=120)
    assert code == 0, err
    fields = dict(re.findall(r"^(batch|engine batch|retries)\s{2,}(\S+)", out, flags=re.M))
    assert fields == {"batch": name, "engine batch": engine_batch, "retries": "0"}, out
    assert ocrq(service_env, "wait", fields["batch"], "--timeout", "60").returncode == 0
    # A failed job run again: its retries count shows.
    missing = str(image_root / f"gone-{uuid.uuid4().hex[:6]}.png")
    failed = ocrq(service_env, "submit", missing, "--batch", name, "--wait", "--json")
    bad = json.loads(failed.stdout)["job_id"]
    assert ocrq(service_env, "retry", bad).returncode == 0
    assert ocrq(service_env, "wait", bad, "--timeout", "60").returncode == 1  # failed again
    code, out, _ = ocrq_on_tty(service_env, "status", bad, columns=120)
    assert re.search(r"^retries\s{2,}1\b", out, flags=re.M), out
    assert re.search(rf"^batch\s{{2,}}{name}\b", out, flags=re.M), out


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
    for columns in (60, 120):  # nothing matches: no table, a line saying so, exit 0
        code, out, err = ocrq_on_tty(
            service_env, "jobs", "--batch", f"none-{uuid.uuid4().hex[:6]}", columns=columns
        )
        assert (code, out.strip()) == (0, ""), (columns, out, err)
        assert "no job matches" in err, (columns, err)
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

    # --db as a plain file path keeps the rows there (a SQLAlchemy URL works too).
    kept = ocrq(env, "run", str(folder), "--db", "rows.sqlite", cwd=cwd)
    assert kept.returncode == 1, kept.stderr
    with sqlite3.connect(cwd / "rows.sqlite") as conn:
        statuses = sorted(s for (s,) in conn.execute("select status from ocr_jobs"))
    assert statuses == ["done", "done", "done", "failed"]


def test_run_searches_a_folder_with_its_subfolders(
    tmp_path: Path, text_images: dict[str, Path]
) -> None:
    """`ocrq run FOLDER` whose images are all in subfolders (as the shared eval set's are) read
    nothing, said `total: 0` and exited 0. Now every image beneath it, in sorted path order;
    hidden files and folders are left out, and what is no image is skipped with a word."""
    root = tmp_path / "scans"
    placed = {
        "b/deeper/word.png": text_images["word"],
        "a/hello.png": text_images["hello"],
        "invoice.png": text_images["invoice"],
        ".cache/hello.png": text_images["hello"],
        "a/.hidden.png": text_images["hello"],
    }
    for name, source in placed.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(source.read_bytes())
    (root / "a" / "notes.txt").write_text("not an image")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")}
    done = ocrq(env, "run", str(root))
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [Path(r["path"]).relative_to(root).as_posix() for r in rows] == [
        "a/hello.png",
        "b/deeper/word.png",
        "invoice.png",
    ]
    assert [r["status"] for r in rows] == ["done"] * 3
    assert "1 file(s) skipped as not images or PDFs (suffixes: .txt)" in done.stderr
    assert re.search(r"done: 3, failed: 0, total: 3 in \d+\.\d s", done.stderr), done.stderr


def test_run_counts_a_documents_pages_on_its_progress_bar(
    tmp_path: Path, text_images: dict[str, Path]
) -> None:
    """The bar counts images and pages, as `submit --wait` does: an image and a 3-page PDF end
    at 4/4 (it counted files, and a long PDF stood at 0/1 for its whole run); the summary line
    still counts the document once."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.png").write_bytes(text_images["word"].read_bytes())
    text_pdf([["FIRST PAGE"], ["SECOND PAGE"], ["THIRD PAGE"]], folder / "b.pdf")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")}
    code, shown, out = on_terminal(env, "run", str(folder), stream="stderr", columns=200)
    assert code == 0, shown
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r.get("pages") for r in rows] == [None, 3]
    bars = [(int(m[1]), int(m[2])) for m in re.finditer(r"OCR \(rapid\).*? (\d+)/(\d+) ", shown)]
    assert bars and bars[-1] == (4, 4), shown
    assert all(done <= total <= 4 for done, total in bars), bars
    assert re.search(r"done: 2, failed: 0, total: 2 in \d+\.\d s", shown), shown


LONG_FOLDER = "a-folder-name-that-every-scan-of-this-batch-shares"
LONG_NAME = "scan-of-the-quarterly-report-2026-{:06d}.{}"


def _rows_of(out: str, ids: list[str]) -> dict[str, list[str]]:
    return {job_id: [line for line in out.splitlines() if job_id in line] for job_id in ids}


def test_status_and_jobs_fit_80_and_120_columns(
    worker: WorkerProcess,
    service_env: dict[str, str],
    text_images: dict[str, Path],
    image_root: Path,
) -> None:
    """Issue 27: at 80 columns paths and text folded to `…` and one job took ~20 lines, and
    `ocrq jobs` showed a document as `done (0/0 pages)`. Now: one line per job, no line wider
    than the terminal, the end of each file's name (what tells them apart) on the job's line,
    and a document's status and page counts from its pages."""
    from PIL import Image

    from tests.pdfs import image_pdf

    folder = image_root / LONG_FOLDER
    folder.mkdir()
    images = []
    for n, source in enumerate(text_images.values(), start=1):
        path = folder / LONG_NAME.format(n, "png")
        path.write_bytes(source.read_bytes())
        images.append(path)
    pages = [Image.open(text_images[k]).copy() for k in ("hello", "invoice")]
    pdf = image_pdf(pages, folder / LONG_NAME.format(9, "pdf"))
    sent = ocrq(service_env, "submit", *map(str, [*images, pdf]), "--wait", "--json")
    assert sent.returncode == 0, sent.stderr
    rows = [json.loads(line) for line in sent.stdout.splitlines()]
    ids = [r["job_id"] for r in rows]
    doc_id = ids[-1]
    assert rows[-1]["pages"] == 2, rows[-1]
    # The summary counts what was sent (the document once) and says so.
    assert "total: 4 images and documents in" in sent.stderr, sent.stderr
    tails = dict(zip(ids, [f"{n:06d}.png" for n in (1, 2, 3)] + ["000009.pdf"], strict=True))

    listed = ocrq(service_env, "jobs", "--limit", "50", "--json")
    (doc,) = [r for r in map(json.loads, listed.stdout.splitlines()) if r["job_id"] == doc_id]
    assert (doc["status"], doc["pages"], doc["pages_final"], doc["pages_failed"]) == (
        "done",
        2,
        2,
        0,
    ), doc
    assert "HELLO" in doc["text"]

    for columns in (80, 120):
        for args in (["status", *ids], ["jobs", "--limit", "50"]):
            code, out, err = ocrq_on_tty(service_env, *args, columns=columns)
            assert code == 0, (args, err)
            lines = out.splitlines()
            assert max(len(line) for line in lines) <= columns, (columns, out)
            if args[0] == "status":
                assert len(lines) <= len(ids) + 2, (columns, out)  # header, rows, a legend
            for job_id, mine in _rows_of(out, ids).items():
                assert len(mine) == 1, (columns, job_id, out)
                assert tails[job_id] in mine[0], (columns, tails[job_id], out)
                assert " done" in mine[0], (columns, out)
            (doc_line,) = _rows_of(out, [doc_id])[doc_id]
            assert " 2/2 " in doc_line, (columns, out)
            if columns == 120:  # the text starts on the job's line
                for row in rows:
                    first = row["text"].split("\n")[0][:8]
                    assert first in _rows_of(out, [row["job_id"]])[row["job_id"]][0], out

    # One id: the job whole, every line within the terminal.
    code, out, _ = ocrq_on_tty(service_env, "status", doc_id, columns=80)
    assert code == 0 and max(map(len, out.splitlines())) <= 80, out
    assert re.search(r"^pages\s+2/2\s*$", out, re.M) and "INVOICE" in out, out
    code, out, _ = ocrq_on_tty(service_env, "status", ids[0], columns=80)
    assert code == 0 and max(map(len, out.splitlines())) <= 80, out
    batch = json.loads(ocrq(service_env, "status", ids[0], "--json").stdout)["batch_id"]
    assert re.search(rf"^engine batch\s+{batch}\s*$", out, re.M), out
    assert LONG_NAME.format(1, "png") in "".join(line.strip() for line in out.splitlines())


def test_wide_characters_are_measured_in_cells() -> None:
    """HunyuanOCR reads Chinese: a CJK character takes two columns, so a line cut by
    characters would still run past the terminal. Measured by rich's cell widths."""
    import io

    from rich.cells import cell_len
    from rich.console import Console

    from ocrq.job_table import print_blocks, print_table

    row = {
        "job_id": str(uuid.uuid4()),
        "status": "done",
        "path": "/srv/扫描/发票-二〇二六年-第一季度-000123.png",
        "text": "增值税专用发票\n购买方名称：某某科技有限公司\n金额合计 134.90",
        "created_at": "2026-12-02T03:01:22+00:00",
        "truncated": "max_tokens",
    }
    # Why it was cut: in full where the text keeps its room, else a mark and a legend.
    full = "done (truncated: max_tokens)"
    for width, shown in ((40, full), (80, "done*"), (120, "done*"), (200, full)):
        out = io.StringIO()
        console = Console(file=out, width=width)
        (print_table if width >= 72 else print_blocks)([row], console)
        lines = out.getvalue().splitlines()
        assert max(cell_len(line) for line in lines) <= width, out.getvalue()
        assert "000123.png" in out.getvalue()
        assert row["job_id"] in out.getvalue() and shown in out.getvalue(), out.getvalue()


def test_the_top_level_help_says_what_ocrq_does() -> None:
    """The first lines a newcomer reads: the two ways to use ocrq and how results come back,
    not the module's note to its readers."""
    done = ocrq({**os.environ, "COLUMNS": "100"}, "--help")
    assert done.returncode == 0
    text = " ".join(ANSI.sub("", done.stdout).split())
    assert "OCR at volume" in text and "ocrq run" in text and "ocrq worker" in text
    assert "send_task" in text and "docs/settings.md" in text
    assert "builds Settings" not in text


def test_flags_show_no_type_in_help() -> None:
    """`--json <bool>` read as if the flag took a value (`--json true` then fails); options
    that take one still name its type."""
    done = ocrq({**os.environ, "COLUMNS": "120"}, "submit", "--help")
    assert done.returncode == 0
    text = ANSI.sub("", done.stdout)
    assert "--wait" in text and "--json" in text
    assert "<bool>" not in text and "<float>" in text and "<str>" in text
