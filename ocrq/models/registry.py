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

    return RapidEngine(
        models=settings.rapid.rapid_models,
        latin_punctuation=settings.rapid.rapid_latin_punctuation,
    )


def _hunyuan(settings: Settings) -> Engine:
    """The running loop's engine where OCRQ_SCHEDULER sends the rows through it (`runs_loop`),
    the static engine elsewhere: the one place that asks."""
    from ocrq.models.hunyuan import HunyuanEngine, HunyuanLoopEngine, runs_loop

    group = settings.hunyuan
    return HunyuanLoopEngine(group) if runs_loop(group) else HunyuanEngine(group)


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


def task_refusal(name: str, task: str) -> str | None:
    """Why engine `name` can never do `task`, or None. Asked before any work starts: `ocrq run
    --task "describe this image"` loaded rapid and then failed every image with the reason.
    Only rapid's tasks are fixed; a VLM's depend on the model it loads and fail per job."""
    if name != "rapid":
        return None
    from ocrq.models.rapid.engine import SUPPORTED_TASKS, unsupported_task

    return None if task in SUPPORTED_TASKS else str(unsupported_task(task))


def create_engine(name: str, settings: Settings) -> Engine:
    """Build (but do not load) the engine called `name`."""
    factory = ENGINES.get(name)
    if factory is None:
        raise ValueError(f"unknown engine {name!r}; choose one of: {', '.join(ENGINES)}")
    return factory(settings)
