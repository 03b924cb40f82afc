"""Settings: bounds on every numeric knob, OCRQ_* read once, worker options passed explicitly."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

import pytest
from pydantic import ValidationError

from ocrq.cli import ENGINE_HELP
from ocrq.core import metrics
from ocrq.core.settings import Settings
from ocrq.worker.supervisor import child_env
from tests.servers import free_port


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_batch", 0),
        ("batch_wait_ms", -1),
        ("memory_budget_gib", 0),
        ("memory_utilization", 1.5),
        ("concurrency", 0),
        ("prefetch_images", 0),
        ("visibility_timeout_s", 0),
        ("max_images", 0),
        ("max_rss_gib", -1),
        ("max_fragmentation_gib", 0),
        ("recycle_patience", 0),
        ("metrics_port", 0),
        ("metrics_port", 65_536),
        ("max_new_tokens", 0),
        ("decode", "beam"),
        ("decode_attention", "flash"),
        ("gpus", "first"),
        ("gpus", "0,0"),
        ("gpus", "-1"),
    ],
)
def test_out_of_bounds_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        Settings(**{field: value})


def test_decode_options_are_typed_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OCRQ_DECODE", "generate")
    monkeypatch.setenv("OCRQ_DECODE_ATTENTION", "torch")
    s = Settings()
    assert (s.decode, s.decode_attention) == ("generate", "torch")
    monkeypatch.delenv("OCRQ_DECODE")
    monkeypatch.delenv("OCRQ_DECODE_ATTENTION")
    assert (Settings().decode, Settings().decode_attention) == ("fast", "auto")


def test_worker_options_reach_the_child_without_touching_our_environment() -> None:
    before = dict(os.environ)
    given = {"engine": "hunyuan", "queue": "pages", "max_images": 7, "concurrency": None}
    env = child_env(os.environ, given)
    assert dict(os.environ) == before
    given = {"OCRQ_ENGINE": "hunyuan", "OCRQ_QUEUE": "pages", "OCRQ_MAX_IMAGES": "7"}
    assert env == {**before, **given}  # options not given are not set
    assert "rapid" in ENGINE_HELP and "hunyuan" in ENGINE_HELP  # from the registry


def test_monitor_serves_metrics_and_probes_from_a_registry() -> None:
    """In-process (`--no-supervise`): /metrics from the registry, /healthz and /readyz from its
    health gauges, 404 elsewhere."""
    from prometheus_client import REGISTRY

    from ocrq.worker import monitor

    port = free_port()
    monitor.serve(monitor.Monitor(REGISTRY, Settings()), port, "127.0.0.1")
    metrics.OOM_EVENTS.inc(0)
    base = f"http://127.0.0.1:{port}"
    body = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    assert "ocrq_oom_events_total" in body and "ocrq_batch_deferred_images" in body
    assert urllib.request.urlopen(f"{base}/healthz", timeout=5).status == 200  # starting
    for path, code in (("/readyz", 503), ("/nothing", 404)):  # no engine loaded here
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(base + path, timeout=5)
        assert caught.value.code == code
