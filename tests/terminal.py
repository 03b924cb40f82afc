"""Running `ocrq` with a pseudo-terminal on one of its streams, as a user's shell gives it:
what rich and click print depends on whether they see a terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
from pathlib import Path

from tests.conftest import BIN

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def on_terminal(
    env: dict[str, str],
    *args: str,
    stream: str = "stdout",
    columns: int = 120,
    cwd: Path | None = None,
) -> tuple[int, str, str]:
    """`ocrq ARGS` with `stream` ("stdout" or "stderr") on a terminal `columns` wide and the
    other a pipe: (exit code, what the terminal showed without its escapes, the pipe's text)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    streams = {"stdout": slave, "stderr": subprocess.PIPE}
    if stream == "stderr":
        streams = {"stdout": subprocess.PIPE, "stderr": slave}
    proc = subprocess.Popen(
        [str(BIN / "ocrq"), *args],
        env={**env, "COLUMNS": str(columns), "TERM": "xterm"},
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        **streams,
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
    out, err = proc.communicate(timeout=300)
    piped = (out if stream == "stderr" else err).decode(errors="replace")
    shown = ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r", "")
    return proc.returncode, shown, piped
