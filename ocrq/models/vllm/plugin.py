"""ocrq's vLLM plugin (entry point `vllm.general_plugins`): contiguous GEMM inputs on CPUs.

Why: HunYuanVL's vision patch merger (transformers' `HunYuanVLVisionPatchMerger.forward`) hands
its `mlp` Linear a permuted, non-contiguous tensor. vLLM-CPU routes that Linear to oneDNN, which
requires `stride(-1) == 1` and fails the whole engine ("Expected a.stride(-1) == 1"). On a GPU
the same call goes to cuBLAS, which accepts any stride; the code is the same in vLLM 0.33, so
the real model hits it on CPUs too (worth reporting upstream). The plugin wraps vLLM's CPU GEMM
so that such an input is made contiguous first (a copy only where the stride is wrong: one
tensor per image, in the vision tower).

vLLM loads general plugins in every process it starts (front end, engine core, workers), before
the model is built, and may load them more than once: `register` is idempotent.
"""

from __future__ import annotations

from typing import Any

MARK = "_ocrq_contiguous"


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers import utils

    original = utils.cpu_unquantized_gemm
    if getattr(original, MARK, False):
        return

    def contiguous_gemm(layer: Any, x: Any, weight: Any, bias: Any = None) -> Any:
        if x.dim() and x.stride(-1) != 1:
            x = x.contiguous()
        return original(layer, x, weight, bias)

    setattr(contiguous_gemm, MARK, True)
    utils.cpu_unquantized_gemm = contiguous_gemm
