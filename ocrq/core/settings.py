"""One typed settings object, read from OCRQ_* variables once and passed down, declared as groups.

Nothing deep in the code reads the environment: tests and embedded mode build a Settings of
their own and hand it in.

Each field is declared once, in the group it belongs to: what an operator sets for the service
(ocrq/core/settings_service.py: ServiceSettings, IntakeSettings, BatchingSettings,
DeliverySettings, ApiSettings) and for its engine (ocrq/core/settings_engines.py: one group per
engine), and the lab levers, for experiments and benches (ocrq/core/settings_lab.py:
LabSettings). `Settings` inherits every group, so it stays flat: one `OCRQ_<FIELD>` variable
per field, validated once, and `settings.max_batch` works as before. `settings.hunyuan` (and
`.intake`, `.batching`, `.lab`, ...) is that group's typed view of the validated values: an
engine is built from its own group only (ocrq/models/registry.py) and cannot read the api's
token or the broker's URL. Why flat at the root rather than nested models: every OCRQ_* name,
every `settings.<field>` access and every `Settings(field=...)` in tests and benches keeps
working, and a field moves between groups without renaming its variable.

The groups, their base and the types of their fields are imported from here too
(`from ocrq.core.settings import HunyuanSettings, DecodeMode`), as before they had modules of
their own.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from pydantic_settings import BaseSettings, SettingsConfigDict

from ocrq.core.broker_urls import is_redis
from ocrq.core.settings_engines import (
    HunyuanSettings,
    ModelSettings,
    OpenAISettings,
    RapidModels,
    RapidSettings,
    Scheduler,
    VllmSettings,
)
from ocrq.core.settings_group import EMPTY_REFUSED, SettingsGroup
from ocrq.core.settings_lab import (
    DecodeAttention,
    DecodeMode,
    HunyuanLabSettings,
    HunyuanNumerics,
    KvCacheDtype,
    LabSettings,
    PrefillSchedule,
    PreprocessMode,
    VisionAttention,
    VisionGemmDtype,
)
from ocrq.core.settings_service import (
    ApiSettings,
    BatchingSettings,
    BudgetSettings,
    DeliverySettings,
    IntakeSettings,
    ServiceSettings,
)

__all__ = [
    "EMPTY_REFUSED",
    "OTHER_VARIABLES",
    "ApiSettings",
    "BatchingSettings",
    "BudgetSettings",
    "DecodeAttention",
    "DecodeMode",
    "DeliverySettings",
    "HunyuanLabSettings",
    "HunyuanNumerics",
    "HunyuanSettings",
    "IntakeSettings",
    "KvCacheDtype",
    "LabSettings",
    "ModelSettings",
    "OpenAISettings",
    "PrefillSchedule",
    "PreprocessMode",
    "RapidModels",
    "RapidSettings",
    "Scheduler",
    "ServiceSettings",
    "Settings",
    "SettingsGroup",
    "VisionAttention",
    "VisionGemmDtype",
    "VllmSettings",
    "result_backend_url",
    "unknown_variables",
    "warn_unknown_variables",
]

G = TypeVar("G", bound=SettingsGroup)


class Settings(
    ServiceSettings,
    IntakeSettings,
    BatchingSettings,
    DeliverySettings,
    ApiSettings,
    RapidSettings,
    HunyuanSettings,
    VllmSettings,
    OpenAISettings,
    LabSettings,
    BaseSettings,
):
    """Every group flat: one OCRQ_* variable per field, read and validated once per process."""

    # hide_input_in_errors: a bad setting's error must not print the others (tokens, passwords).
    model_config = SettingsConfigDict(env_prefix="OCRQ_", extra="ignore", hide_input_in_errors=True)

    def view(self, group: type[G]) -> G:
        """`group`'s fields of these (validated) settings, as a model of their own: what a part
        that needs only that group is given. A copy: changing it changes nothing here."""
        return group.of(self)

    @property
    def service(self) -> ServiceSettings:
        return self.view(ServiceSettings)

    @property
    def intake(self) -> IntakeSettings:
        return self.view(IntakeSettings)

    @property
    def batching(self) -> BatchingSettings:
        return self.view(BatchingSettings)

    @property
    def delivery(self) -> DeliverySettings:
        return self.view(DeliverySettings)

    @property
    def api(self) -> ApiSettings:
        return self.view(ApiSettings)

    @property
    def rapid(self) -> RapidSettings:
        return self.view(RapidSettings)

    @property
    def hunyuan(self) -> HunyuanSettings:
        return self.view(HunyuanSettings)

    @property
    def vllm(self) -> VllmSettings:
        return self.view(VllmSettings)

    @property
    def openai(self) -> OpenAISettings:
        return self.view(OpenAISettings)

    @property
    def lab(self) -> LabSettings:
        return self.view(LabSettings)

    def roots(self) -> list[Path]:
        """Resolved allowed roots; `/` only when none are set and allow_any_path says so. The
        api's upload folder is always one of them: workers read what the api stored there."""
        roots = list(self.allowed_roots) or ([Path("/")] if self.allow_any_path else [])
        if self.upload_dir is not None:
            roots.append(self.upload_dir)
        return [p.expanduser().resolve() for p in roots]

    def root_warnings(self) -> list[str]:
        """What looks wrong in OCRQ_ALLOWED_ROOTS, one sentence each; said, not refused.

        A wrong root otherwise shows only as every path job failing "outside allowed roots",
        with nothing naming the setting's mistake. Not refused: a network mount may appear
        after the worker starts, and a folder name may hold a comma.
        """
        warnings = []
        for root in self.allowed_roots:
            if "," in str(root):
                warnings.append(
                    f"OCRQ_ALLOWED_ROOTS entry {str(root)!r} contains a comma: the list is "
                    f"separated by {os.pathsep!r}, not ',' (e.g. /srv/a{os.pathsep}/srv/b); "
                    "as given it names one folder"
                )
            if not root.expanduser().is_dir():
                warnings.append(
                    f"OCRQ_ALLOWED_ROOTS entry {str(root)!r} is not an existing folder: path "
                    "images under it fail until it exists (mounted later?); check the spelling"
                )
        return warnings

    def require_safe_roots(self) -> None:
        """Refuse a worker configuration that would read any file on the host.

        Raised at worker start-up, before any message is consumed: a missing OCRQ_ALLOWED_ROOTS
        used to mean the working directory, which is `/` under systemd.
        """
        if self.allow_any_path:
            return
        if not self.allowed_roots and self.upload_dir is None:
            raise ValueError(
                "OCRQ_ALLOWED_ROOTS is not set: set it to the folders that path images may be "
                f"read from ({os.pathsep!r}-separated), or OCRQ_ALLOW_ANY_PATH=true to allow any"
            )
        if Path("/") in self.roots():
            raise ValueError(
                "OCRQ_ALLOWED_ROOTS includes /: every file on the host would be readable; name "
                "the image folders instead, or set OCRQ_ALLOW_ANY_PATH=true to mean it"
            )


# OCRQ_* variables that are not settings: the Python client's, a worker's from its supervisor,
# the tests' and benches'. Not warned about.
OTHER_VARIABLES = frozenset(
    {
        "OCRQ_API_URL",
        "OCRQ_SUPERVISOR_PID",
        "OCRQ_EVAL_DATA",
        "OCRQ_VLLM_VENV",
        "OCRQ_GPU_BASE_IMAGE",
        "OCRQ_TEST_PG_URL",
        "OCRQ_TEST_BROKER_URL",
    }
)
_unknown_said: set[str] = set()


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One sentence for each OCRQ_* variable that names no setting, with the nearest name that
    does. pydantic-settings ignores them (`extra="ignore"`): `OCRQ_MAXBATCH=4` started a
    worker with 8 and said nothing."""
    prefix = str(Settings.model_config["env_prefix"])
    known = sorted(prefix + name.upper() for name in Settings.model_fields)
    said = []
    for name in sorted(environ):
        upper = name.upper()  # the names are case-insensitive
        if not upper.startswith(prefix) or upper in known or upper in OTHER_VARIABLES:
            continue
        # Compared without the prefix, which every name shares: OCRQ_FOO is near no setting.
        fields = [k.removeprefix(prefix) for k in known]
        nearest = difflib.get_close_matches(upper.removeprefix(prefix), fields, n=1, cutoff=0.6)
        hint = f"did you mean {prefix}{nearest[0]}?" if nearest else "docs/settings.md lists them"
        said.append(f"{name} is not an ocrq setting and is ignored: {hint}")
    return said


def warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """Log `unknown_variables` at start-up (`ocrq` commands, the api), each once a process."""
    for sentence in unknown_variables(environ):
        if sentence not in _unknown_said:
            _unknown_said.add(sentence)
            logging.getLogger(__name__).warning("%s", sentence)


def result_backend_url(settings: Settings) -> str | None:
    """The Celery result backend the worker stores task results in, or None for none.

    "broker" follows the broker when it is Redis, through Sentinel too (a result is a few KiB
    kept for OCRQ_RESULT_EXPIRES_S), and means none for other brokers, which hold no results.
    """
    value = settings.result_backend.strip()
    if value.lower() in ("", "none", "off", "disabled"):
        return None
    if value.lower() == "broker":
        url = settings.broker_url
        return url if is_redis(url) else None
    return value
