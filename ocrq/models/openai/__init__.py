"""The `openai` engine: HunyuanOCR on a remote OpenAI-compatible server (see engine.py); needs
nothing beyond ocrq's base install (httpx)."""

from ocrq.models.openai.engine import OpenAIEngine

__all__ = ["OpenAIEngine"]
