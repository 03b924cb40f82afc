"""Fetch an image URL under a policy: public addresses only, a total deadline, one error.

A worker sits inside the network, so a URL job is a request the worker makes on a stranger's
behalf. The policy, and why each part is there:

- The host is resolved here (getaddrinfo) and every address checked with `ipaddress`: loopback,
  private, link-local, multicast, reserved, unspecified and shared addresses are refused, in
  IPv4 and IPv6, also inside IPv4-mapped, 6to4 and NAT64 IPv6 forms. The OS resolver turns
  every numeric spelling (2130706433, 0x7f000001, 017700000001, 127.1) into the same address,
  so no spelling slips past. `OCRQ_URL_ALLOW_NETWORKS` lets deployments reach internal hosts.
- The connection goes to the address that was checked: a network backend for httpcore pins
  the host to it, so a second DNS answer (rebinding) is never asked for. The Host header and
  TLS SNI/certificate check still use the name.
- Redirects are followed here, each hop checked like the first, at most url_max_redirects.
- A total deadline (`OCRQ_URL_DEADLINE_S`) covers resolving, connecting, TLS, headers and body:
  every socket operation's timeout is clamped to the time left, so a server dripping a byte
  every few seconds cannot hold a task thread.
- Refusals and network failures give one message, so the worker cannot be used to tell open
  ports from closed ones or internal hosts from missing ones; the detail is logged at debug
  level, with the URL redacted (no credentials).

httpcore is used directly (not httpx's client) because it takes a network backend, and because
nothing here should follow redirects, read proxy variables from the environment or log URLs.
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import socket
import ssl
import time
import typing
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import cache

import httpcore
import httpx

from ocrq.core.contract import redact_url
from ocrq.core.settings import Settings

log = logging.getLogger(__name__)

# Every refusal and network failure alike, so jobs cannot scan the network (docs/security.md);
# the one setting that lets a private host through is named, which says nothing of the network.
NOT_FETCHED = (
    "URL not fetched (not allowed, unreachable or too slow; a private host must be in "
    "OCRQ_URL_ALLOW_NETWORKS): "
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
REDIRECTS = {301, 302, 303, 307, 308}
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: internal, yet not "private"

# getaddrinfo cannot be given a timeout; it runs here so the fetch's deadline still holds.
_resolver = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ocrq-dns")


class FetchError(Exception):
    """The URL was not fetched; `str()` is safe to show (redacted), `detail` is for debug logs."""

    def __init__(self, message: str, detail: str = "", permanent: bool = False) -> None:
        super().__init__(message)
        self.detail = detail
        # The URL itself is refused (its scheme, its address): asking again cannot change it.
        self.permanent = permanent


class _Refused(Exception):
    """A policy refusal or network failure: becomes the one generic FetchError."""


class _PolicyRefused(_Refused):
    """A refusal of the URL as written or of where it points, not of the network's state."""


class Deadline:
    """Seconds left of one fetch; clamps every socket timeout to them."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def clamp(self, timeout: float | None, exc: type[Exception]) -> float:
        left = self.left()
        if left <= 0:
            raise exc("total deadline passed")
        return left if timeout is None else min(timeout, left)


def fetch(url: str, settings: Settings) -> bytes:
    """The body of `url` (status 200), at most settings.max_image_bytes bytes.

    Raises FetchError: "URL not fetched ..." for every refusal or network failure alike,
    "URL answered HTTP <status>" for an answer other than 200 or a redirect, "image too large".
    """
    shown = redact_url(url)
    deadline = Deadline(settings.url_deadline_s)
    try:
        target = _parse(url)
    except _Refused as exc:  # about the URL as written: no leak in saying so
        raise FetchError(f"{exc}: {shown}") from None
    try:
        auth = _basic_auth(target)
        for _hop in range(settings.url_max_redirects + 1):
            status, location, body = _get(target, auth, settings, deadline, shown)
            if status in REDIRECTS and location:
                target = _parse(str(target.join(location)))
                auth = _basic_auth(target)  # credentials go only where the URL names them
                continue
            if status != 200:
                raise FetchError(f"URL answered HTTP {status}: {shown}")
            return body
        raise _Refused(f"more than {settings.url_max_redirects} redirects")
    except FetchError:
        raise
    except Exception as exc:  # policy, DNS, connect, TLS, protocol, deadline: one message
        detail = f"{type(exc).__name__}: {exc}"
        # The reason in the worker's own log only (the job's error stays generic: it reaches
        # producers, and says nothing of the worker's network).
        log.info("URL not fetched: %s (%s)", shown, detail)
        raise FetchError(NOT_FETCHED + shown, detail) from None


def post(url: str, body: bytes, headers: dict[str, str], settings: Settings) -> int:
    """POST `body` to `url` under the same address policy as a fetch (every address the name
    resolves to checked, the connection pinned to them, OCRQ_URL_ALLOW_NETWORKS the only way
    to an internal one); the answer's status. Redirects are not followed: a webhook receiver
    answers where it was registered. Raises FetchError when refused or unreachable."""
    deadline = Deadline(settings.url_deadline_s)
    try:
        target = _parse(url)
        host = target.raw_host.decode("ascii")
        port = target.port or (443 if target.scheme == "https" else 80)
        addresses = _checked_addresses(host, port, settings, deadline)
        sent = [
            (b"Host", target.netloc),
            (b"Content-Length", str(len(body)).encode()),
            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
        ]
        timeout = settings.url_timeout_s
        limits = dict.fromkeys(("connect", "read", "write", "pool"), timeout)
        request_url = httpcore.URL(
            scheme=target.raw_scheme, host=target.raw_host, port=port, target=target.raw_path
        )
        with (
            httpcore.ConnectionPool(
                ssl_context=_ssl_context(),
                network_backend=PinnedBackend(host, addresses, deadline),
                max_connections=1,
                retries=0,
            ) as pool,
            pool.stream(
                "POST",
                request_url,
                headers=sent,
                content=body,
                extensions={"timeout": limits},
            ) as response,
        ):
            return int(response.status)
    except Exception as exc:
        shown = redact_url(url)
        raise FetchError(
            f"URL not reached (not allowed, unreachable or too slow): {shown}",
            f"{type(exc).__name__}: {exc}",
            permanent=isinstance(exc, _PolicyRefused),
        ) from None


def _parse(url: str) -> httpx.URL:
    try:
        target = httpx.URL(url)  # scheme and host come back lower-cased
    except httpx.InvalidURL:
        raise _PolicyRefused("invalid URL") from None
    if target.scheme not in ("http", "https"):
        raise _PolicyRefused("unsupported URL scheme (http/https only)")
    if not target.host:
        raise _PolicyRefused("invalid URL (no host)")
    return target


def _basic_auth(target: httpx.URL) -> bytes | None:
    if not target.userinfo:
        return None
    return b"Basic " + base64.b64encode(f"{target.username}:{target.password}".encode())


def _get(
    target: httpx.URL, auth: bytes | None, settings: Settings, deadline: Deadline, shown: str
) -> tuple[int, str | None, bytes]:
    """One GET to the checked address: (status, Location, body of a 200)."""
    host = target.raw_host.decode("ascii")
    port = target.port or (443 if target.scheme == "https" else 80)
    addresses = _checked_addresses(host, port, settings, deadline)
    headers = [
        (b"Host", target.netloc),  # brackets for IPv6; httpcore's own would lack them
        (b"Accept", b"image/*"),
        (b"Accept-Encoding", b"identity"),
    ]
    if auth:
        headers.append((b"Authorization", auth))
    request_url = httpcore.URL(
        scheme=target.raw_scheme, host=target.raw_host, port=port, target=target.raw_path
    )
    timeout = settings.url_timeout_s
    limit = settings.max_image_bytes
    backend = PinnedBackend(host, addresses, deadline)
    with (
        httpcore.ConnectionPool(
            ssl_context=_ssl_context(), network_backend=backend, max_connections=1, retries=0
        ) as pool,
        pool.stream(
            "GET",
            request_url,
            headers=headers,
            extensions={
                "timeout": {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}
            },
        ) as response,
    ):
        if response.status != 200:
            location = _header(response.headers, b"location")
            return response.status, location, b""
        length = _header(response.headers, b"content-length")
        if length and length.isdigit() and int(length) > limit:
            raise FetchError(f"image too large: {length} bytes > limit {limit} at {shown}")
        chunks: list[bytes] = []
        total = 0
        for chunk in response.iter_stream():
            total += len(chunk)
            if total > limit:
                raise FetchError(f"image too large: over {limit} bytes at {shown}")
            chunks.append(chunk)
    return 200, None, b"".join(chunks)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


def _checked_addresses(host: str, port: int, settings: Settings, deadline: Deadline) -> list[str]:
    """The addresses to connect to: every address the name resolves to must be allowed."""
    future = _resolver.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = future.result(timeout=max(deadline.left(), 0.0))
    except FutureTimeout:
        raise _Refused(f"resolving {host} passed the deadline") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
    if not addresses:
        raise _Refused(f"{host} has no address")
    for ip in addresses:
        reason = refusal(ip, settings.url_allow_networks)
        if reason:
            raise _PolicyRefused(f"{host} resolves to {ip}: {reason}")
    return list(dict.fromkeys(str(ip) for ip in addresses))


def refusal(
    ip: IPAddress,
    allow: typing.Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
) -> str | None:
    """Why a connection to `ip` is refused, or None when it is allowed."""
    candidates: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            candidates.append(embedded)
    if any(c in net for c in candidates for net in allow if c.version == net.version):
        return None
    for c in candidates:
        for name in (
            "is_loopback",
            "is_private",
            "is_link_local",
            "is_multicast",
            "is_reserved",
            "is_unspecified",
            "is_site_local",
        ):
            if getattr(c, name, False):
                return f"{name[3:].replace('_', '-')} address"
        if isinstance(c, ipaddress.IPv4Address) and c in _SHARED:
            return "shared (carrier-grade NAT) address"
        if not c.is_global:
            return "not a global address"
    return None


@cache
def _ssl_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


class PinnedBackend(httpcore.SyncBackend):
    """Connects `host` to the addresses checked for it (the first that answers) and to nothing
    else; every socket operation's timeout clamped to the fetch's deadline."""

    def __init__(self, host: str, addresses: list[str], deadline: Deadline) -> None:
        self.host = host
        self.addresses = addresses
        self.deadline = deadline

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.NetworkStream:
        if host != self.host:
            raise httpcore.ConnectError(f"{host} is not the checked host {self.host}")
        error: Exception = httpcore.ConnectError(f"{host} has no address")
        for address in self.addresses:
            try:
                stream = super().connect_tcp(
                    address,
                    port,
                    self.deadline.clamp(timeout, httpcore.ConnectTimeout),
                    local_address,
                    socket_options,
                )
            except httpcore.ConnectError as exc:  # refused on this address: try the next
                error = exc
                continue
            return _DeadlineStream(stream, self.deadline)
        raise error

    def connect_unix_socket(self, *args: typing.Any, **kwargs: typing.Any) -> typing.NoReturn:
        raise httpcore.ConnectError("unix sockets are not fetched")


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream, deadline: Deadline) -> None:
        self._stream = stream
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, self._deadline.clamp(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, self._deadline.clamp(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._stream.start_tls(
            ssl_context, server_hostname, self._deadline.clamp(timeout, httpcore.ConnectTimeout)
        )
        return _DeadlineStream(stream, self._deadline)

    def get_extra_info(self, info: str) -> typing.Any:
        return self._stream.get_extra_info(info)
