"""Infrastructure errors in the CLI (issue 27): one line that says what is wrong and what to do,
and an exit code of their own, never a traceback ending in 1 (a failed job's code); --version.

Real `ocrq` processes against a PostgreSQL that is there (the session's migrated database), one
that is not (a closed port), a database that does not exist, and a broker that does not answer.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

import ocrq
from ocrq.cli import EXIT_BROKER, EXIT_CONFIG, EXIT_DATABASE, EXIT_UNAVAILABLE, EXIT_USAGE
from tests.conftest import BIN, TEST_PG


def closed_port() -> int:
    """A port nothing listens on: bound, then closed again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ocrq_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ocrq"), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_version() -> None:
    done = ocrq_cli(dict(os.environ), "--version")
    assert done.returncode == 0 and done.stdout.strip() == f"ocrq {ocrq.__version__}"
    assert ocrq.__version__ != "0+unknown"


def test_every_command_spells_a_duration_alike() -> None:
    """`requeue --older-than` took seconds only, `prune --older-than` needed a unit and
    `jobs --since` took units: three spellings of one thing. All take 90s/30m/2h/7d/1w now;
    requeue still takes a bare number of seconds (its old spelling), prune still refuses one
    (`30` could as well mean days)."""
    import typer

    from ocrq.cli import duration_s

    assert [duration_s(v, "--x") for v in ("90s", "10m", " 2h", "1.5d", "1w")] == [
        90, 600, 7200, 129600, 604800
    ]
    assert duration_s("600", "--older-than", bare_seconds=True) == 600
    for bad, bare in (("600", False), ("-5", True), ("soon", True), ("5y", True)):
        with pytest.raises(typer.BadParameter):
            duration_s(bad, "--older-than", bare_seconds=bare)
    refused = ocrq_cli(dict(os.environ), "requeue", "--older-than", "soon")
    assert refused.returncode == EXIT_USAGE and "--older-than" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_help_lists_the_exit_codes() -> None:
    done = ocrq_cli({**os.environ, "COLUMNS": "200"}, "--help")
    assert done.returncode == 0
    for code in ("5 database", "6 broker", "78 invalid settings"):
        assert code in done.stdout


def test_help_reflows_docstrings_and_keeps_brackets() -> None:
    """Command help reads as paragraphs at a terminal's width (the docstrings' own line breaks
    cut sentences in two at 80 columns), and text in brackets is not eaten as rich markup."""
    top = ocrq_cli({**os.environ, "COLUMNS": "200"}, "--help")
    jobs = next(ln for ln in top.stdout.splitlines() if "List recent jobs" in ln)
    assert "When more jobs match than --limit shows" in jobs
    export = ocrq_cli({**os.environ, "COLUMNS": "200"}, "export", "--help")
    assert "ocrq[parquet]" in export.stdout


@pytest.mark.parametrize("command", [["jobs"], ["status", str(uuid.uuid4())], ["migrate"]])
def test_database_unreachable(service_env: dict[str, str], command: list[str]) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/ocrq"
    done = ocrq_cli({**service_env, "OCRQ_DATABASE_URL": url}, *command)
    assert done.returncode == EXIT_DATABASE
    line = one_line(done)
    assert "cannot reach the database" in line and "OCRQ_DATABASE_URL" in line


def test_database_missing_or_not_migrated(service_env: dict[str, str]) -> None:
    missing = make_url(TEST_PG).set(database=f"ocrq_missing_{uuid.uuid4().hex[:8]}")
    done = ocrq_cli(
        {**service_env, "OCRQ_DATABASE_URL": missing.render_as_string(hide_password=False)},
        "jobs",
    )
    assert done.returncode == EXIT_DATABASE
    assert "does not exist" in (line := one_line(done)) and "ocrq migrate" in line
    # `postgres` exists on every server and holds no ocrq tables
    done = ocrq_cli({**service_env, "OCRQ_DATABASE_URL": TEST_PG}, "jobs")
    assert done.returncode == EXIT_DATABASE and "ocrq migrate" in one_line(done)


def test_broker_down(service_env: dict[str, str], text_images: dict[str, Path]) -> None:
    env = {**service_env, "OCRQ_BROKER_URL": f"redis://127.0.0.1:{closed_port()}/0"}
    done = ocrq_cli(env, "submit", str(text_images["hello"]))
    assert done.returncode == EXIT_BROKER
    line = one_line(done)
    assert "cannot reach the broker" in line and "OCRQ_BROKER_URL" in line


@pytest.mark.parametrize(
    ("command", "env"),
    [
        (["run", "--engine", "nope", "x.png"], {}),
        (["jobs"], {"OCRQ_ENGINE": "nope"}),
        (["worker", "--engine", "nope"], {}),
        (["run", "x.png"], {"OCRQ_MAX_BATCH": "-3"}),
        (["jobs"], {"OCRQ_STALLED_AFTER_S": "15", "OCRQ_HEARTBEAT_S": "10"}),  # across fields
    ],
)
def test_bad_settings(
    service_env: dict[str, str], command: list[str], env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "x.png").write_bytes(b"")  # `run` names an existing file: the settings fail
    command = [str(tmp_path / a) if a == "x.png" else a for a in command]
    done = ocrq_cli({**service_env, **env}, *command)
    assert done.returncode == EXIT_CONFIG
    line = one_line(done)
    assert (
        ("unknown engine 'nope'" in line and "rapid" in line)
        or "OCRQ_MAX_BATCH" in line
        or "settings: OCRQ_STALLED_AFTER_S (15.0) must be" in line
    ), line
    assert "OCRQ_:" not in line, line


def test_run_names_a_path_that_is_not_there(tmp_path: Path) -> None:
    """A typo on `ocrq run`'s command line: exit 2 naming the path, before any work (it was a
    failed job blaming OCRQ_ALLOWED_ROOTS, which `run` does not apply)."""
    (tmp_path / "here.png").write_bytes(b"")
    # Wide enough that click's error box never wraps pytest's temporary path (at 80 columns it
    # broke the path or "does not exist" across lines once pytest's run counter grew a digit).
    env = {**os.environ, "COLUMNS": "1000"}
    done = ocrq_cli(env, "run", str(tmp_path / "here.png"), str(tmp_path / "nope.png"))
    assert done.returncode == 2 and "nope.png" in done.stderr and "does not exist" in done.stderr


@pytest.mark.parametrize(
    ("engine", "env", "said"),
    [
        ("hunyuan", {}, "ocrq: HunyuanOCR weights"),  # and how: `hf download ...`
        ("openai", {"OCRQ_OPENAI_URL": ""}, "ocrq: OCRQ_OPENAI_URL is not set"),
    ],
)
def test_run_with_an_engine_that_cannot_start_says_why(
    tmp_path: Path, engine: str, env: dict[str, str], said: str
) -> None:
    """`ocrq run` whose engine cannot start on this host (the weights not here, no server URL):
    one line saying why and EXIT_CONFIG, not a traceback of up to 170 lines ending in 1 (a
    failed job's code)."""
    from ocrq.core.samples import draw_text_image

    image = tmp_path / "word.png"
    draw_text_image(["HELLO"]).save(image)
    (tmp_path / "hub").mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")}
    env = {**base, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", **env}
    done = subprocess.run(
        [str(BIN / "ocrq"), "run", str(image), "--engine", engine,
         "--db", str(tmp_path / "run.sqlite")],
        env=env, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )
    assert done.returncode == EXIT_CONFIG, done.stderr
    assert "Traceback" not in done.stderr
    # The reason once: no log line before it that says only "engine failed to start".
    assert "failed to start" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(said), done.stderr
    if engine == "hunyuan":
        assert "hf download" in last


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_folder_with_nothing_to_ocr_is_a_usage_error(tmp_path: Path, command: str) -> None:
    """A folder that holds no image or PDF (beneath it either; hidden ones do not count): exit 2
    and one line saying where it looked and what it skipped, before an engine or a broker is
    touched (`run` said `total: 0` and exited 0)."""
    from ocrq.core.samples import draw_text_image

    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    (folder / "notes.txt").write_text("no image")
    (folder / "sub" / "data.csv").write_text("a,b")
    draw_text_image(["HIDDEN"]).save(folder / ".hidden" / "word.png")
    env = {**os.environ, "OCRQ_BROKER_URL": f"redis://127.0.0.1:{closed_port()}/0"}
    done = ocrq_cli(env, command, str(folder))
    assert done.returncode == EXIT_USAGE, done.stderr
    line = one_line(done)
    assert line.startswith(f"ocrq {command}: no image or PDF found in {folder} "), line
    assert "2 file(s) skipped as not images or PDFs (suffixes: .csv, .txt)" in line, line
    assert ".pdf" in line and ".png" in line  # what it would have taken


def test_run_refuses_a_task_the_engine_cannot_do(tmp_path: Path) -> None:
    """`ocrq run --task "describe this image"` on rapid (the default): exit 2 naming rapid's
    tasks, before the engine loads (it loaded it, then failed every image with the reason)."""
    from ocrq.core.samples import draw_text_image
    from ocrq.models.rapid.engine import SUPPORTED_TASKS

    draw_text_image(["HELLO"]).save(tmp_path / "word.png")
    base = {k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")}
    for task, what in (("describe this image", "free prompts"), ("table", "task 'table'")):
        done = ocrq_cli(base, "run", str(tmp_path / "word.png"), "--task", task)
        assert done.returncode == EXIT_USAGE, done.stderr
        line = one_line(done)  # no progress bar: no engine was loaded, no image failed
        assert f"--task {task!r}" in line and f"supports tasks {', '.join(SUPPORTED_TASKS)}" in line
        assert f"use --engine hunyuan for {what}" in line, line
        assert done.stdout == ""
    ok = ocrq_cli(base, "run", str(tmp_path / "word.png"), "--task", "spotting")
    assert ok.returncode == 0, ok.stderr


def test_worker_bad_setting_is_one_line_naming_the_variable(service_env: dict[str, str]) -> None:
    """`ocrq worker` printed pydantic's own error (the field `max_images`, over several lines,
    with its errors.pydantic.dev link) where every other command says one line naming the
    variable; its exit code stays 78."""
    done = ocrq_cli({**service_env, "OCRQ_MAX_IMAGES": "abc"}, "worker", "--no-supervise")
    assert done.returncode == EXIT_CONFIG, done.stderr
    line = one_line(done)
    assert "OCRQ_MAX_IMAGES: Input should be a valid integer" in line, line
    assert "pydantic.dev" not in line and "validation error" not in line, line
    other = ocrq_cli({**service_env, "OCRQ_MAX_IMAGES": "abc"}, "jobs")  # as the others say it
    assert other.returncode == EXIT_CONFIG and line.split("invalid settings")[1] in other.stderr


def test_worker_database_unreachable_is_told_from_missing(service_env: dict[str, str]) -> None:
    """A wrong port in OCRQ_DATABASE_URL: the worker said "database unreachable or missing
    (`ocrq migrate` creates it)", and migrate failed the same way. It says the server does not
    answer, and what to do, as the CLI's commands do, after its wait for a database still
    starting (OCRQ_DATABASE_WAIT_S, a minute by default; 3 s here); exit 1, for its
    supervisor."""
    url = f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/ocrq"
    done = subprocess.run(
        [str(BIN / "ocrq"), "worker", "--no-supervise"],
        env={**service_env, "OCRQ_DATABASE_URL": url, "OCRQ_DATABASE_WAIT_S": "3"},
        capture_output=True, text=True, timeout=90, check=False,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    said = [ln for ln in done.stderr.splitlines() if "worker cannot start" in ln]
    assert len(said) == 1, done.stderr[-2000:]
    assert "cannot reach the database" in said[0], said
    assert "Start PostgreSQL or set OCRQ_DATABASE_URL" in said[0], said
    assert "waiting up to 3 s" in done.stderr, done.stderr[-2000:]
    assert "unreachable or missing" not in done.stderr and "ocrq migrate" not in said[0], said


def test_jobs_names_the_statuses_it_takes() -> None:
    """`ocrq jobs --status bogus` said only "unknown status ['bogus']": it lists the ones it
    takes, before touching a database."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")}
    done = ocrq_cli(base, "jobs", "--status", "done,bogus")
    assert done.returncode == EXIT_USAGE, done.stderr
    said = " ".join(done.stderr.replace("│", " ").split())
    assert "unknown status bogus; one of queued, running, done, failed, cancelled, expired" in said


def test_submit_of_a_folder_that_is_not_there_is_a_usage_error(tmp_path: Path) -> None:
    """`ocrq submit DIR/` of a missing folder sent a job named like the folder, which then
    failed on a worker. Spelt as a folder and not one here: exit 2 naming it, before the broker
    is touched (a closed port here: a send would have been exit 6)."""
    env = {**os.environ, "OCRQ_BROKER_URL": f"redis://127.0.0.1:{closed_port()}/0",
           "COLUMNS": "1000"}
    missing = f"{tmp_path / 'scans'}/"
    done = ocrq_cli(env, "submit", missing)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert one_line(done).startswith(f"ocrq submit: {missing} is not a folder here")


def test_api_on_a_port_already_taken_says_so_with_its_own_exit_code() -> None:
    """`ocrq api` on a busy port exited 3, which ocrq's scripts read as "jobs still pending"
    (uvicorn's start-up failure): it says the port is taken and exits 69 (EX_UNAVAILABLE)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "OCRQ_API_TOKEN": "t-" + uuid.uuid4().hex, "COLUMNS": "1000"}
        done = ocrq_cli(env, "api", "--port", str(port))
    assert done.returncode == EXIT_UNAVAILABLE, done.stderr
    assert f"ocrq api cannot start: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Address already in use" in done.stderr and "Traceback" not in done.stderr


def test_supervised_worker_with_a_missing_database_says_so_and_is_not_restarted(
    service_env: dict[str, str],
) -> None:
    """The server answers, the database does not exist: the worker said "database not
    reachable yet", exited 1 after its wait, and its supervisor restarted it every minute for
    ever. It names the missing database, exits 78, and the supervisor stops there."""
    missing = make_url(TEST_PG).set(database=f"ocrq_missing_{uuid.uuid4().hex[:8]}")
    done = subprocess.run(
        [str(BIN / "ocrq"), "worker"],  # supervised, as `ocrq worker` runs by default
        env={
            **service_env,
            "OCRQ_DATABASE_URL": missing.render_as_string(hide_password=False),
            "OCRQ_DATABASE_WAIT_S": "2",
        },
        capture_output=True, text=True, timeout=120, check=False,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 78, log[-3000:]
    assert "not reachable" not in log, log[-3000:]
    assert f'database "{missing.database}" does not exist' in log, log[-3000:]
    assert "restarting in" not in log and "not restarting" in log, log[-3000:]
