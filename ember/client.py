"""A small Python client for Ember's HTTP API (what the CLI uses).

Problem responses come back as the matching ``ember.errors`` exception, with the
problem's ``detail`` and extension members, so callers handle errors by type.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.request import getproxies

import httpx

from ember import errors


@dataclass(frozen=True)
class ClientSettings:
    """Where the CLI finds the API: ``EMBER_URL`` and ``EMBER_API_KEY``.

    Read from the environment by hand, not by a pydantic ``BaseSettings``: pydantic and
    pydantic-settings cost a client command (``ember models ls``) more start-up time than
    the rest of it together, for four strings."""

    url: str | None = None
    """Base URL of the API. Default: ``http://<EMBER_HOST>:<EMBER_PORT>``."""
    api_key: str | None = field(default=None, repr=False)
    """API key the CLI sends as a bearer token (never in a ``repr``)."""
    host: str = "127.0.0.1"
    port: int = 8000

    @classmethod
    def from_env(cls) -> ClientSettings:
        env = os.environ
        raw_port = env.get("EMBER_PORT", "8000")
        try:
            port = int(raw_port)
        except ValueError:
            port = 0
        if not 1 <= port <= 65535:
            raise errors.InvalidInput(f"EMBER_PORT must be a port (1-65535), not {raw_port!r}")
        return cls(env.get("EMBER_URL") or None, env.get("EMBER_API_KEY") or None,
                   env.get("EMBER_HOST", "127.0.0.1"), port)  # fmt: skip

    @property
    def base_url(self) -> str:
        return self.url or f"http://{self.host}:{self.port}"


_BY_STATUS: dict[int, type[errors.EmberError]] = {
    400: errors.MalformedRequest,
    401: errors.Unauthenticated,
    403: errors.Forbidden,
    404: errors.NotFound,
    409: errors.Conflict,
    413: errors.PayloadTooLarge,
    422: errors.InvalidInput,
    429: errors.BackPressure,
    502: errors.EngineError,
    503: errors.CapacityError,
}


def raise_for_problem(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body: dict[str, Any] = response.json()
    except ValueError:
        body = {"detail": response.text[:500] or response.reason_phrase}
    detail = str(body.get("detail") or body.get("title") or response.reason_phrase)
    cls = _BY_STATUS.get(response.status_code, errors.EmberError)
    extra = {k: v for k, v in body.items() if k not in ("detail", "title", "status")}
    if cls is errors.BackPressure:
        retry = float(response.headers.get("Retry-After", "1") or 1)
        raise errors.BackPressure(detail, retry_after_s=retry)
    raise cls(detail, **extra)


def tls_context(base_url: str) -> ssl.SSLContext | bool:
    """What the client verifies TLS with: httpx's default (the CA bundle) where TLS can
    happen, a context that trusts no CA where it cannot.

    httpx builds its TLS context when the client is made, and loading the CA bundle costs
    ~30 ms of a client command's start. The client sends only paths under ``base_url`` and
    follows no redirect, so over ``http://`` TLS is used only to reach an ``https://``
    proxy (httpx takes proxies from the environment, as ``getproxies`` reads them). The
    stand-in still requires a certificate and checks the host name: were it ever used, the
    handshake would fail, never pass unverified."""
    if base_url.lower().startswith("https:") or any(
        str(proxy).lower().startswith("https:") for proxy in getproxies().values()
    ):
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class EmberClient:
    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 60) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s,
                                 verify=tls_context(base_url))  # fmt: skip

    @classmethod
    def from_env(cls) -> EmberClient:
        settings = ClientSettings.from_env()
        return cls(settings.base_url, settings.api_key)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise errors.CapacityError(
                f"cannot reach Ember at {self.http.base_url}: {exc}"
            ) from exc
        raise_for_problem(response)
        return response.json() if response.content else None

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        return self.request("POST", path, json=body, headers=headers)

    def download(self, path: str) -> httpx.Response:
        """A raw response body (e.g. a job's result); problems raise as usual."""
        try:
            response = self.http.get(path)
        except httpx.TransportError as exc:
            raise errors.CapacityError(
                f"cannot reach Ember at {self.http.base_url}: {exc}"
            ) from exc
        raise_for_problem(response)
        return response

    def patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, json=body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def paginate(self, path: str, page_size: int = 100) -> list[Any]:
        items: list[Any] = []
        cursor: str | None = None
        while True:
            page = self.get(path, limit=page_size, cursor=cursor)
            items.extend(page["items"])
            cursor = page["next_cursor"]
            if not cursor:
                return items

    def close(self) -> None:
        self.http.close()
