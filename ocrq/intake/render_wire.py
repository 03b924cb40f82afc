"""Frames between a worker and its render processes (ocrq/intake/render_pool.py).

One frame: 4 bytes of JSON header length, 8 bytes of payload length, the JSON header, the raw
payload; file descriptors ride along with the first bytes (SCM_RIGHTS). JSON and raw pixels
rather than pickle: a render process parses hostile PDFs, so what it sends back is data the
worker checks, never objects it would rebuild.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

PREFIX = struct.Struct(">IQ")
MAX_HEADER = 1 << 16


def send(sock: socket.socket, header: dict[str, Any], payload: bytes, fds: list[int] = ()) -> None:  # type: ignore[assignment]
    head = json.dumps(header).encode()
    first = PREFIX.pack(len(head), len(payload)) + head
    if fds:
        socket.send_fds(sock, [first], list(fds))
    else:
        sock.sendall(first)
    if payload:
        sock.sendall(payload)


def _exactly(sock: socket.socket, n: int, into: bytearray) -> bool:
    while len(into) < n:
        chunk = sock.recv(min(n - len(into), 1 << 20))
        if not chunk:
            return False
        into += chunk
    return True


def receive(
    sock: socket.socket, max_payload: int | None = None
) -> tuple[dict[str, Any], list[int], bytes] | None:
    """(header, fds, payload), or None when the other end closed; ValueError on a frame over
    the limits (a render process gone wrong)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, PREFIX.size, 4)
    if not data:
        return None
    buf = bytearray(data)
    if not _exactly(sock, PREFIX.size, buf):
        return None
    head_len, payload_len = PREFIX.unpack(bytes(buf[: PREFIX.size]))
    if head_len > MAX_HEADER or (max_payload is not None and payload_len > max_payload):
        raise ValueError(f"render frame over the limits ({head_len}, {payload_len} bytes)")
    head = bytearray()
    if not _exactly(sock, head_len, head):
        return None
    payload = bytearray()
    if not _exactly(sock, payload_len, payload):
        return None
    return json.loads(head), list(fds), bytes(payload)
