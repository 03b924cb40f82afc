"""One chat completion per image against an OpenAI-compatible server, retried while the server
is away.

Why httpx and not the `openai` SDK: ocrq already depends on httpx (URL fetching), the request
is one POST whose body ocrq builds anyway (vLLM's extra sampling fields, such as
`repetition_penalty`, are not in the SDK's signature), and the retry rule here is ocrq's own
(the SDK retries too, on its own schedule, which would stack with this one).

The rule: connection errors, timeouts and 5xx answers (the server restarting, overloaded or
dead), and 408/429 (it asks to be tried later), are retried with exponential backoff until
`retry_s` has passed since the first attempt; meanwhile the job waits in its task thread and
its message stays unacked, so nothing is lost if the worker dies too. Any other 4xx means the
server refuses this request (an image it cannot take, a prompt too long, a wrong model name):
that job fails at once with the server's own message, and the worker goes on.

Bounds on a hostile or broken server (issue 31's probe): each attempt has one deadline,
`timeout_s` from sending to the answer's last byte (httpx's own timeouts are per read, so a
server dripping a byte every 2 s held a job 219 s); an answer is read in chunks up to
`max_response_bytes` and refused past it (a 2 GiB answer was read until MemoryError). The
deadline is asyncio's cancellation, the way httpx documents a total timeout: the requests of a
worker run as tasks of one event loop on a thread of this client, each in flight independently
(at most `max_connections`), and a cancelled or refused one closes its connection, so no
leftover bytes can be read as the next answer.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429})
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
ERROR_EXCERPT = 500  # characters of a refusal's body kept in the job's error
CHUNK = 65536
T = TypeVar("T")


class RequestRefused(RuntimeError):
    """The server answered 4xx: this request will not succeed by trying again."""


class ServerUnavailable(RuntimeError):
    """The server kept failing (connection, timeout, 5xx) for the whole retry window."""


class AnswerTooLarge(RequestRefused):
    """The answer passed the byte cap: sent again it would be as large, so not retried."""


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str | None
    completion_tokens: int


def backoff_s(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds before retry `attempt` (1, 2, ...): doubling from 0.5 s up to 10 s, with up to
    25% jitter so that a fleet of workers does not hit a restarted server in step."""
    base = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (attempt - 1))
    return base * (1 + 0.25 * (rng or random).random())


class ChatClient:
    """Thread-safe: callers in any thread; the requests run on this client's own event loop."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        timeout_s: float,
        retry_s: float,
        max_connections: int,
        max_response_bytes: int = 16 * 2**20,
        sleep: Callable[[float], Any] | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Compressed answers would make the byte cap count the wire, not the memory.
        headers["Accept-Encoding"] = "identity"
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.max_response_bytes = max_response_bytes
        self._sleep = sleep or asyncio.sleep
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="ocrq-openai-http", daemon=True
        )
        self._thread.start()
        self._slots = asyncio.Semaphore(max_connections)

        async def make() -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=self.base_url,
                headers=headers,
                timeout=httpx.Timeout(timeout_s),
                limits=httpx.Limits(max_connections=max_connections),
                trust_env=False,  # the server's URL is the setting's, never a proxy's
            )

        self.http = self._call(make())

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self.http.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def models(self, timeout_s: float = 5.0) -> list[str]:
        """The model names the server serves (GET /models); raises when it does not answer."""

        async def ask() -> list[str]:
            async with asyncio.timeout(timeout_s):
                status, data = await self._json_of("GET", "/models", None, timeout_s)
            if status >= 400:
                raise RuntimeError(f"GET /models: HTTP {status}: {_excerpt(data)}")
            answer = _parsed(data)
            listed = answer.get("data", []) if isinstance(answer, dict) else []
            return [m.get("id", "") for m in listed if isinstance(m, dict)]

        return self._call(ask())

    def submit(self, body: dict[str, Any]) -> Future[Completion]:
        """`complete(body)` in flight on the client's loop; its future."""
        return asyncio.run_coroutine_threadsafe(self.acomplete(body), self._loop)

    def complete(self, body: dict[str, Any]) -> Completion:
        """POST /chat/completions, retried as the module docstring says."""
        return self.submit(body).result()

    async def acomplete(self, body: dict[str, Any]) -> Completion:
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                async with self._slots:  # the deadline starts once a connection is ours
                    async with asyncio.timeout(self.timeout_s):
                        status, data = await self._json_of(
                            "POST", "/chat/completions", body, self.timeout_s
                        )
            except TimeoutError:
                problem = f"no whole answer within {self.timeout_s:g} s (OCRQ_OPENAI_TIMEOUT_S)"
            except httpx.TransportError as exc:  # refused, reset, timed out
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if status < 400:
                    return _completion(data)
                problem = f"HTTP {status}: {_excerpt(data)}"
                if status < 500 and status not in RETRY_STATUS:
                    raise RequestRefused(f"server refused the request ({problem})")
            waited = time.monotonic() - started
            pause = backoff_s(attempt)
            if waited + pause > self.retry_s:
                raise ServerUnavailable(
                    f"{self.base_url} failed {attempt} times over {waited:.0f} s "
                    f"(OCRQ_OPENAI_RETRY_S={self.retry_s:g}); last: {problem}"
                )
            log.warning("%s: %s; retry %d in %.1f s", self.base_url, problem, attempt, pause)
            slept = self._sleep(pause)
            if inspect.isawaitable(slept):
                await slept

    async def _json_of(
        self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float
    ) -> tuple[int, bytes]:
        """The status and body of one request, the body read up to the byte cap. The response
        is closed however this ends; one not read to its end closes its connection with it."""
        request = self.http.build_request(method, path, json=body, timeout=timeout_s)
        reply = await self.http.send(request, stream=True)
        try:
            declared = reply.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_response_bytes:
                raise AnswerTooLarge(self._too_large(int(declared)))
            chunks: list[bytes] = []
            size = 0
            async for chunk in reply.aiter_bytes(CHUNK):
                size += len(chunk)
                if size > self.max_response_bytes:
                    raise AnswerTooLarge(self._too_large(size))
                chunks.append(chunk)
            return reply.status_code, b"".join(chunks)
        finally:
            await reply.aclose()

    def _too_large(self, size: int) -> str:
        return (
            f"server answered with more than {self.max_response_bytes} bytes ({size} seen; "
            "OCRQ_OPENAI_MAX_RESPONSE_BYTES)"
        )


def _parsed(data: bytes) -> Any:
    return json.loads(data)


def _completion(raw: bytes) -> Completion:
    try:
        data = _parsed(raw)
        choice = data["choices"][0]
        text = choice["message"]["content"] or ""
        if not isinstance(text, str):
            raise TypeError("content is not text")
        usage = data.get("usage") or {}
        tokens = int(usage.get("completion_tokens") or 0)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise RequestRefused(f"server answered without a completion: {_excerpt(raw)}") from exc
    return Completion(text, choice.get("finish_reason"), tokens)


def _excerpt(raw: bytes) -> str:
    """The server's error message (OpenAI's {"error": {"message"}} or vLLM's {"message"}),
    else the start of its body."""
    try:
        data = _parsed(raw)
        error = data.get("error", data) if isinstance(data, dict) else data
        message = error.get("message") if isinstance(error, dict) else None
        text = str(message or data)
    except ValueError:
        text = raw[: ERROR_EXCERPT * 4].decode("utf-8", "replace")
    return text[:ERROR_EXCERPT]
