"""Where one thread's wall time goes, by sampling its Python stack (benches only).

Why: the running loop's host time per prefill pass is about the GPU's (bench/results/
service_gpu/service_gpu_reading.md, "Where the steady GPU waits"), and CUPTI shows the GPU's side
only. A sampler thread reading `sys._current_frames()` every millisecond needs no ptrace (py-spy may
not be allowed on the device) and sees which lines the loop thread sits on: a torch call's line
holds both the call's own host time and any wait to take the GIL back after it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any


def _where(frame: Any) -> str:
    code = frame.f_code
    path = code.co_filename
    for root in ("/ocrq/", "/transformers/", "/torch/", "/triton/", "/bench/"):
        if root in path:
            path = root.strip("/") + "/" + path.split(root, 1)[1]
            break
    return f"{path}:{code.co_name}:{frame.f_lineno}"


def sample(thread_name: str, at_s: float, for_s: float, path: Path,
           every_s: float = 0.001) -> None:
    """From `at_s` seconds on, sample the stack of the thread named `thread_name` for `for_s`
    seconds; write the lines it sat on most (innermost frame: "self"; every frame once:
    "inclusive") to `path` as JSON."""
    time.sleep(at_s)
    ident = next((t.ident for t in threading.enumerate() if t.name == thread_name), None)
    if ident is None:
        path.write_text(json.dumps({"error": f"no thread named {thread_name!r}"}))
        return
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    samples = 0
    end = time.monotonic() + for_s
    while time.monotonic() < end:
        frame = sys._current_frames().get(ident)
        if frame is None:
            break
        samples += 1
        own[_where(frame)] += 1
        seen: set[str] = set()
        seen_functions: set[str] = set()
        while frame is not None:
            where = _where(frame)
            function = where.rsplit(":", 1)[0]
            if where not in seen:
                inclusive[where] += 1
                seen.add(where)
            if function not in seen_functions:
                functions[function] += 1
                seen_functions.add(function)
            frame = frame.f_back
        time.sleep(every_s)

    def top(counter: Counter[str], n: int) -> list[tuple[str, float]]:
        return [(k, round(100 * v / max(samples, 1), 1)) for k, v in counter.most_common(n)]

    out = {"thread": thread_name, "samples": samples, "seconds": for_s,
           "self_pct": top(own, 40), "functions_pct": top(functions, 60),
           "lines_inclusive_pct": top(inclusive, 40)}
    path.write_text(json.dumps(out, indent=1))
    print("stacks:", json.dumps(out["self_pct"][:15]), flush=True)


def start(thread_name: str, at_s: float, for_s: float, path: Path) -> threading.Thread:
    """`sample` in a daemon thread, started."""
    t = threading.Thread(target=sample, args=(thread_name, at_s, for_s, path), daemon=True,
                         name="stack-sampler")
    t.start()
    return t
