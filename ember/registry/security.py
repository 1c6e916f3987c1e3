"""API keys: generated with 256 bits of entropy, stored only as a sha256 digest.

A fast digest is the right hash here: the secret is random, not a password, so there is
nothing for a slow KDF to protect, and lookup by digest keeps authentication O(1).
"""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "ek_"


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def display_prefix(key: str) -> str:
    return key[:10]
