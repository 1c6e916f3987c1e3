"""Job webhooks: signed, retried with backoff, never to a private address (SSRF).

A finished job (succeeded, failed or cancelled) with a ``webhook_url`` gets one POST of
its public document. The body is signed with the tenant's secret
(``GET /v1/webhooks/secret``)::

    Ember-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>

Receivers recompute the HMAC over the raw body, compare in constant time and reject
timestamps older than a few minutes (replays); ``verify`` does exactly that. Delivery is
at least once: dedupe on ``Ember-Job-Id``.

The URL must be ``http``/``https`` and every address its host resolves to must be public
(not loopback, private, link-local, shared, reserved or multicast, nor an IPv6 address
that embeds such an IPv4 one: IPv4-mapped, 6to4, Teredo, NAT64, ISATAP; nor unique-local,
site-local or another range not routed publicly) unless
``EMBER_JOBS_WEBHOOK_ALLOW_PRIVATE``. The check runs at submit and again at each delivery;
the host is resolved once per delivery and the connection goes to the address checked
(the ``Host`` header and TLS name stay the URL's), so DNS rebinding between check and
connect cannot redirect it. Redirects are not followed, proxies from the environment not
used, at most ``EMBER_JOBS_WEBHOOK_MAX_RESPONSE_BYTES`` of the answer are read, and the
whole delivery (connect, send, answer) ends within ``EMBER_JOBS_WEBHOOK_TIMEOUT_S``
however slowly the receiver answers.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import random
import secrets
import socket
import ssl
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx
from sqlalchemy import Engine, update
from sqlmodel import Session, col, select

from ember.config import Settings
from ember.errors import InvalidInput
from ember.jobs import records
from ember.jobs.queue import Publisher
from ember.logs import bound, get_logger
from ember.registry.tables import Job, WebhookSecret

log = get_logger(__name__)
SIGNATURE_HEADER = "Ember-Signature"
IP = ipaddress.IPv4Address | ipaddress.IPv6Address


# --- signatures ----------------------------------------------------------------------


def sign(secret: str, body: bytes, timestamp: int) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def verify(
    secret: str, header: str, body: bytes, tolerance_s: float = 300, now: float | None = None
) -> bool:
    """True if ``header`` signs ``body`` with ``secret`` and is at most ``tolerance_s`` old."""
    try:
        fields = dict(part.split("=", 1) for part in header.split(","))
        timestamp = int(fields["t"])
    except (ValueError, KeyError):
        return False
    if abs((now if now is not None else time.time()) - timestamp) > tolerance_s:
        return False
    expected = sign(secret, body, timestamp).split("v1=", 1)[1]
    return hmac.compare_digest(expected, fields.get("v1", ""))


def tenant_secret(session: Session, tenant_id: int, rotate: bool = False) -> WebhookSecret:
    """The tenant's signing secret, created on first use (or replaced with ``rotate``)."""
    row = session.get(WebhookSecret, tenant_id)
    if row is None:
        row = WebhookSecret(tenant_id=tenant_id, secret="whsec_" + secrets.token_hex(32))
        session.add(row)
    elif rotate:
        row.secret = "whsec_" + secrets.token_hex(32)
        row.created_at = records.utcnow()
        session.add(row)
    return row


# --- SSRF ----------------------------------------------------------------------------

_V6 = ipaddress.IPv6Network
NAT64 = _V6("64:ff9b::/96")
"""The well-known NAT64 prefix (RFC 6052): the IPv4 address is the last 32 bits."""
IPV4_TRANSLATED = _V6("::ffff:0:0:0/96")
"""SIIT's IPv4-translated addresses (RFC 2765): the last 32 bits."""
BLOCKED_V6 = (
    # What ``ipaddress`` does not refuse on every Python Ember runs on. The rest (unique
    # local, link-local, documentation, discard, IPv4-compatible ``::/96`` and local-use
    # NAT64 in the reserved ``::/8``, SRv6 ``5f00::/16``) is ``is_private``,
    # ``is_reserved``, ``is_site_local`` or ``is_multicast``.
    _V6("2001::/23"),  # IETF protocol assignments, Teredo among them: whole (newer
    # Pythons count parts of it global)
    _V6("3fff::/20"),  # documentation (RFC 9637)
)


def _blocked_v4(ip: ipaddress.IPv4Address) -> bool:
    # Not global covers private, shared, loopback, link-local, reserved and unspecified;
    # ``ipaddress`` counts multicast as global.
    return not ip.is_global or ip.is_multicast


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """Every IPv4 address ``ip`` carries where a transition mechanism would send it on:
    IPv4-mapped, 6to4 (``2002::/16``, bits 16-48), Teredo (server and de-obfuscated
    client), NAT64's well-known prefix, SIIT-translated, ISATAP interface identifiers."""
    found = [a for a in (ip.ipv4_mapped, ip.sixtofour) if a is not None]
    if ip.teredo is not None:
        found += list(ip.teredo)
    low = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in NAT64 or ip in IPV4_TRANSLATED:
        found.append(low)
    if (int(ip) >> 32) & 0xFDFFFFFF == 0x00005EFE:  # ISATAP: ::0:5efe:a.b.c.d / ::200:5efe:
        found.append(low)
    return found


def blocked(ip: IP) -> bool:
    """True for an address a webhook must not reach: not global, loopback, private,
    link-local, multicast, reserved or unspecified — also when it is an IPv6 address
    that embeds such an IPv4 address, or lies in a range that is not routed publicly."""
    if isinstance(ip, ipaddress.IPv4Address):
        return _blocked_v4(ip)
    if ip.ipv4_mapped is not None:  # reached as that IPv4 address: judged as it
        return _blocked_v4(ip.ipv4_mapped)
    if ip in NAT64:  # an IPv6-only network's way to IPv4 hosts (DNS64): judged as the IPv4
        return _blocked_v4(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if any(_blocked_v4(v4) for v4 in embedded_ipv4(ip)):
        return True
    if any(ip in net for net in BLOCKED_V6):
        return True
    # Not global covers private, loopback, link-local and unspecified.
    return not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_site_local


def check_url(url: str, allow_private: bool, *, must_resolve: bool) -> list[IP]:
    """Validate a webhook URL; the addresses it may be delivered to (empty when the
    host does not resolve now and ``must_resolve`` is False)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidInput(f"webhook_url is not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInput("webhook_url must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise InvalidInput("webhook_url must not carry credentials")
    host = parts.hostname
    try:
        addresses: list[IP] = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = socket.getaddrinfo(
                host, port or (443 if parts.scheme == "https" else 80), type=socket.SOCK_STREAM
            )
        except (OSError, UnicodeError) as exc:
            if must_resolve:
                raise InvalidInput(f"webhook host {host!r} does not resolve: {exc}") from exc
            return []
        addresses = list(dict.fromkeys(ipaddress.ip_address(i[4][0]) for i in infos))
    if not allow_private:
        refused = [str(a) for a in addresses if blocked(a)]
        if refused:
            raise InvalidInput(
                f"webhook_url {host!r} resolves to non-public address(es) {', '.join(refused)}; "
                "set EMBER_JOBS_WEBHOOK_ALLOW_PRIVATE=true to allow them",
                addresses=refused,
            )
    return addresses


# --- the connection: to the vetted address, under one deadline --------------------------


class _Deadline:
    def __init__(self, at: float) -> None:
        self.at = at

    def left(self, timeout: float | None, error: type[Exception]) -> float:
        """The time an operation may take: its own timeout, cut to what is left."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise error("the webhook delivery's total deadline passed")
        return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    """A connection whose every read and write (and TLS handshake) ends by the deadline:
    a receiver that drips its answer a byte at a time cannot hold the worker past it."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: _Deadline) -> None:
        self.inner, self.deadline = inner, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, self.deadline.left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, self.deadline.left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self.inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = self.deadline.left(timeout, httpcore.ConnectTimeout)
        return _Stream(self.inner.start_tls(ssl_context, server_hostname, left), self.deadline)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _PinnedBackend(httpcore.NetworkBackend):
    """Connects to the address ``check_url`` vetted, whatever host the URL names (so the
    ``Host`` header and the TLS server name stay the URL's, and DNS is not asked again)."""

    def __init__(self, address: IP, deadline: _Deadline) -> None:
        self.address, self.deadline = address, deadline
        self.inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = self.deadline.left(timeout, httpcore.ConnectTimeout)
        stream = self.inner.connect_tcp(
            str(self.address), port, left, local_address, socket_options
        )
        return _Stream(stream, self.deadline)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("webhooks are not delivered to Unix sockets")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class _PinnedTransport(httpx.HTTPTransport):
    def __init__(self, address: IP, deadline: _Deadline) -> None:
        super().__init__(trust_env=False)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=1,
            network_backend=_PinnedBackend(address, deadline),
        )


def pinned_client(address: IP, timeout_s: float) -> httpx.Client:
    """An HTTP client for one delivery: every connection goes to ``address``; connect,
    send and the answer together take at most ``timeout_s``; no proxy from the
    environment, no redirects followed."""
    deadline = _Deadline(time.monotonic() + timeout_s)
    return httpx.Client(
        transport=_PinnedTransport(address, deadline),
        timeout=timeout_s,
        trust_env=False,
        follow_redirects=False,
    )


# --- delivery ------------------------------------------------------------------------


def backoff_s(settings: Settings, attempt: int) -> float:
    cap = min(settings.jobs_retry_max_backoff_s, settings.jobs_retry_base_s * 2.0 ** (attempt - 1))
    return cap / 2 + random.uniform(0, cap / 2)


def deliver(
    engine: Engine,
    settings: Settings,
    publisher: Publisher,
    uid: str,
    payload: Any,
) -> str:
    """One delivery attempt of ``uid``'s webhook; the webhook status afterwards.

    ``payload(session, job)`` builds the document to send. The attempt is claimed with
    a conditional UPDATE (so duplicate messages do not deliver twice at once). Each delivery
    makes its own connection, to the address it checked."""
    at = records.utcnow()
    busy_until = at + timedelta(seconds=settings.jobs_webhook_timeout_s * 2 + 5)
    with records.transaction(engine) as session:
        claimed = (
            session.connection()
            .execute(
                update(Job)
                .where(
                    col(Job.uid) == uid,
                    col(Job.webhook_status) == "pending",
                    col(Job.webhook_next_at) <= at + timedelta(seconds=records.EARLY_S),
                )
                .values(webhook_attempts=col(Job.webhook_attempts) + 1, webhook_next_at=busy_until)
            )
            .rowcount
        )
        if not claimed:
            return "skipped"
        job = session.exec(select(Job).where(col(Job.uid) == uid)).one()
        secret = tenant_secret(session, job.tenant_id).secret
        body = json.dumps(payload(session, job), default=str).encode()
    with bound(job_id=uid, webhook_attempt=job.webhook_attempts):
        status, error = _post(settings, job, secret, body)
        if status == "retry" and job.webhook_attempts >= settings.jobs_webhook_max_attempts:
            status = "failed"
            error = f"gave up after {job.webhook_attempts} deliveries: {error}"
        values: dict[str, Any] = {
            "webhook_status": status if status != "retry" else "pending",
            "webhook_error": error[:1000] if error else None,
        }
        delay = backoff_s(settings, job.webhook_attempts)
        if status == "delivered":
            values["webhook_delivered_at"] = records.utcnow()
        elif status == "retry":
            values["webhook_next_at"] = records.utcnow() + timedelta(seconds=delay)
        with records.transaction(engine) as session:
            session.connection().execute(update(Job).where(col(Job.id) == job.id).values(**values))
        if status == "retry":
            log.warning("webhook delivery failed, will retry", error=error, delay_s=round(delay, 2))
            publisher.webhook(uid, countdown_s=delay)
        else:
            log.info("webhook " + status, error=error)
        return status


def _post(settings: Settings, job: Job, secret: str, body: bytes) -> tuple[str, str | None]:
    url = job.webhook_url or ""
    try:
        addresses = check_url(url, settings.jobs_webhook_allow_private, must_resolve=True)
    except InvalidInput as exc:
        if "does not resolve" in exc.detail:
            return "retry", exc.detail
        return "refused", exc.detail
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "ember-webhooks",
        SIGNATURE_HEADER: sign(secret, body, int(time.time())),
        "Ember-Job-Id": job.uid,
        "Ember-Delivery-Attempt": str(job.webhook_attempts),
    }
    cap = settings.jobs_webhook_max_response_bytes
    try:
        # One client per delivery: it connects to the address just checked, and the
        # whole exchange ends by the deadline however slowly the receiver answers.
        with (
            pinned_client(addresses[0], settings.jobs_webhook_timeout_s) as client,
            client.stream("POST", url, content=body, headers=headers) as response,
        ):
            read = 0
            for chunk in response.iter_raw(chunk_size=1024):
                read += len(chunk)
                if read >= cap:  # the rest is not read: the connection is dropped
                    break
    except httpx.HTTPError as exc:
        return "retry", f"{type(exc).__name__}: {exc}"[:500]
    if 200 <= response.status_code < 300:
        return "delivered", None
    return "retry", f"the receiver answered {response.status_code}"
