"""The base of every settings group, and how an empty variable is read.

Each group (ocrq/core/settings_service.py, settings_engines.py, settings_lab.py) declares its
fields on `SettingsGroup`; `Settings` (ocrq/core/settings.py) inherits them all.
"""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, SecretStr, model_validator

# Settings refused when given empty (`OCRQ_X=`), with why; any other empty setting means the same
# as unset, its default. A secret left empty is a variable that was meant to be filled
# (`OCRQ_WEBHOOK_SECRET=${SECRET}` with SECRET unset), not a choice: a webhook signed with the
# key b"" can be forged by anyone, and an empty api token would be no token at all.
EMPTY_REFUSED = {
    "webhook_secret": (
        "webhooks would be signed with an empty key, which anyone can forge: set a secret "
        "(e.g. `openssl rand -hex 32`) on the api and the workers, or unset it to send none"
    ),
    "api_token": (
        "set a secret of at least 16 characters (e.g. `openssl rand -hex 32`), or unset it "
        "and set OCRQ_API_ALLOW_NO_AUTH=true behind an authenticating proxy"
    ),
}


class SettingsGroup(BaseModel):
    """A group of settings: declared as fields of its own, inherited by the flat `Settings`."""

    @model_validator(mode="before")
    @classmethod
    def _empty_means_unset(cls, values: object) -> object:
        """An empty (or blank) value means what unset means: the default, as docs/settings.md
        says. Before, pydantic read it as a value: `OCRQ_UPLOAD_DIR=` became Path("") (the
        working directory, then an allowed root) and `OCRQ_MAX_BATCH=` failed to parse."""
        if not isinstance(values, dict):
            return values
        kept = {}
        for name, value in values.items():
            text = value.get_secret_value() if isinstance(value, SecretStr) else value
            if isinstance(text, str) and not text.strip():
                if name in EMPTY_REFUSED:
                    raise ValueError(f"OCRQ_{name.upper()} is empty: {EMPTY_REFUSED[name]}")
                continue
            kept[name] = value
        return kept

    @classmethod
    def of(cls, settings: SettingsGroup) -> Self:
        """This group's fields of `settings` (the flat Settings, or any group that holds them),
        as this group alone: what a part that may see only this group keeps. `settings` itself
        when it is exactly this group; otherwise a copy of already validated values."""
        if type(settings) is cls:
            return settings
        return cls.model_construct(**{name: getattr(settings, name) for name in cls.model_fields})
