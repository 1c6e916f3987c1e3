"""The API-key cache refreshes a key in use before it expires, off the request path, and
never brings back a key that was revoked or that the refresh found invalid."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from ember.api.deps import PrincipalCache
from ember.errors import Unauthenticated

KEY = ("digest", None)


class _Principal:  # the one field the cache reads (``Principal.key_id``)
    def __init__(self, key_id: int) -> None:
        self.key_id = key_id


def principal(key_id: int = 7) -> Any:
    return _Principal(key_id)


async def _settle(cache: PrincipalCache) -> None:
    """Until the refresh's thread is done and its callback ran on the loop."""
    for _ in range(500):
        await asyncio.sleep(0.002)
        if not cache.refreshing:
            return
    raise AssertionError("the refresh never settled")


def test_a_key_in_use_is_refreshed_ahead_once_and_never_expires() -> None:
    async def main() -> None:
        cache = PrincipalCache(ttl_s=2.0)
        calls: list[int] = []

        def refresh() -> Any:
            calls.append(1)
            return principal(8)

        first = principal(7)
        cache.put(KEY, first)
        assert cache.get(KEY, refresh) is first and calls == []  # young: no refresh
        await asyncio.sleep(1.2)  # past half its life
        hits = [cache.get(KEY, refresh) for _ in range(5)]
        assert hits == [first] * 5  # answered from the cache while the refresh runs
        await _settle(cache)
        assert calls == [1]  # one refresh for all those hits
        await asyncio.sleep(0.9)  # beyond the first entry's expiry
        refreshed = cache.get(KEY, refresh)
        assert refreshed is not None and refreshed.key_id == 8

    asyncio.run(main())


def test_a_refresh_that_finds_the_key_revoked_drops_it() -> None:
    async def main() -> None:
        cache = PrincipalCache(ttl_s=1.0)

        def refresh() -> Any:
            raise Unauthenticated("the API key is not valid (unknown or revoked)")

        cache.put(KEY, principal())
        await asyncio.sleep(0.6)
        assert cache.get(KEY, refresh) is not None
        await _settle(cache)
        assert cache.get(KEY) is None

    asyncio.run(main())


def test_a_database_error_leaves_the_entry_to_run_out() -> None:
    async def main() -> None:
        cache = PrincipalCache(ttl_s=2.0)

        def refresh() -> Any:
            raise RuntimeError("database unreachable")

        cache.put(KEY, principal())
        await asyncio.sleep(1.1)
        assert cache.get(KEY, refresh) is not None
        await _settle(cache)
        assert cache.get(KEY) is not None  # still there until its own expiry
        await asyncio.sleep(1.0)
        assert cache.get(KEY) is None

    asyncio.run(main())


def test_a_revocation_during_a_refresh_wins() -> None:
    async def main() -> None:
        cache = PrincipalCache(ttl_s=1.0)
        reading = threading.Event()
        release = threading.Event()

        def refresh() -> Any:  # read the key before the revocation commits
            reading.set()
            release.wait(5)
            return principal(7)

        cache.put(KEY, principal(7))
        await asyncio.sleep(0.6)
        assert cache.get(KEY, refresh) is not None
        await asyncio.to_thread(reading.wait, 5)
        cache.forget_key(7)
        release.set()
        await _settle(cache)
        assert cache.get(KEY) is None and not cache.refreshing

    asyncio.run(main())
