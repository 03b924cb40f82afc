"""The vLLM engines' pure parts, without vLLM: settings -> vLLM arguments, the remote client's
retry rule against a real local HTTP server, the request an image becomes."""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from ocrq.core.settings import Settings
from ocrq.models.base import PreparedImage
from ocrq.models.costs import GiB
from ocrq.models.hunyuan.geometry import DEFAULT_GEOMETRY
from ocrq.models.hunyuan.prompts import PROMPTS_1_0, PROMPTS_1_5
from ocrq.models.hunyuan.served import ServedModel
from ocrq.models.hunyuan.versions import V1_5
from ocrq.models.openai import OpenAIEngine
from ocrq.models.openai.client import (
    ChatClient,
    RequestRefused,
    ServerUnavailable,
    backoff_s,
)
from ocrq.models.registry import ENGINES
from ocrq.models.vllm.options import engine_args, max_model_len, memory_args
from tests.servers import free_port


def test_both_engines_are_registered() -> None:
    assert {"vllm", "openai"} <= set(ENGINES)
    assert ENGINES["openai"](Settings(openai_url="http://x/v1")).name == "openai"
    assert ENGINES["vllm"](Settings()).name == "vllm"  # builds without vLLM installed


def test_budget_becomes_vllms_memory_knobs() -> None:
    s = Settings(memory_budget_gib=2, memory_utilization=0.5)
    assert memory_args(s, "cpu", None) == {"kv_cache_memory_bytes": 1 * GiB}
    assert memory_args(Settings(), "cpu", None) == {}  # vLLM's own default share
    share = memory_args(Settings(memory_budget_gib=35), "cuda", 140 * GiB)
    assert share == {"gpu_memory_utilization": 0.25}
    assert memory_args(Settings(memory_utilization=0.7), "cuda", 140 * GiB) == {
        "gpu_memory_utilization": 0.7
    }
    with pytest.raises(ValueError, match="at most 98%"):
        memory_args(Settings(memory_budget_gib=139), "cuda", 140 * GiB)


def test_engine_args_from_settings(tmp_path: Path) -> None:
    s = Settings(vllm_max_num_seqs=64, vllm_max_num_batched_tokens=8192, dtype="float32")
    geometry = DEFAULT_GEOMETRY
    cpu = engine_args(s, tmp_path, geometry, "cpu")
    assert cpu["model"] == str(tmp_path) and cpu["dtype"] == "float32"
    assert cpu["max_num_seqs"] == 64 and cpu["max_num_batched_tokens"] == 8192
    assert cpu["limit_mm_per_prompt"] == {"image": 1}
    assert cpu["enforce_eager"] is True
    gpu = engine_args(s, tmp_path, geometry, "cuda", 80 * GiB)
    assert gpu["enforce_eager"] is False and gpu["gpu_memory_utilization"] == 0.85


def test_max_model_len_covers_the_longest_row() -> None:
    s = Settings(max_new_tokens=1024)
    geometry = ServedModel.of_version(s, V1_5).geometry
    length = max_model_len(s, geometry)
    # A square page at 1.5's limit is 16,384 + 64 + 2 image tokens; a tall strip more.
    assert length >= geometry.image_tokens(4096, 4096) + 4000 + 1024
    assert length < 40_000  # not the checkpoint's 131072
    assert max_model_len(Settings(vllm_max_model_len=512), geometry) == 512


def test_backoff_doubles_to_a_cap_with_jitter() -> None:
    import random

    rng = random.Random(0)
    waits = [backoff_s(a, rng) for a in range(1, 10)]
    assert 0.5 <= waits[0] <= 0.625 and 1.0 <= waits[1] <= 1.25
    assert all(10.0 <= w <= 12.5 for w in waits[5:])


class _Server:
    """A real HTTP server on loopback answering POSTs with a scripted list of (status, body)."""

    def __init__(self, script: list[tuple[int, dict]]) -> None:
        self.script = script
        self.requests: list[dict] = []
        self.headers: list[dict[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                owner.headers.append(dict(self.headers))
                status, reply = owner.script[min(len(owner.requests), len(owner.script)) - 1]
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


OK = {"choices": [{"message": {"content": "HELLO"}, "finish_reason": "stop"}], "usage": {}}


@pytest.fixture
def sleeps() -> Iterator[list[float]]:
    yield []


def _client(url: str, sleeps: list[float], retry_s: float = 60) -> ChatClient:
    return ChatClient(
        url, "k" * 20, timeout_s=5, retry_s=retry_s, max_connections=2, sleep=sleeps.append
    )


def test_5xx_and_429_are_retried_until_an_answer(sleeps: list[float]) -> None:
    script = [(503, {"message": "starting"}), (429, {}), (500, {}), (200, OK)]
    with _Server(script) as srv:
        reply = _client(srv.url, sleeps).complete({"model": "m"})
    assert reply.text == "HELLO" and reply.finish_reason == "stop"
    assert len(srv.requests) == 4 and len(sleeps) == 3
    assert srv.headers[0]["Authorization"] == "Bearer " + "k" * 20


def test_4xx_is_refused_at_once(sleeps: list[float]) -> None:
    script = [(400, {"error": {"message": "prompt is longer than the maximum model length"}})]
    with _Server(script) as srv, pytest.raises(RequestRefused, match="HTTP 400: prompt is longer"):
        _client(srv.url, sleeps).complete({"model": "m"})
    assert len(srv.requests) == 1 and sleeps == []


def test_a_server_that_stays_away_fails_after_the_window(sleeps: list[float]) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens
    client = _client(url, sleeps, retry_s=0)
    with pytest.raises(ServerUnavailable, match=r"failed 1 times.*ConnectError"):
        client.complete({"model": "m"})


def test_request_carries_the_versions_prompt_and_decoding() -> None:
    engine = OpenAIEngine(Settings(openai_url="http://x/v1", model="served", max_new_tokens=77))
    image = Image.new("RGB", (5000, 3000), "white")
    item = PreparedImage("k", image, image.size, task="parse")
    engine.prepare(item)
    body = engine.body(item, item.encoded)  # type: ignore[arg-type]
    assert body["model"] == "served" and body["max_tokens"] == 77
    assert body["temperature"] == 0.0 and body["repetition_penalty"] == 1.08
    system, user = body["messages"]
    assert system == {"role": "system", "content": ""}
    image_part, text_part = user["content"]
    assert text_part == {"type": "text", "text": PROMPTS_1_5["parse"]}
    url = image_part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    sent = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    # Shrunk to the parse preset (1536² pixels) in prepare, the size an in-process engine sees.
    assert sent.size == item.image.size and sent.size[0] * sent.size[1] <= 1536 * 1536
    v10 = OpenAIEngine(Settings(openai_url="http://x/v1", openai_version="1.0"))
    item10 = PreparedImage("k", Image.new("RGB", (64, 64)), (64, 64), task="parse")
    v10.prepare(item10)
    assert (
        v10.body(item10, item10.encoded)["messages"][1]["content"][1]["text"]
        == (  # type: ignore[arg-type]
            PROMPTS_1_0["parse"]
        )
    )
    assert v10.body(item10, item10.encoded)["repetition_penalty"] == 1.0  # type: ignore[arg-type]


def test_openai_engine_needs_a_url() -> None:
    with pytest.raises(ValueError, match="OCRQ_OPENAI_URL"):
        OpenAIEngine(Settings()).load()
