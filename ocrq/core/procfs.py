"""This process's and this host's memory and CPU, read from Linux's /proc.

Why one module: the host-memory engine side (ocrq/models/memory.py), the recycler
(ocrq/scheduling/recycle.py)
and the profile key (ocrq/tuning/profiles.py) all read /proc; here each file is parsed once, the
same way, and every reader degrades to a stated fallback where /proc is missing (not Linux, a
sandbox), so no caller needs psutil or a try of its own.
"""

from __future__ import annotations

import os
import platform

KiB = 1024
GiB = 1024**3
# MemAvailable where /proc/meminfo cannot be read: a modest host, so budgets stay small.
FALLBACK_AVAILABLE_BYTES = 4 * GiB


def _field(path: str, name: str, sep: str = ":") -> str | None:
    """The value after `name<sep>` on the first line of `path` that starts with it."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(name):
                    head, _, value = line.partition(sep)
                    if head.strip() == name:
                        return value.strip()
    except OSError:
        pass
    return None


def _kib_field(path: str, name: str) -> int | None:
    value = _field(path, name)
    return int(value.split()[0]) * KiB if value else None


def available_bytes() -> int:
    """MemAvailable of the host (what can be allocated without swapping)."""
    return _kib_field("/proc/meminfo", "MemAvailable") or FALLBACK_AVAILABLE_BYTES


def rss_bytes() -> int:
    """Resident set size of this process now; 0 where unreadable."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _kib_field("/proc/self/status", "VmRSS") or 0


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM) since start or the last `reset_peak_rss`."""
    return _kib_field("/proc/self/status", "VmHWM") or rss_bytes()


def reset_peak_rss() -> None:
    """Start a new peak window: VmHWM drops to the current RSS, after freed heap went back to
    the OS, so a peak measured next is this window's own and not what an earlier, larger batch
    left. Without clear_refs (not Linux, a sandbox) the peak keeps its history."""
    _trim_malloc()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def cpu_name() -> str:
    """The CPU's model name (the device name of host-memory engines' profiles)."""
    return (
        _field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine() or "cpu"
    )


def _trim_malloc() -> None:
    """Hand freed heap back to the OS (glibc)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
