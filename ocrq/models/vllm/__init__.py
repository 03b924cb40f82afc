"""The `vllm` engine: HunyuanOCR on an in-process vLLM (see engine.py). Importing this package
imports no vLLM; `VllmEngine.load` does."""

from ocrq.models.vllm.engine import VllmEngine

__all__ = ["VllmEngine"]
