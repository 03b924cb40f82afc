"""Engine names -> engine objects. Imports are lazy so the CPU path never loads torch."""

from __future__ import annotations

from models.base import Engine
from ocrq.settings import Settings

ENGINES = ("rapid", "hunyuan")


def create_engine(name: str, settings: Settings) -> Engine:
    """Build (but do not load) the engine called `name`."""
    if name == "rapid":
        from models.rapid import RapidEngine

        return RapidEngine()
    if name == "hunyuan":
        from models.hunyuan import HunyuanEngine

        return HunyuanEngine.from_settings(settings)
    raise ValueError(f"unknown engine {name!r}; choose one of: {', '.join(ENGINES)}")
