"""What a worker's shards share: the direct lanes to replicas, and a cache of the input
files they read. (Their HTTP client, to the gateway and to replicas alike, is
``ember.work.client.GatewayClient``, the one jobs use too.)

**Lane**: one version's direct route. The gateway's ``:batch-lane`` names the version's
ready replicas and the batch class's window on each; the worker posts its batches to
their ``/infer`` itself (refreshing the list every ``refresh_s``, and reporting the
instances it sent that way as demand). Through the gateway a 64-row batch cost the
gateway's event loop a request, a hop and an answer, and both ends a JSON answer of a
float object per value: a third of the batch run's CPU, on the cores the model uses. A
replica that refuses the connection or says it is not ready is left out until the next
refresh; with none left the batch goes through ``:predict``.

**InputCache**: the shards of one file each read the whole object (rows are counted, not
addressed); the cache keeps recent objects by URI, ETag and size within a byte budget
while shards keep asking for them (30 s), and concurrent shards of one file wait for a
single read instead of each reading it.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ember.batch.datasets import Memo
from ember.domain.spec import replica_auth
from ember.loader.stores import ObjectInfo
from ember.logs import get_logger
from ember.work.client import GatewayClient

log = get_logger(__name__)

CACHE_BYTES = 512 * 1024**2
"""Input bytes a worker keeps for its shards (a file larger than this is not kept)."""
IDLE_S = 30.0
"""A file no shard of this worker asked for in this long is dropped."""


@dataclass(eq=False)
class Target:
    """A replica of the lane: where to post, and what this worker has in flight there."""

    replica_id: str
    url: str
    window: int
    """Instances the batch class may keep in flight to it."""
    client: GatewayClient
    inflight: int = 0


@dataclass(eq=False)
class Lane:
    """One version's direct route to its replicas, for one tenant (``refresh`` asks the
    gateway at most every ``refresh_s``; shards share it)."""

    gateway: GatewayClient
    tenant: str
    model: str
    version: str
    targets: list[Target] = field(default_factory=list)
    expires: float = 0.0
    sent: int = 0
    """Instances sent directly since the gateway was last told."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    refreshing: threading.Lock = field(default_factory=threading.Lock)
    clients: dict[str, GatewayClient] = field(default_factory=dict)
    error: str | None = None
    """Why the last refresh found no route (for the logs), None when it did."""

    def refresh(self) -> None:
        """Ask the gateway again if the answer is stale (one thread asks; the others keep
        using the old list meanwhile). Any failure leaves no targets: the batches go
        through ``:predict``, which says what is wrong."""
        if time.monotonic() < self.expires:
            return
        first = self.expires == 0.0  # no answer yet: the others wait for this one
        if not self.refreshing.acquire(blocking=first):
            return
        if first and self.expires != 0.0:  # another thread asked while this one waited
            self.refreshing.release()
            return
        try:
            with self.lock:
                sent, self.sent = self.sent, 0
            path = f"/v1/models/{self.model}/versions/{self.version}:batch-lane"
            body = json.dumps({"sent": sent}).encode()
            headers = {"Content-Type": "application/json", "X-Ember-Tenant": self.tenant}
            refresh_s = 1.0
            try:
                reply = self.gateway.post(path, body, headers)
                doc = json.loads(reply.content) if reply.status_code == 200 else None
                if doc is None:
                    self.error = f"{reply.status_code}: {reply.text[:200]}"
                    replicas: list[dict[str, object]] = []
                else:
                    replicas = list(doc["replicas"])
                    refresh_s = min(30.0, max(0.1, float(doc.get("refresh_s", 1.0))))
                    self.error = None if replicas else "no ready replica"
            except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"[:200]
                replicas = []
                with self.lock:
                    self.sent += sent  # tell it next time
            was = self.direct
            self._adopt(replicas)
            self.expires = time.monotonic() + refresh_s
            if self.direct != was or first:
                if self.direct:
                    log.info("batch lane: straight to the replicas", replicas=len(replicas))
                else:
                    log.info("batch lane: through the gateway", reason=self.error)
        finally:
            self.refreshing.release()

    def _adopt(self, replicas: list[dict[str, object]]) -> None:
        """The gateway's list as targets (an entry that is not one is skipped); the
        clients of replicas it no longer names are closed."""
        with self.lock:
            old = {t.replica_id: t for t in self.targets}
            targets = []
            for r in replicas:
                try:
                    rid, url, window = str(r["id"]), str(r["url"]), int(str(r["window"]))
                    auth = replica_auth(str(r.get("secret") or ""))  # its client sends it
                    target = old.get(rid)
                    if target is None or target.url != url or target.client.headers != auth:
                        client = self.clients.get(url)
                        if client is None or client.headers != auth:
                            if client is not None:
                                client.close()
                            client = self.clients[url] = GatewayClient(url, auth)
                        target = Target(rid, url, window, client)
                except (KeyError, TypeError, ValueError):
                    continue
                target.window = max(1, window)
                targets.append(target)
            self.targets = targets
            named = {t.url for t in targets}
            gone = [self.clients.pop(u) for u in list(self.clients) if u not in named]
        for client in gone:  # a call still on one fails over to the next target
            client.close()

    @property
    def direct(self) -> bool:
        return bool(self.targets)

    def window(self) -> int:
        """Instances the batch class may keep in flight on the lane (0: no target)."""
        with self.lock:
            return sum(t.window for t in self.targets)

    def take(self) -> Target | None:
        """The target with the least in flight (relative to its window), or None."""
        with self.lock:
            if not self.targets:
                return None
            target = min(self.targets, key=lambda t: t.inflight / t.window)
            target.inflight += 1
            return target

    def done(self, target: Target, sent: int, ok: bool) -> None:
        """A call to ``target`` ended; ``ok=False`` leaves it out until the next refresh."""
        with self.lock:
            target.inflight -= 1
            self.sent += sent
            if not ok and target in self.targets:
                self.targets.remove(target)

    def close(self) -> None:
        with self.lock:
            clients, self.clients = list(self.clients.values()), {}
        for client in clients:
            client.close()


class InputCache:
    def __init__(self, max_bytes: int = CACHE_BYTES, idle_s: float = IDLE_S) -> None:
        self.max_bytes = max_bytes
        self.idle_s = idle_s
        self.lock = threading.Lock()
        self.entries: OrderedDict[tuple[str, str, int], tuple[bytes, Memo]] = OrderedDict()
        self.used: dict[tuple[str, str, int], float] = {}
        self.loading: dict[tuple[str, str, int], threading.Lock] = {}

    def get(self, info: ObjectInfo, read: Callable[[ObjectInfo], bytes]) -> tuple[bytes, Memo]:
        """The object's bytes, cached or read once (``read(info)``) for every caller, and
        a memo that lives as long as they stay cached (what shards derive from the file
        and share: its line offsets)."""
        key = (info.uri, info.etag, info.size)
        with self.lock:
            hit = self._hit(key)
            if hit is not None:
                return hit
            loading = self.loading.setdefault(key, threading.Lock())
        with loading:
            with self.lock:
                hit = self._hit(key)
                if hit is not None:
                    return hit
            try:
                data = read(info)
                entry = (data, Memo())
                if len(data) <= self.max_bytes:
                    with self.lock:
                        self.entries[key] = entry
                        self.used[key] = time.monotonic()
                        self._trim(self.max_bytes)
            finally:
                with self.lock:
                    self.loading.pop(key, None)
            return entry

    def trim(self) -> None:
        """Drop the files no shard asked for in ``idle_s`` (the worker's sweep calls it):
        an idle worker holds no input."""
        with self.lock:
            horizon = time.monotonic() - self.idle_s
            for key in [k for k, t in self.used.items() if t < horizon]:
                self.entries.pop(key, None)
                self.used.pop(key, None)

    def _trim(self, max_bytes: int) -> None:
        total = sum(len(v[0]) for v in self.entries.values())
        while total > max_bytes:
            key, evicted = self.entries.popitem(last=False)
            self.used.pop(key, None)
            total -= len(evicted[0])

    def _hit(self, key: tuple[str, str, int]) -> tuple[bytes, Memo] | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            self.used[key] = time.monotonic()
        return entry
