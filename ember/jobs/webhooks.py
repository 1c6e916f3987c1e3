"""Job webhooks: signed, retried with backoff, never to a private address (SSRF).

A finished job (succeeded, failed or cancelled) with a ``webhook_url`` gets one POST of
its public document. The body is signed with the tenant's secret
(``GET /v1/webhooks/secret``)::

    Ember-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>

Receivers recompute the HMAC over the raw body, compare in constant time and reject
timestamps older than a few minutes (replays); ``verify`` does exactly that. Delivery is
at least once: dedupe on ``Ember-Job-Id``.

The URL must be ``http``/``https`` and every address its host resolves to must be public
(not loopback, private, link-local, shared, reserved or multicast) unless
``EMBER_JOBS_WEBHOOK_ALLOW_PRIVATE``. The check runs at submit and again at each delivery,
and the delivery connects to the address it checked (the ``Host`` header and TLS name
stay the URL's), so DNS rebinding between check and connect cannot redirect it.
Redirects are not followed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import random
import secrets
import socket
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

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


def _blocked(ip: IP) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_unspecified


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
        blocked = [str(a) for a in addresses if _blocked(a)]
        if blocked:
            raise InvalidInput(
                f"webhook_url {host!r} resolves to non-public address(es) {', '.join(blocked)}; "
                "set EMBER_JOBS_WEBHOOK_ALLOW_PRIVATE=true to allow them",
                addresses=blocked,
            )
    return addresses


def _pinned(url: str, address: IP) -> tuple[str, str]:
    """``url`` with its host replaced by ``address``; and the original host header."""
    parts = urlsplit(url)
    host = f"[{address}]" if address.version == 6 else str(address)
    netloc = f"{host}:{parts.port}" if parts.port else host
    header = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, "")), header


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
    http: httpx.Client,
) -> str:
    """One delivery attempt of ``uid``'s webhook; the webhook status afterwards.

    ``payload(session, job)`` builds the document to send. The attempt is claimed with
    a conditional UPDATE (so duplicate messages do not deliver twice at once)."""
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
        status, error = _post(settings, job, secret, body, http)
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


def _post(
    settings: Settings, job: Job, secret: str, body: bytes, http: httpx.Client
) -> tuple[str, str | None]:
    url = job.webhook_url or ""
    try:
        addresses = check_url(url, settings.jobs_webhook_allow_private, must_resolve=True)
    except InvalidInput as exc:
        if "does not resolve" in exc.detail:
            return "retry", exc.detail
        return "refused", exc.detail
    target, host = _pinned(url, addresses[0])
    headers = {
        "Content-Type": "application/json",
        "Host": host,
        "User-Agent": "ember-webhooks",
        SIGNATURE_HEADER: sign(secret, body, int(time.time())),
        "Ember-Job-Id": job.uid,
        "Ember-Delivery-Attempt": str(job.webhook_attempts),
    }
    extensions = {"sni_hostname": urlsplit(url).hostname} if url.startswith("https") else {}
    try:
        response = http.post(
            target,
            content=body,
            headers=headers,
            extensions=extensions,
            timeout=settings.jobs_webhook_timeout_s,
            follow_redirects=False,
        )
    except httpx.HTTPError as exc:
        return "retry", f"{type(exc).__name__}: {exc}"[:500]
    if 200 <= response.status_code < 300:
        return "delivered", None
    return "retry", f"the receiver answered {response.status_code}"
