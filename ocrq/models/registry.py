"""Engine names -> factories: adding an engine is one entry here (docs/engines.md).

A plain mapping of functions that import their engine when called, so the CPU path never loads
torch and an engine's optional dependencies are needed only where it runs. Each factory hands
its engine that engine's own settings group (`settings.hunyuan`, ...), never the whole Settings:
an engine cannot come to depend on the api's, the broker's or another engine's settings.
"""

from __future__ import annotations

from collections.abc import Callable

from ocrq.core.settings import Settings
from ocrq.models.base import Engine


def _rapid(settings: Settings) -> Engine:
    from ocrq.models.rapid import RapidEngine

    return RapidEngine()  # no settings of its own


def _hunyuan(settings: Settings) -> Engine:
    from ocrq.models.hunyuan import HunyuanEngine

    return HunyuanEngine(settings.hunyuan)


def _vllm(settings: Settings) -> Engine:
    from ocrq.models.vllm import VllmEngine

    return VllmEngine(settings.vllm)


def _openai(settings: Settings) -> Engine:
    from ocrq.models.openai import OpenAIEngine

    return OpenAIEngine(settings.openai)


ENGINES: dict[str, Callable[[Settings], Engine]] = {
    "rapid": _rapid,
    "hunyuan": _hunyuan,
    "vllm": _vllm,
    "openai": _openai,
}


def create_engine(name: str, settings: Settings) -> Engine:
    """Build (but do not load) the engine called `name`."""
    factory = ENGINES.get(name)
    if factory is None:
        raise ValueError(f"unknown engine {name!r}; choose one of: {', '.join(ENGINES)}")
    return factory(settings)
