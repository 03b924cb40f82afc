"""HunyuanOCR on a remote OpenAI-compatible server (`vllm serve`): CPU-only workers in front of
a pool of GPU servers.

Design notes (the why):

* The worker runs no model: it fetches and decodes each image, shrinks it to its task's preset
  and encodes it as PNG in the prefetch thread (`prepare`), then sends one chat completion per
  image, base64 in a data URL, with the loaded version's prompt in Tencent's message shape (an
  empty system message, the image before the instruction) and its decoding (greedy, the
  version's repetition penalty). The server applies the checkpoint's chat template. Answers are
  parsed by the `hunyuan` engine's code (ocrq/models/hunyuan/served.py), boxes mapped back to the
  original image's pixels.
* Which version the server runs cannot be read from here: OCRQ_OPENAI_VERSION says (1.5 by
  default), and OCRQ_MODEL is the served model's name.
* Rows are sent as they come, at most OCRQ_OPENAI_CONCURRENCY in flight per worker, as tasks
  of the client's own event loop; the server batches them with other workers' requests. The
  engine is a streaming one (the batcher's running loop, ocrq/scheduling/streaming.py): each
  row's job is answered the moment its reply is in, so one slow request holds its own job and
  nothing else (with static batches, a batch and the batches behind it waited for its slowest
  request: a dripping server stalled the next jobs 148 s). OCRQ_SCHEDULER=static keeps batches.
  Retries, deadlines and failures are the client's (ocrq/models/openai/client.py): a server
  that is away keeps the jobs waiting, unacked; a request it refuses, or one that passes its
  deadline or byte cap, fails that job alone.
* The memory planned for is this process's (the images it holds); the model's is the server's.
"""

from __future__ import annotations

import base64
import io
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ocrq.core.lanes import DEFAULT_LANES, LaneRule
from ocrq.core.pixel_budget import PixelBudget
from ocrq.core.settings import OpenAISettings
from ocrq.models.base import (
    Engine,
    EngineMisconfigured,
    Finished,
    OcrResult,
    PreparedImage,
    StreamingEngine,
)
from ocrq.models.costs import CostModel, ItemCost
from ocrq.models.hunyuan.served import ServedModel
from ocrq.models.hunyuan.versions import VERSIONS
from ocrq.models.openai.client import ChatClient, Completion
from ocrq.models.slots import RunningBudget

log = logging.getLogger(__name__)
# Said once at start-up: the `hunyuan` engine follows the training code by default; a vLLM
# server (0.32 on, HunYuanVL through its transformers backend) does not, and nothing sent from
# here changes that (docs/hunyuan-numerics.md).
NUMERICS_NOTE = (
    "openai engine: a vLLM server gives image tokens transformers' XD-RoPE layout and ViT "
    "position interpolation, not the trained ones (OCRQ_HUNYUAN_ROPE / "
    "OCRQ_HUNYUAN_VIT_POSITIONS apply to the hunyuan engine only; no request can switch them): "
    "docs/hunyuan-numerics.md"
)


@dataclass(frozen=True)
class EncodedRequest:
    """An image ready to send: its PNG as a data URL (made in the prefetch thread)."""

    data_url: str


# The "loop" of a remote engine holds no KV: rows are limited by the images the worker holds
# (its prefetch cap), so its token pool is set past any row's need.
UNBOUNDED_TOKENS = 2**40
IDLE_POLL_S = 0.05


class OpenAIEngine(Engine, StreamingEngine):
    name = "openai"

    def __init__(self, settings: OpenAISettings) -> None:
        """`settings`: this engine's group (a whole Settings is narrowed to it here)."""
        self.settings = OpenAISettings.of(settings)
        self.served = ServedModel.of_version(self.settings, VERSIONS[self.settings.openai_version])
        self.model_limit = self.served.geometry.max_pixels
        self.client: ChatClient | None = None
        # Rows handed to the running loop: key -> (row, its request or why it was not sent, when)
        self._flight: dict[str, tuple[PreparedImage, Future[Completion] | Exception, float]] = {}

    @classmethod
    def from_settings(cls, settings: OpenAISettings) -> OpenAIEngine:
        return cls(settings)

    def load(self) -> None:
        s = self.settings
        if not s.openai_url:
            raise EngineMisconfigured(
                "OCRQ_OPENAI_URL is not set: the openai engine needs a server URL"
            )
        key = s.openai_api_key.get_secret_value() if s.openai_api_key else None
        self.client = ChatClient(
            s.openai_url,
            key,
            timeout_s=s.openai_timeout_s,
            retry_s=s.openai_retry_s,
            max_connections=s.openai_concurrency,
            max_response_bytes=s.openai_max_response_bytes,
        )
        try:
            served = self.client.models()
        except Exception as exc:  # a server may come up after its workers: jobs will retry
            log.warning("openai engine: %s does not answer yet (%s)", self._where(), exc)
        else:
            if s.model not in served:
                raise EngineMisconfigured(
                    f"{self._where()} does not serve OCRQ_MODEL={s.model!r}; it serves: "
                    f"{', '.join(served) or 'nothing'}"
                )
        log.info(
            "openai engine: HunyuanOCR-%s as %r at %s, %d requests in flight at most",
            self.served.version.name,
            s.model,
            self._where(),
            s.openai_concurrency,
        )
        log.info("%s", NUMERICS_NOTE)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def _where(self) -> str:
        """The server's URL without credentials, for logs."""
        url = urlsplit(self.settings.openai_url or "")
        return f"{url.scheme}://{url.hostname}{f':{url.port}' if url.port else ''}{url.path}"

    def describe(self) -> dict[str, str]:
        return {
            "engine": self.name,
            "model": self.settings.model,
            "server": self._where(),
            "version": self.served.version.name,
            "max_new_tokens": str(self.settings.max_new_tokens),
        }

    def estimate(self, item: PreparedImage) -> ItemCost:
        return self.served.estimate(item)

    def cost_model(self) -> CostModel:
        return self.served.host_cost_model()

    def encode(self, item: PreparedImage) -> EncodedRequest:
        """The image at its preset size as a PNG data URL (lossless: the server sees the
        pixels an in-process engine would)."""
        self.served.fit(item)
        buffer = io.BytesIO()
        item.image.save(buffer, format="PNG")
        return EncodedRequest(
            "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        )

    def pixel_budget(self, task: str, job_cap: int | None) -> PixelBudget:
        """The served model's: the task's preset within its range (a page is drawn at it)."""
        return self.served.pixel_budget(task, job_cap)

    def prepare(self, item: PreparedImage) -> None:
        item.encoded = self.encode(item)

    def body(self, item: PreparedImage, encoded: EncodedRequest) -> dict[str, Any]:
        """The chat completion request for one image."""
        return {
            "model": self.settings.model,
            "messages": [
                {"role": "system", "content": ""},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": encoded.data_url}},
                        {"type": "text", "text": self.served.prompt_for(item)},
                    ],
                },
            ],
            "temperature": 0.0,
            "max_tokens": self.settings.max_new_tokens,
            "repetition_penalty": self.served.version.repetition_penalty,
            "skip_special_tokens": True,
        }

    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        if self.client is None:
            raise RuntimeError("OpenAIEngine.load() must run before run()")
        sent = [self._send(item) for item in batch]
        return [self._answer(item, reply) for item, reply in zip(batch, sent, strict=True)]

    def _send(self, item: PreparedImage) -> Future[Completion] | Exception:
        assert self.client is not None
        try:
            encoded = item.encoded
            if not isinstance(encoded, EncodedRequest):
                encoded = self.encode(item)
            return self.client.submit(self.body(item, encoded))
        except Exception as exc:  # an image or task this version refuses: it fails alone
            return exc

    def _answer(
        self, item: PreparedImage, sent: Future[Completion] | Exception
    ) -> OcrResult | Exception:
        if isinstance(sent, Exception):
            return sent
        try:
            reply = sent.result()
        except Exception as exc:  # refused, or the server stayed away: this image fails
            return exc
        gen = self.served.generated(reply.text, [], reply.finish_reason)
        return self.served.result(item, gen)

    # -- the running loop: rows answered one by one -------------------------------------------

    def streams(self) -> bool:
        return self.settings.scheduler != "static"

    def open(
        self, budget_bytes: int, model: CostModel, lanes: LaneRule = DEFAULT_LANES
    ) -> RunningBudget:
        """Nothing to allocate: the budget is the host's, for the images in flight (sent as the
        batcher hands them over, in its lanes' order: `lanes` adds nothing here)."""
        return RunningBudget(
            slots=self.settings.openai_concurrency,
            pool_tokens=UNBOUNDED_TOKENS,
            prefill_tokens=UNBOUNDED_TOKENS,
            pool_bytes=budget_bytes,
            prefill_bytes=0,
            state_bytes=0,
            decode_fixed_bytes=0,
        )

    def submit(self, rows: Sequence[PreparedImage]) -> None:
        if self.client is None:
            raise RuntimeError("OpenAIEngine.load() must run before submit()")
        for row in rows:
            self._flight[row.key] = (row, self._send(row), time.monotonic())

    def poll(self, timeout_s: float) -> list[Finished]:
        """Rows whose replies are in (or that were never sent), waiting at most `timeout_s`
        for the first."""
        pending = [sent for _, sent, _ in self._flight.values() if isinstance(sent, Future)]
        if len(pending) == len(self._flight):
            if pending:
                wait(pending, timeout_s, return_when=FIRST_COMPLETED)
            else:
                time.sleep(min(timeout_s, IDLE_POLL_S))
        finished = []
        for key, (row, sent, handed) in list(self._flight.items()):
            if isinstance(sent, Future) and not sent.done():
                continue
            del self._flight[key]
            finished.append(Finished(key, None, self._later(row, sent), handed))
        return finished

    def _later(
        self, row: PreparedImage, sent: Future[Completion] | Exception
    ) -> Callable[[], OcrResult]:
        """Parsing the reply, for the batcher's finisher thread."""

        def resolve() -> OcrResult:
            result = self._answer(row, sent)
            if isinstance(result, Exception):
                raise result
            return result

        return resolve

    def reset(self) -> list[str]:
        keys = list(self._flight)
        for _, sent, _ in self._flight.values():
            if isinstance(sent, Future):
                sent.cancel()
        self._flight.clear()
        return keys
