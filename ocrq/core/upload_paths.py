"""Where an uploaded image lives in OCRQ_UPLOAD_DIR: one spelling for the api that writes it
and the worker that reads it.

The api stores each upload under the SHA-256 of its bytes (`<dir>/ab/abcdef...`) and sends a
plain `{"path": ...}` job. A worker that cannot open such a path almost always lacks the api's
upload folder (OCRQ_UPLOAD_DIR unset there, or the volume not shared), so it recognises the
shape and says that, instead of the generic "not found or outside allowed roots".
"""

from __future__ import annotations

import re
from pathlib import PurePath

_DIGEST = re.compile(r"[0-9a-f]{64}")


def upload_path(folder: PurePath, digest: str) -> PurePath:
    """The file an upload of this SHA-256 (hex) is stored as."""
    return folder / digest[:2] / digest


def upload_folder_of(path: str) -> PurePath | None:
    """The upload folder a path names, when it has an upload's shape (`.../ab/ab<62 hex>`);
    None for any other path. Decided on the string alone: it says nothing about the file."""
    parts = PurePath(path)
    name, bucket = parts.name, parts.parent.name
    if _DIGEST.fullmatch(name) and bucket == name[:2]:
        return parts.parent.parent
    return None
