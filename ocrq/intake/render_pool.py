"""PDF pages drawn in render processes with a memory cap and a deadline, never in the worker.

Why: PDFium's drawing cost has no bound a check could compute first (issue 31: a 2,215-byte PDF
of nested Form XObjects drew 10^7 paths, 6 GB in 28 s, and killed the worker on every delivery;
3,000,000 line operations drew for > 165 s holding the process-wide PDFium lock, and so every
other document). Here each page is drawn by one of a few child processes
(ocrq/intake/render_child.py), each under RLIMIT_AS = OCRQ_PDF_RENDER_MAX_BYTES; the worker
lets it spend at most OCRQ_PDF_RENDER_TIMEOUT_S of CPU time on a page, then kills that child
and starts another. CPU time, not wall time: pages drawn at once share the host's cores, and
with a wall-clock deadline 8 slow but healthy pages failed together where one alone drew in
5.8 s (issue 52). A child that uses no CPU and sends nothing is stopped after WALL_FACTOR times
the budget in wall time. A bomb fails its own page with a clear error; other pages go on in
the other children, at their normal latency, and nothing in the worker holds a lock while a
page draws.

Children are plain `python -m` processes (fork+exec: nothing of the worker's threads, CUDA or
sockets is inherited), started on first use, kept while they serve, replaced when killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from PIL import Image

from ocrq.core.process import STATE
from ocrq.intake import render_wire

log = logging.getLogger(__name__)

MODES = {"RGB": 3, "RGBA": 4, "RGBX": 4, "L": 1, "1": 0}
BOMB = "possible PDF bomb"
# A page's wall-clock backstop, in multiples of its CPU budget: a child blocked (not drawing)
# never spends its CPU time, and is stopped by this instead.
WALL_FACTOR = 10
POLL_S = 0.1  # how often a drawing child's CPU time is read
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """The process's CPU time (user + system) from /proc; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after the command name, which may hold spaces
    try:
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15)
    except (IndexError, ValueError):
        return None


class RenderError(Exception):
    """This page could not be drawn within its budget, or PDFium refused it; says why."""


@dataclass(frozen=True)
class Budget:
    """What one page may cost: the child's address space and the seconds it may draw."""

    max_bytes: int
    timeout_s: float


class _Child:
    def __init__(self, budget: Budget) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = ours
        self.dead = False
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ocrq.intake.render_child",
                    str(theirs.fileno()),
                    str(budget.max_bytes),
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                close_fds=True,
            )
        finally:
            theirs.close()

    def kill(self) -> None:
        self.dead = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(10)
        self.sock.close()

    def exit_text(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


class RenderPool:
    """Up to `processes` render children, handed out one page at a time."""

    def __init__(self, budget: Budget, processes: int) -> None:
        self.budget = budget
        self.processes = processes
        self._idle: queue.LifoQueue[_Child] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(processes)
        self._closed = False

    def render(
        self,
        page: int,
        scale: float,
        size: tuple[int, int],
        fd: int | None = None,
        data: bytes = b"",
    ) -> Image.Image:
        """Page `page` (1-based) drawn at `scale`; `size` is the bitmap the caller expects
        (checked against the image caps already), so an answer of any other size is refused.
        The document comes as an open file descriptor (sent along, read lazily there) or
        bytes."""
        max_payload = size[0] * size[1] * 4
        with self._slots:
            child = self._take()
            try:
                return self._ask(child, page, scale, size, fd, data, max_payload)
            finally:
                if not child.dead:  # served, or answered with PDFium's refusal: keep it
                    self._idle.put(child)

    def _take(self) -> _Child:
        while True:
            try:
                child = self._idle.get_nowait()
            except queue.Empty:
                return _Child(self.budget)
            if child.proc.poll() is None:
                return child
            child.kill()

    def _ask(
        self,
        child: _Child,
        page: int,
        scale: float,
        size: tuple[int, int],
        fd: int | None,
        data: bytes,
        max_payload: int,
    ) -> Image.Image:
        started = time.monotonic()
        try:
            render_wire.send(
                child.sock,
                {"page": page, "scale": scale},
                b"" if fd is not None else data,
                [fd] if fd is not None else [],
            )
            self._await_answer(child, page, started)
            child.sock.settimeout(self.budget.timeout_s)  # the answer is on its way
            got = render_wire.receive(child.sock, max_payload)
        except TimeoutError:
            child.kill()
            raise RenderError(
                f"drawing page {page} took more than {self.budget.timeout_s:g} s of CPU time "
                f"(OCRQ_PDF_RENDER_TIMEOUT_S), stopped: {BOMB}"
            ) from None
        except (OSError, ValueError) as exc:
            got = None
            log.warning("render process %d: %s", child.proc.pid, exc)
        if got is None:  # it died mid-page: out of memory (PDFium aborts), or crashed
            child.kill()
            mib = self.budget.max_bytes / 2**20
            raise RenderError(
                f"drawing page {page} ran out of its {mib:.0f} MiB memory budget "
                f"(OCRQ_PDF_RENDER_MAX_BYTES) or crashed PDFium ({child.exit_text()} after "
                f"{time.monotonic() - started:.1f} s): {BOMB}"
            )
        header, fds, pixels = got
        for stray in fds:  # a render process sends none; one that does is not trusted
            os.close(stray)
        if "error" in header:
            raise RenderError(f"page {page}: {header['error']}")
        mode, got_size = header.get("mode"), tuple(header.get("size") or ())
        if mode not in MODES or got_size != size or len(pixels) > max_payload:
            child.kill()
            raise RenderError(f"page {page}: the render process answered {mode} {got_size}")
        return Image.frombytes(mode, got_size, pixels)

    def _await_answer(self, child: _Child, page: int, started: float) -> None:
        """Until the child starts answering: TimeoutError once it has drawn for more than the
        page's CPU budget, or WALL_FACTOR times that in wall time (the CPU time unread: wall
        time only, as before)."""
        budget = self.budget.timeout_s
        first = cpu_seconds(child.proc.pid)
        wall_limit = started + budget * (WALL_FACTOR if first is not None else 1)
        while not select.select([child.sock], [], [], POLL_S)[0]:
            now = cpu_seconds(child.proc.pid) if first is not None else None
            if now is not None and first is not None and now - first > budget:
                raise TimeoutError
            if time.monotonic() > wall_limit:
                raise TimeoutError

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return




def pool(budget: Budget, processes: int) -> RenderPool:
    """The process's pool, made on first use (a worker that never sees a PDF starts none);
    settings that change (tests building their own) get a pool of their own."""
    with STATE.render_pool_lock:  # process-wide state: ocrq/core/process.py
        current: RenderPool | None = STATE.render_pool
        if current is None or (current.budget, current.processes) != (budget, processes):
            if current is not None:
                current.close()
            current = STATE.render_pool = RenderPool(budget, processes)
        return current
