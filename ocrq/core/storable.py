"""Text as PostgreSQL can store it: every string a job's row or a document's row gets.

Why here and not in each engine: a model's answer is not ours to trust. PostgreSQL's `text` and
`jsonb` hold neither NUL (U+0000) nor a lone surrogate (not UTF-8); one such character in a
result made the row's UPDATE raise, and the job stayed `running` while its message was acked
(issue 31: a served model's 200 answer with a NUL in it). The store cleans what it writes, so
no engine, present or future, can produce an unstorable row. Both become U+FFFD, the
replacement character, so a reader sees that something was there.
"""

from __future__ import annotations

import re
from typing import Any

REPLACEMENT = "\ufffd"
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(value: Any) -> Any:
    """`value` with every string in it (dict keys and values, list items) made storable; other
    values as they are. Strings that need nothing are returned as they are (no copy)."""
    if isinstance(value, str):
        if value.isascii() and "\x00" not in value:
            return value
        return _UNSTORABLE.sub(REPLACEMENT, value)
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value
