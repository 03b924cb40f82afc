"""Settings: bounds on every numeric knob, OCRQ_* read once, worker options passed explicitly."""

from __future__ import annotations

import inspect
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

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


# Every OCRQ_* variable of the flat Settings before it was declared as groups (issue 28): its
# field, default, type and bounds, written from that class. A rename or a changed default shows
# here as a diff.
BEFORE_GROUPS = Path(__file__).with_name("settings_env_names.json")


def _names_fields_defaults() -> dict[str, dict[str, object]]:
    prefix = Settings.model_config["env_prefix"]
    out: dict[str, dict[str, object]] = {}
    for name, info in Settings.model_fields.items():
        assert info.alias is None and info.validation_alias is None, name  # env name = field
        default = info.default_factory() if info.default_factory else info.default  # type: ignore[call-arg]
        out[(prefix + name).upper()] = {
            "field": name,
            "default": json.loads(json.dumps(default, default=str)),
            "annotation": repr(info.annotation),
            "metadata": [repr(m) for m in info.metadata],
        }
    return out


def test_every_ocrq_name_maps_to_the_same_field_and_default_as_before_the_groups() -> None:
    """Each of the 98 variables the flat class had: same field, default, type and bounds. Fields
    added since are not in the record (they have no "before")."""
    before = json.loads(BEFORE_GROUPS.read_text(encoding="utf-8"))
    assert len(before) == 98
    now = _names_fields_defaults()
    assert {name: now.get(name) for name in before} == before


def test_each_field_is_declared_in_exactly_one_group() -> None:
    """The groups partition Settings: a field declared twice would have two defaults. Every
    group is importable from ocrq.core.settings, wherever it is declared."""
    from ocrq.core import settings as module
    from ocrq.core.settings import SettingsGroup

    groups = [
        cls for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, SettingsGroup) and cls is not Settings
    ]
    declared: dict[str, str] = {}
    for cls in groups:
        for name in inspect.get_annotations(cls):
            assert name not in declared, f"{name} in {cls.__name__} and {declared[name]}"
            declared[name] = cls.__name__
    assert set(declared) == set(Settings.model_fields)


# The lab levers (ocrq/core/settings_lab.py): knobs for experiments and benches, listed apart in
# docs/settings.md. A lever moved in or out of the lab is a choice to make here too.
LAB_LEVERS = {
    "attention", "hunyuan_rope", "hunyuan_vit_positions", "decode", "decode_attention",
    "vision_attention", "vision_gemm_dtype", "prefill_attention", "kv_cache_dtype",
    "kv_fp8_products", "preprocess", "prefill_schedule", "prefill_tokens", "prefill_gap_steps",
    "prefill_packed", "prefill_stream", "interactive_pass_steps", "interactive_prefill_tokens",
    "interactive_prefill_gap_steps", "interactive_bulk_rows", "switch_interval_ms",
    "loop_fused_step_rows", "loop_min_bucket",
}


def test_the_lab_levers_are_a_group_of_their_own_that_the_engine_still_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`LabSettings` holds the lab levers and no operator's group declares one; HunyuanOCR's
    group inherits its own levers, so the engine built from that group reads them as before."""
    from ocrq.core import settings as module
    from ocrq.core.settings import HunyuanSettings, LabSettings, SettingsGroup

    assert set(LabSettings.model_fields) == LAB_LEVERS
    operator = [
        cls for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, SettingsGroup) and "Lab" not in cls.__name__
    ]
    assert len(operator) >= 11
    for cls in operator:
        assert not LAB_LEVERS & set(inspect.get_annotations(cls)), cls.__name__
    monkeypatch.setenv("OCRQ_PREFILL_STREAM", "true")
    monkeypatch.setenv("OCRQ_SWITCH_INTERVAL_MS", "0.5")
    settings = Settings()
    assert settings.prefill_stream and settings.lab.prefill_stream
    assert settings.hunyuan.prefill_stream and settings.lab.switch_interval_ms == 0.5
    assert set(LabSettings.model_fields) - {"switch_interval_ms"} <= set(
        HunyuanSettings.model_fields
    )
    with pytest.raises(ValidationError, match="prefill_gap_steps"):
        LabSettings(prefill_gap_steps=0)


@pytest.mark.parametrize("value", ["-1", "17"])
def test_the_fused_step_lever_refuses_rows_the_fused_step_cannot_serve(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """OCRQ_LOOP_FUSED_STEP_ROWS: 0 (off) to 16, the fused step's rows at most; the error names
    the setting and the bound."""
    monkeypatch.setenv("OCRQ_LOOP_FUSED_STEP_ROWS", value)
    bound = "greater than or equal to 0" if value == "-1" else "less than or equal to 16"
    with pytest.raises(ValidationError, match=f"(?s)loop_fused_step_rows.*{bound}"):
        Settings()
    assert Settings(loop_fused_step_rows=16).loop_fused_step_rows == 16
    monkeypatch.delenv("OCRQ_LOOP_FUSED_STEP_ROWS")
    assert Settings().loop_fused_step_rows == 0  # off by default


@pytest.mark.parametrize(
    "variable, value, group, expected",
    [
        ("OCRQ_MAX_IMAGE_SIDE", "123", "intake", 123),
        ("OCRQ_BATCH_WAIT_MS", "7", "batching", 7),
        ("OCRQ_HEARTBEAT_S", "1.5", "delivery", 1.5),
        ("OCRQ_API_MAX_WAIT_S", "3", "api", 3.0),
        ("OCRQ_PREFILL_GAP_STEPS", "9", "hunyuan", 9),
        ("OCRQ_PREFILL_GAP_STEPS", "9", "lab", 9),
        ("OCRQ_LOOP_FUSED_STEP_ROWS", "8", "hunyuan", 8),
        ("OCRQ_LOOP_FUSED_STEP_ROWS", "8", "lab", 8),
        ("OCRQ_VLLM_MAX_NUM_SEQS", "5", "vllm", 5),
        ("OCRQ_OPENAI_CONCURRENCY", "4", "openai", 4),
        ("OCRQ_DATABASE_POOL_SIZE", "3", "service", 3),
        ("OCRQ_TASK_MAX_PIXELS", "parse=1000000", "hunyuan", {"parse": 1_000_000}),
    ],
)
def test_a_variable_reaches_its_flat_field_and_its_group(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, group: str, expected: object
) -> None:
    monkeypatch.setenv(variable, value)
    field = variable.removeprefix("OCRQ_").lower()
    settings = Settings()
    assert getattr(settings, field) == expected
    assert getattr(getattr(settings, group), field) == expected


def test_the_budget_and_the_model_reach_every_engine_group_and_nothing_else_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine's group holds the model, the batch cap and the memory budget (declared once,
    inherited), never the api's token, the broker or another engine's knobs."""
    monkeypatch.setenv("OCRQ_MAX_BATCH", "12")
    monkeypatch.setenv("OCRQ_MODEL", "some/model")
    settings = Settings(api_token="t0ken", openai_url="http://x/v1")
    for view in (settings.hunyuan, settings.vllm, settings.openai):
        assert (view.max_batch, view.model) == (12, "some/model")
        assert not {"api_token", "broker_url", "webhook_secret"} & set(type(view).model_fields)
    assert settings.batching.max_batch == 12
    assert "openai_url" not in type(settings.hunyuan).model_fields
    assert "prefill_tokens" not in type(settings.openai).model_fields


def test_a_view_is_a_copy_of_validated_values() -> None:
    settings = Settings(max_new_tokens=64)
    view = settings.hunyuan
    view.max_new_tokens = 8
    assert settings.max_new_tokens == 64 and settings.hunyuan.max_new_tokens == 64


def test_groups_validate_on_their_own() -> None:
    """A group built directly (a test, a bench) is checked like Settings."""
    from ocrq.core.settings import DeliverySettings, HunyuanSettings

    with pytest.raises(ValidationError, match="unknown tasks"):
        HunyuanSettings(task_max_pixels="nosuchtask=1000000")
    with pytest.raises(ValidationError, match="three"):
        DeliverySettings(heartbeat_s=30, stalled_after_s=60)
    assert HunyuanSettings(max_new_tokens=5).max_new_tokens == 5


def test_the_registry_gives_each_engine_its_own_group_only() -> None:
    """An engine built by the registry (as a worker builds it) holds its group, not Settings;
    a whole Settings handed to an engine directly (tests, benches) is narrowed the same way."""
    from ocrq.core.settings import HunyuanSettings, OpenAISettings, VllmSettings
    from ocrq.models.hunyuan import HunyuanEngine
    from ocrq.models.registry import create_engine

    settings = Settings(api_token="t0ken", openai_url="http://x/v1", max_new_tokens=33)
    for name, group in (("hunyuan", HunyuanSettings), ("vllm", VllmSettings),
                        ("openai", OpenAISettings)):
        engine = create_engine(name, settings)
        own = engine.settings  # type: ignore[attr-defined]
        assert type(own) is group, name
        assert own.max_new_tokens == 33 and not hasattr(own, "api_token"), name
    assert type(HunyuanEngine(settings).settings) is HunyuanSettings
    assert not hasattr(create_engine("rapid", settings), "settings")


def test_the_tuned_knee_reaches_the_engine_group_unless_max_batch_is_set() -> None:
    """`load_engine` hands a tuned profile's knee to the engine: its group is a copy, so setting
    it on Settings alone would not size HunyuanOCR's running loop (the slots `open` reads)."""
    from ocrq.models.hunyuan import HunyuanLoopEngine

    engine = HunyuanLoopEngine(Settings())
    engine.take_tuned_max_batch(96)
    assert engine.settings.max_batch == 96
    fixed = HunyuanLoopEngine(Settings(max_batch=8))
    fixed.take_tuned_max_batch(96)
    assert fixed.settings.max_batch == 8  # an explicit OCRQ_MAX_BATCH wins


def test_every_list_setting_takes_a_comma_separated_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A variable of a list or mapping field is split by its group's validator: the one for
    OCRQ_LINK_TASKS was lost when the fields moved into groups, and `ocrq cancel` refused to
    start with "Input should be a valid list" while every recorded name and default matched."""
    from ocrq.core.settings import Settings

    monkeypatch.setenv("OCRQ_LINK_TASKS", "cbtest.*, other.task")
    monkeypatch.setenv("OCRQ_ALLOWED_ROOTS", f"/data{os.pathsep}/srv")  # a path list
    monkeypatch.setenv("OCRQ_IMAGE_FORMATS", "PNG,JPEG")
    monkeypatch.setenv("OCRQ_URL_ALLOW_NETWORKS", "10.0.0.0/8,192.168.1.0/24")
    monkeypatch.setenv("OCRQ_TASK_MAX_PIXELS", "text=1000000,parse=2000000")
    s = Settings(_env_file=None)
    assert s.link_tasks == ["cbtest.*", "other.task"]
    assert [str(p) for p in s.allowed_roots] == ["/data", "/srv"]
    assert len(s.image_formats) == 2 and len(s.url_allow_networks) == 2
    assert s.task_max_pixels == {"text": 1000000, "parse": 2000000}
    assert s.delivery.link_tasks == s.link_tasks  # the group view parses the same


def _default(name: str) -> object:
    info = Settings.model_fields[name]
    return info.default_factory() if info.default_factory else info.default  # type: ignore[call-arg]


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
@pytest.mark.parametrize("empty", ["", "  "])
def test_each_setting_given_empty_means_its_default_or_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, name: str, empty: str
) -> None:
    """`OCRQ_X=` means what unset means (docs/settings.md): the default, nothing wider. Before,
    `OCRQ_UPLOAD_DIR=` was Path("") (the working directory, then an allowed root) and
    `OCRQ_MAX_BATCH=`, `OCRQ_METRICS_PORT=` or `OCRQ_PDF_DPI=` stopped every command with 78.
    The two secrets are refused empty, naming the variable: a forgeable webhook key, an api
    token that is none."""
    from ocrq.core.problems import infrastructure_problem
    from ocrq.core.settings import EMPTY_REFUSED

    variable = f"OCRQ_{name.upper()}"
    monkeypatch.setenv(variable, empty)
    if name in EMPTY_REFUSED:
        with pytest.raises(ValidationError) as refused:
            Settings(_env_file=None)
        problem = infrastructure_problem(refused.value)
        assert problem is not None and f"{variable} is empty: " in problem.message
        return
    assert getattr(Settings(_env_file=None), name) == _default(name)


def test_an_empty_webhook_secret_stops_the_worker_naming_it(tmp_path: Path) -> None:
    """It signed every webhook with the key b"" (issue 52): anyone could forge one. Given in
    code (embedded mode) it is refused the same."""
    import subprocess

    from pydantic import SecretStr

    from tests.conftest import BIN

    env = {**os.environ, "OCRQ_WEBHOOK_SECRET": "", "OCRQ_ALLOWED_ROOTS": str(tmp_path)}
    worker = subprocess.run(
        [str(BIN / "ocrq"), "worker", "--no-supervise"], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert worker.returncode == 78, worker.stderr[-2000:]
    assert "OCRQ_WEBHOOK_SECRET is empty: webhooks would be signed with an empty key" in (
        worker.stderr
    )
    with pytest.raises(ValidationError, match="OCRQ_WEBHOOK_SECRET is empty"):
        Settings(_env_file=None, webhook_secret=SecretStr(" "))


def test_an_empty_upload_dir_adds_no_root_and_no_roots_is_still_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OCRQ_UPLOAD_DIR", "")
    monkeypatch.delenv("OCRQ_ALLOWED_ROOTS", raising=False)
    monkeypatch.delenv("OCRQ_ALLOW_ANY_PATH", raising=False)
    settings = Settings(_env_file=None)
    assert settings.roots() == []
    with pytest.raises(ValueError, match="OCRQ_ALLOWED_ROOTS is not set"):
        settings.require_safe_roots()
    assert Settings(_env_file=None, allowed_roots=[tmp_path / "a"]).roots() == [tmp_path / "a"]


def test_an_unknown_ocrq_variable_is_warned_once_naming_the_nearest_setting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """`OCRQ_MAXBATCH=4` started a worker with 8 and said nothing. Now `ocrq` commands (the
    worker here, as users start it) and the api as uvicorn starts it say so, once."""
    import subprocess

    from ocrq.api.http import create_app
    from ocrq.core import settings as module
    from tests.conftest import BIN

    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("OCRQ_") or k in module.OTHER_VARIABLES
    }  # fmt: skip
    # No allowed roots: the worker refuses to start right after reading its settings.
    env.update(OCRQ_MAXBATCH="4", OCRQ_API_URL="http://x", OCRQ_QUEUE="ocr-unknown")
    worker = subprocess.run(
        [str(BIN / "ocrq"), "worker", "--no-supervise"], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = "OCRQ_MAXBATCH is not an ocrq setting and is ignored: did you mean OCRQ_MAX_BATCH?"
    assert worker.stderr.count(said) == 1, worker.stderr[-2000:]
    assert "OCRQ_API_URL" not in worker.stderr and "OCRQ_QUEUE is not" not in worker.stderr

    monkeypatch.setattr(module, "_unknown_said", set())
    monkeypatch.setenv("OCRQ_WEBHOOK_SECERT", "x")
    monkeypatch.setenv("OCRQ_API_TOKEN", "t0ken-0123456789abcdef")
    with caplog.at_level("WARNING", logger="ocrq.core.settings"):
        create_app()
        create_app()
    lines = [r.getMessage() for r in caplog.records if "OCRQ_WEBHOOK_SECERT" in r.getMessage()]
    assert lines == [
        "OCRQ_WEBHOOK_SECERT is not an ocrq setting and is ignored: did you mean "
        "OCRQ_WEBHOOK_SECRET?"
    ]
    assert module.unknown_variables({"OCRQ_FOO": "1", "OCRQ_MAX_BATCH": "2"}) == [
        "OCRQ_FOO is not an ocrq setting and is ignored: docs/settings.md lists them"
    ]


def test_the_loop_s_old_bulk_wait_in_steps_is_an_unknown_variable_pointing_at_the_one_in_s(
) -> None:
    """OCRQ_LOOP_BULK_MAX_WAIT_STEPS went (issue 49, stage 4): OCRQ_BULK_MAX_WAIT_S bounds the
    running loop's bulk wait as the batcher's. An operator who still sets it is told so, with
    the setting that took its place, and it changes nothing."""
    from ocrq.core.settings import Settings, unknown_variables

    assert unknown_variables({"OCRQ_LOOP_BULK_MAX_WAIT_STEPS": "256"}) == [
        "OCRQ_LOOP_BULK_MAX_WAIT_STEPS is not an ocrq setting and is ignored: did you mean "
        "OCRQ_BULK_MAX_WAIT_S?"
    ]
    assert "loop_bulk_max_wait_steps" not in Settings.model_fields
