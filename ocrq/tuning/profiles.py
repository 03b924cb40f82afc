"""Tuned cost-model profiles on disk: one JSON file per (device, engine, model, settings) key.

Why a key and not "the last tune": a profile is a measurement of one device running one model
revision with one dtype, attention implementation and generation length; any of those changes
the bytes per image. A worker builds its key from the loaded engine and uses a profile only when
every field matches, else the engine's documented conservative default (and says which in its
log). Files are named by a digest of the key so that any number of devices and models can share
one profile directory (OCRQ_PROFILE_DIR, default ~/.cache/ocrq/profiles).

This module is light (no torch, no matplotlib): the worker imports it at start-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ocrq.core.procfs import cpu_name
from ocrq.models.base import Engine
from ocrq.models.costs import CostModel
from ocrq.models.memory import memory_of

log = logging.getLogger(__name__)

# Every profile's key; each engine adds the settings that change its bytes per image
# (`MemoryProbing.profile_fields`, from ocrq/models/memory.py).
KEY_FIELDS = ("device", "engine")
# 2: per_token_bytes counts prompt tokens only; the decode part is new (ocrq/models/costs.py).
SCHEMA = 2


def engine_key(engine: Engine) -> dict[str, str]:
    """The key of a loaded engine's profile."""
    return profile_key(engine.describe(), memory_of(engine).profile_fields)


def profile_key(facts: dict[str, str], fields: Sequence[str] = ()) -> dict[str, str]:
    """KEY_FIELDS and the engine's `fields`, from a loaded engine's `describe()`.

    The device is the GPU's name when the engine runs on one, else the host CPU's name; a field
    the facts lack is an empty string.
    """
    key = {field: str(facts.get(field, "")) for field in (*KEY_FIELDS, *fields)}
    key["device"] = facts.get("gpu") or cpu_name()
    return key


def profile_path(profile_dir: Path, key: dict[str, str]) -> Path:
    canonical = json.dumps(key, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    return profile_dir.expanduser() / f"{key['engine']}-{digest}.json"


def model_to_json(model: CostModel) -> dict[str, float | int]:
    return {
        "fixed_bytes": model.fixed_bytes,
        "per_item_bytes": model.per_item_bytes,
        "per_token_bytes": model.per_token_bytes,
        "per_patch_bytes": model.per_patch_bytes,
        "per_cache_token_bytes": model.per_cache_token_bytes,
        "decode_fixed_bytes": model.decode_fixed_bytes,
    }


def write_profile(
    profile_dir: Path, key: dict[str, str], model: CostModel, extra: dict[str, Any]
) -> Path:
    """Write (atomically: a worker may be reading) the profile for `key`; returns its path."""
    path = profile_path(profile_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"schema": SCHEMA, "key": key, "model": model_to_json(model), **extra}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class ProfileChoice:
    """The cost model a worker plans with, and the log line that says where it came from."""

    model: CostModel
    path: Path | None  # None: the engine's default
    key: dict[str, str]
    # The largest batch `ocrq tune --images` recommended (the knee); None: it recommended none.
    max_batch: int | None = None

    def describe(self) -> str:
        if self.path is not None:
            knee = f", recommended max batch {self.max_batch}" if self.max_batch else ""
            return f"cost model: profile {self.path}{knee}"
        return f"cost model: default (no profile for {json.dumps(self.key, sort_keys=True)})"


def load_profile(profile_dir: Path, key: dict[str, str]) -> CostModel | None:
    """The profile's model for exactly `key`, or None (absent, other key, unreadable)."""
    body = read_profile(profile_dir, key)
    return None if body is None else body_model(body, profile_path(profile_dir, key))


def recommended_max_batch(body: dict[str, Any]) -> int | None:
    """The knee `ocrq tune --images` wrote into a profile's body, if it wrote one."""
    value = (body.get("recommended") or {}).get("max_batch")
    return int(value) if isinstance(value, int) and value >= 1 else None


def read_profile(profile_dir: Path, key: dict[str, str]) -> dict[str, Any] | None:
    """The profile's body for exactly `key`, or None (absent, other key, unreadable)."""
    path = profile_path(profile_dir, key)
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable profile %s: %s", path, exc)
        return None
    if body.get("schema") != SCHEMA or body.get("key") != key:
        log.warning("ignoring profile %s: written for another key or schema", path)
        return None
    return dict(body)


def body_model(body: dict[str, Any], path: Path) -> CostModel:
    m = body["model"]
    return CostModel(
        fixed_bytes=int(m["fixed_bytes"]),
        per_item_bytes=float(m["per_item_bytes"]),
        per_token_bytes=float(m["per_token_bytes"]),
        per_patch_bytes=float(m["per_patch_bytes"]),
        per_cache_token_bytes=float(m["per_cache_token_bytes"]),
        decode_fixed_bytes=float(m["decode_fixed_bytes"]),
        source=str(path),
    )


def choose_cost_model(engine: Engine, profile_dir: Path) -> ProfileChoice:
    """The loaded engine's profile from `profile_dir` when one matches, else its default."""
    key = engine_key(engine)
    body = read_profile(profile_dir, key)
    if body is not None:
        path = profile_path(profile_dir, key)
        return ProfileChoice(body_model(body, path), path, key, recommended_max_batch(body))
    return ProfileChoice(engine.cost_model(), None, key)
