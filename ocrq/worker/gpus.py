"""Which GPUs `ocrq worker --gpus` starts a worker process on, found without CUDA.

The supervisor must never initialise CUDA: its children are new interpreters, but a CUDA
context in the supervisor would hold memory on every GPU for nothing, and one `import torch`
there would cost seconds and gigabytes. So `all` asks `nvidia-smi -L` in a short subprocess
(it talks to the driver through NVML, not CUDA, ships with every NVIDIA driver and is mounted
into containers by the NVIDIA container toolkit; pynvml would be one more dependency for the
same answer), and falls back to counting /proc/driver/nvidia/gpus where nvidia-smi is missing.

Indices are nvidia-smi's (PCI bus order): each child is started with CUDA_DEVICE_ORDER=PCI_BUS_ID
(unless the environment says otherwise), so `gpu1` in a worker's name is nvidia-smi's GPU 1.
When the supervisor itself runs under CUDA_VISIBLE_DEVICES, `all` means those devices and an
index means the one at that position, as CUDA would read it.

MIG instances are not listed by `all` (only whole GPUs): name them in CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PROC_GPUS = Path("/proc/driver/nvidia/gpus")
_GPU_LINE = re.compile(r"^GPU (\d+):", re.MULTILINE)


class GpuSelectionError(Exception):
    """No usable GPU list: a configuration error (the worker exits 78)."""


@dataclass(frozen=True)
class Gpu:
    """One GPU a worker process runs on."""

    visible: str  # the child's CUDA_VISIBLE_DEVICES: an index or a GPU-/MIG- UUID
    label: str  # in its Celery node name and worker name: "gpu0"


def label_of(device: str) -> str:
    """ "gpu0" for an index; a UUID keeps its letters and digits (node names allow no '/')."""
    if device.isdigit():
        return f"gpu{device}"
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:24] or "gpu"


def discover(env: Mapping[str, str] | None = None) -> list[str]:
    """Indices of this host's NVIDIA GPUs: nvidia-smi's, else /proc's; raises when none."""
    env = dict(os.environ if env is None else env)
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if smi is not None:
        try:
            out = subprocess.run(
                [smi, "-L"], env=env, capture_output=True, text=True, timeout=60, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise GpuSelectionError("--gpus all: `nvidia-smi -L` did not answer in 60 s") from exc
        found = _GPU_LINE.findall(out.stdout)
        if out.returncode == 0 and found:
            return found
        why = (out.stderr or out.stdout).strip().splitlines()
        detail = f"`nvidia-smi -L` found none ({why[0] if why else f'exit {out.returncode}'})"
    else:
        detail = "nvidia-smi is not installed"
    try:
        count = len([p for p in PROC_GPUS.iterdir() if p.is_dir()])
    except OSError:
        count = 0
    if count:
        return [str(i) for i in range(count)]
    raise GpuSelectionError(
        f"--gpus all: no NVIDIA GPU found on this host: {detail}, and {PROC_GPUS} lists none. "
        "Name the GPUs (--gpus 0,1), or run without --gpus for one worker process"
    )


def has_nvidia_gpu(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process would see an NVIDIA GPU, asked without CUDA (as `discover`);
    CUDA_VISIBLE_DEVICES set empty (or -1) hides them all."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    try:
        return bool(discover(env))
    except GpuSelectionError:
        return False


def select(spec: str, env: Mapping[str, str] | None = None) -> list[Gpu]:
    """The GPUs of `spec` ("all" or "0,1", as Settings.gpus holds it), one worker each.

    Explicit indices are taken as given (a GPU that is not there fails its worker at start-up:
    the engine finds no CUDA device); only `all` looks at the host.
    """
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    shown = None if visible is None else [v.strip() for v in visible.split(",") if v.strip()]
    if spec == "all":
        devices = shown if shown is not None else discover(env)
        if not devices:
            raise GpuSelectionError("--gpus all: CUDA_VISIBLE_DEVICES is empty: no GPU to use")
    else:
        indices = [int(i) for i in spec.split(",")]
        if shown is None:
            devices = [str(i) for i in indices]
        else:
            outside = [i for i in indices if i >= len(shown)]
            if outside:
                raise GpuSelectionError(
                    f"--gpus {spec}: CUDA_VISIBLE_DEVICES={visible} shows {len(shown)} GPU(s); "
                    f"no index {', '.join(map(str, outside))} among them"
                )
            devices = [shown[i] for i in indices]
    return [Gpu(visible=d, label=label_of(d)) for d in devices]
