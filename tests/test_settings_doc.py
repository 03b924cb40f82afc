"""docs/settings.md is what scripts/settings_doc.py renders from the Settings class."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _generator():
    path = REPO / "scripts" / "settings_doc.py"
    spec = importlib.util.spec_from_file_location("settings_doc", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("settings_doc", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_settings_doc_is_current() -> None:
    """A new or changed setting (or the comment above it) needs a regenerated doc."""
    expected = _generator().render()
    actual = (REPO / "docs" / "settings.md").read_text(encoding="utf-8")
    assert actual == expected, "docs/settings.md is stale: run `python scripts/settings_doc.py`"


def test_every_setting_is_documented_with_its_comment() -> None:
    from ocrq.core.settings import Settings

    text = _generator().render()
    for name in Settings.model_fields:
        assert f"| `OCRQ_{name.upper()}` |" in text, name
    # The comment above a field is its description, and a group's first line its title.
    row = "| `OCRQ_BATCH_WAIT_MS` | int (0 ≤ x ≤ 60000) | `50` | How long the batcher lingers"
    assert row in text
    assert "## Batching\n" in text and "## Delivery and lifecycle\n" in text


def test_a_new_field_changes_the_doc() -> None:
    """The check can fail: a field added to the source (and the class) shows up in the render."""
    from pydantic import Field

    from ocrq.core.settings import Settings

    gen = _generator()
    sources = gen.read_sources()
    service = gen.OPERATOR_SOURCES[0]
    anchor = "    batch_wait_ms: int = Field(default=50, ge=0, le=60_000)\n"
    assert anchor in sources[service]
    added = anchor + "    # Brand new knob, said here.\n    brand_new_knob: int = 7\n"

    class Extended(Settings):
        brand_new_knob: int = Field(default=7, ge=1)

    text = gen.render(Extended, {**sources, service: sources[service].replace(anchor, added)})
    assert text != gen.render()
    assert "| `OCRQ_BRAND_NEW_KNOB` | int (1 ≤ x) | `7` | Brand new knob, said here. |" in text


def test_the_lab_levers_come_last_in_a_section_of_their_own() -> None:
    """An operator reads every setting of theirs before the lab section opens, and every lab
    lever after it, with the sentence that says to leave them alone."""
    from ocrq.core.settings import LabSettings, Settings

    text = _generator().render()
    operator, lab = text.split("\n## Lab levers\n")
    assert "Operators should leave them alone" in lab
    assert "\n## " not in lab  # the lab's groups are its subsections
    for name in Settings.model_fields:
        row = f"| `OCRQ_{name.upper()}` |"
        assert (row in lab) == (name in LabSettings.model_fields), name
        assert (row in operator) != (row in lab), name


def test_a_setting_that_went_is_listed_apart_with_what_took_its_place() -> None:
    """A removed setting is no field any more, and the doc says what became of it (an operator
    who still sets it is warned at start-up, tests/test_settings.py)."""
    from ocrq.core.settings import Settings

    gen = _generator()
    text = gen.render()
    assert gen.REMOVED and "\n## Settings that went\n" in text
    for name, _ in gen.REMOVED:
        assert name.removeprefix("OCRQ_").lower() not in Settings.model_fields, name
        assert f"| `{name}` | " in text.split("\n## Settings that went\n")[1], name
