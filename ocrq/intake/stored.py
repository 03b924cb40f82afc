"""Stored documents' bytes as a worker's page jobs read them: from the database once, then kept.

A URL or inline document is stored once when it is split (ocrq/core/documents_store.py) and each
of its page jobs names it. Read from the database by every page, a 1,000-page document of
50 MB would move 50 GB; its pages arrive together, so a worker keeps the last few documents it
read (at most `max_bytes` in all, least recently used out first) and a document's pages
starting at once wait for one read instead of each making their own.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

Load = Callable[[str], bytes | None]


class StoredDocuments:
    def __init__(self, load: Load, max_bytes: int) -> None:
        self._load = load
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self._reading: dict[str, threading.Lock] = {}

    def get(self, document_id: str) -> bytes | None:
        """The document's bytes; None when none are stored (gone with their document)."""
        with self._lock:
            kept = self._kept_now(document_id)
            if kept is not None:
                return kept
            reading = self._reading.setdefault(document_id, threading.Lock())
        with reading:  # one read per document at a time; the others find it kept
            with self._lock:
                kept = self._kept_now(document_id)
            if kept is not None:
                return kept
            data = self._load(document_id)
            with self._lock:
                self._reading.pop(document_id, None)
                if data is not None and len(data) <= self.max_bytes:
                    self._keep(document_id, data)
            return data

    def _kept_now(self, document_id: str) -> bytes | None:
        data = self._kept.get(document_id)
        if data is not None:
            self._kept.move_to_end(document_id)
        return data

    def _keep(self, document_id: str, data: bytes) -> None:
        if document_id in self._kept:
            return
        self._kept[document_id] = data
        self._size += len(data)
        while self._size > self.max_bytes:
            _, dropped = self._kept.popitem(last=False)
            self._size -= len(dropped)
