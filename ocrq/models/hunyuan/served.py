"""HunyuanOCR as engines that hand images to vLLM see it: the version's prompts, pixel caps,
estimates and answer parsing, without ocrq's own model code.

Why a module of its own: the `vllm` engine (in-process) and the `openai` engine (a remote vLLM
server) send the same requests a transformers run would make (the loaded version's prompt, the
image shrunk to its task's preset) and read the answers the same way (boxes back to the original
image's pixels). Both take those parts from here, and here from the modules the `hunyuan` engine
uses (versions, prompts, resolution, geometry, output), so the three engines cannot drift apart.
No torch: the remote engine runs on CPU-only hosts with the base install.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from PIL import Image

from ocrq.core.settings import ModelSettings
from ocrq.models.base import OcrResult, PreparedImage
from ocrq.models.costs import CostModel, ItemCost
from ocrq.models.hunyuan.generation import Generated
from ocrq.models.hunyuan.geometry import DEFAULT_GEOMETRY, ImageGeometry, item_cost
from ocrq.models.hunyuan.output import result_of
from ocrq.models.hunyuan.prompts import PromptTemplates, prompt_of, rough_prompt_tokens
from ocrq.models.hunyuan.resolution import ModelPixels
from ocrq.models.hunyuan.versions import LATEST, ModelVersion

# Host bytes a waiting image costs these engines beyond its pixels (the request's encoded copy,
# the Python objects around it); the model's memory is vLLM's business, not the planner's.
PER_IMAGE_OVERHEAD = 256 * 1024
LATEST_GEOMETRY = replace(DEFAULT_GEOMETRY, max_pixels=LATEST.max_pixels)
RGB_BYTES = 3  # per pixel of the image as it waits (decoded, shrunk to its preset)


@dataclass
class ServedModel(ModelPixels):
    """The version-specific half of a HunyuanOCR request, for engines that do not run the model
    through ocrq's own code. `templates` (the chat template, with exact token counts) needs the
    checkpoint's processor; without it (the remote engine) prompts are counted roughly and the
    server applies its own chat template."""

    settings: ModelSettings
    version: ModelVersion = LATEST
    geometry: ImageGeometry = LATEST_GEOMETRY
    templates: PromptTemplates | None = None

    @classmethod
    def of_version(cls, settings: ModelSettings, version: ModelVersion) -> ServedModel:
        """A model known by its version alone (its released processor's limits)."""
        return cls(settings, version, replace(DEFAULT_GEOMETRY, max_pixels=version.max_pixels))

    def prompt_for(self, item: PreparedImage) -> str:
        """The instruction for `item` (UnsupportedTask for a name the version lacks)."""
        return prompt_of(item, self.version.prompts, self.version.name)

    def templated(self, item: PreparedImage) -> str:
        """The whole prompt text, image placeholder included, in the checkpoint's template."""
        if self.templates is None:
            raise RuntimeError("no processor loaded: the prompt cannot be templated here")
        return self.templates(self.prompt_for(item))[0]

    def fit(self, item: PreparedImage) -> None:
        """Shrink `item` to the pixels the model will see (its preset), in the prefetch thread:
        the image then waits, and travels, at that size. Raises ImageShapeError for a shape
        the processor refuses, and UnsupportedTask for a task the version lacks."""
        self.prompt_for(item)
        self.geometry.resized(*item.image.size)
        size = self.geometry.shrink_to(*item.image.size, self.view_pixels(item))
        image = item.image if item.image.mode == "RGB" else item.image.convert("RGB")
        if size != image.size:
            image = image.resize(size, Image.Resampling.BICUBIC)
        item.image = image

    def estimate(self, item: PreparedImage) -> ItemCost:
        prompt = self.prompt_for(item)
        if self.templates is not None:
            prompt_tokens = self.templates.prompt_tokens(prompt)
        else:
            prompt_tokens = rough_prompt_tokens(prompt)
        self.geometry.resized(*item.size)
        size = self.geometry.shrink_to(*item.size, self.view_pixels(item))
        return item_cost(
            *size,
            prompt_tokens=prompt_tokens,
            max_new_tokens=self.settings.max_new_tokens,
            geometry=self.geometry,
        )

    def host_cost_model(self) -> CostModel:
        """What a batch costs this process: the images it holds, not the model's memory
        (vLLM preallocates its own, in-process or on a server). `per_patch_bytes` charges the
        pixels a row holds (a patch is 16x16 pixels)."""
        patch_pixels = self.geometry.patch_size**2
        return CostModel(
            fixed_bytes=0,
            per_item_bytes=float(PER_IMAGE_OVERHEAD),
            per_patch_bytes=float(patch_pixels * RGB_BYTES),
        )

    @staticmethod
    def generated(text: str, token_ids: list[int], finish_reason: str | None) -> Generated:
        """A served reply as the `hunyuan` engine's loops report a row: one cut by the token
        cap (vLLM's finish reason "length") says `truncated="max_tokens"`."""
        truncated = "max_tokens" if finish_reason == "length" else None
        return Generated(text=text, token_ids=token_ids, truncated=truncated, prompt_tokens=0)

    def result(self, item: PreparedImage, gen: Generated) -> OcrResult | Exception:
        """The answer parsed as the `hunyuan` engine parses its own (boxes in the original
        image's pixels), or the exception parsing raised (that item fails alone)."""
        return result_of(item, gen, self.version.prompts)

    def describe(self) -> dict[str, Any]:
        return {"version": self.version.name, "max_pixels": str(self.geometry.max_pixels)}
