"""The pools controller's client of a replica's control endpoints.

Every HTTP call the control side makes to a replica goes through here, one method per
route of ``ember.engine.server`` (``GET /info``, ``GET /healthz``, ``POST /tier``,
``POST /assign``), so the pairing is read in one place and the controller deals in
answers, not in URLs and status codes. The serving side's hop to ``/infer`` is not here:
that is data, not control (``ember.serving.hop``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import httpx

from ember.domain.spec import Tier, VersionSpec
from ember.pools.backends.base import ReplicaHandle

CHANGE_TIMEOUT_S = 600.0
"""A tier change or an assignment loads weights: minutes on a large model."""


class ReplicaControl:
    """The control endpoints of the replicas, over one keep-alive client."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    @classmethod
    def with_timeout(cls, timeout_s: float) -> ReplicaControl:
        return cls(httpx.AsyncClient(timeout=timeout_s))

    async def info(self, handle: ReplicaHandle) -> dict[str, Any] | None:
        """``GET /info``: the replica's state, tier and load report; None while it does not
        answer (not listening yet) or answers no JSON object."""
        try:
            info = (await self.http.get(f"{handle.url}/info", headers=handle.auth)).json()
        except (httpx.HTTPError, ValueError):
            return None
        return info if isinstance(info, dict) else None

    async def healthy(self, handle: ReplicaHandle) -> bool:
        """``GET /healthz`` (the liveness probe: no secret) answered 200."""
        try:
            return (await self.http.get(f"{handle.url}/healthz")).status_code == 200
        except httpx.HTTPError:
            return False

    async def set_tier(self, handle: ReplicaHandle, tier: Tier) -> bool:
        """``POST /tier``: move the replica to ``tier``; whether it did."""
        try:
            response = await self.http.post(
                f"{handle.url}/tier", json={"tier": tier}, timeout=CHANGE_TIMEOUT_S,
                headers=handle.auth,
            )  # fmt: skip
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def assign(
        self, handle: ReplicaHandle, spec: VersionSpec, params: dict[str, Any]
    ) -> None:
        """``POST /assign``: give a standby process its version (``params``: the batch
        policy and what the backend adds). Its outcome is observed through ``/info``."""
        with contextlib.suppress(httpx.HTTPError):
            await self.http.post(
                f"{handle.url}/assign", json=spec.model_dump(mode="json"), params=params,
                timeout=CHANGE_TIMEOUT_S, headers=handle.auth,
            )  # fmt: skip

    async def aclose(self) -> None:
        await self.http.aclose()
