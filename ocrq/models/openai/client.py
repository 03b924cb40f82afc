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
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429})
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
ERROR_EXCERPT = 500  # characters of a refusal's body kept in the job's error


class RequestRefused(RuntimeError):
    """The server answered 4xx: this request will not succeed by trying again."""


class ServerUnavailable(RuntimeError):
    """The server kept failing (connection, timeout, 5xx) for the whole retry window."""


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
    """Thread-safe: one httpx.Client (its connection pool sized to the concurrency cap)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        timeout_s: float,
        retry_s: float,
        max_connections: int,
        sleep: Any = time.sleep,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.retry_s = retry_s
        self._sleep = sleep
        self.http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=max_connections),
            trust_env=False,  # the server's URL is the setting's, never a proxy's
        )

    def close(self) -> None:
        self.http.close()

    def models(self, timeout_s: float = 5.0) -> list[str]:
        """The model names the server serves (GET /models); raises when it does not answer."""
        reply = self.http.get("/models", timeout=timeout_s)
        reply.raise_for_status()
        return [m.get("id", "") for m in reply.json().get("data", [])]

    def complete(self, body: dict[str, Any]) -> Completion:
        """POST /chat/completions, retried as the module docstring says."""
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                reply = self.http.post("/chat/completions", json=body)
            except httpx.TransportError as exc:  # refused, reset, timed out
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if reply.status_code < 400:
                    return _completion(reply)
                problem = f"HTTP {reply.status_code}: {_excerpt(reply)}"
                if reply.status_code < 500 and reply.status_code not in RETRY_STATUS:
                    raise RequestRefused(f"server refused the request ({problem})")
            waited = time.monotonic() - started
            pause = backoff_s(attempt)
            if waited + pause > self.retry_s:
                raise ServerUnavailable(
                    f"{self.base_url} failed {attempt} times over {waited:.0f} s "
                    f"(OCRQ_OPENAI_RETRY_S={self.retry_s:g}); last: {problem}"
                )
            log.warning("%s: %s; retry %d in %.1f s", self.base_url, problem, attempt, pause)
            self._sleep(pause)


def _completion(reply: httpx.Response) -> Completion:
    try:
        data = reply.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] or ""
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise RequestRefused(f"server answered without a completion: {_excerpt(reply)}") from exc
    usage = data.get("usage") or {}
    return Completion(text, choice.get("finish_reason"), int(usage.get("completion_tokens") or 0))


def _excerpt(reply: httpx.Response) -> str:
    """The server's error message (OpenAI's {"error": {"message"}} or vLLM's {"message"}),
    else the start of its body."""
    try:
        data = reply.json()
        error = data.get("error", data) if isinstance(data, dict) else data
        message = error.get("message") if isinstance(error, dict) else None
        text = str(message or data)
    except ValueError:
        text = reply.text
    return text[:ERROR_EXCERPT]
