"""A GPU as the platform names it, and ``EMBER_GPUS`` read: plain values with no driver
behind them, so that the settings can validate the setting without importing the replica
backend that discovers and hands out devices (``ember.pools.backends.gpus``)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_ID = re.compile(r"^(\d+|(GPU|MIG)-[A-Za-z0-9/-]+)$")


@dataclass(frozen=True)
class Gpu:
    """One device a replica may be given whole."""

    id: str
    """What the replica's ``CUDA_VISIBLE_DEVICES`` names it by: its UUID (``GPU-…``,
    ``MIG-…``) where NVML found it, so that no index order can be misread; else as
    ``EMBER_GPUS`` wrote it."""
    name: str = ""
    memory_bytes: int = 0
    index: int | None = None
    """NVML's index of the GPU (of its parent GPU, for a MIG device); None where stated."""

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "memory_bytes": self.memory_bytes}


def parse_setting(value: str) -> tuple[Gpu, ...] | None:
    """``EMBER_GPUS`` read: None for ``auto``; the stated devices otherwise — ``none`` or
    empty (no GPUs), device ids (``0,1``, ``GPU-…``, ``MIG-…``), or a JSON list of objects
    ``{"id": "0", "name": "NVIDIA L4", "memory_bytes": 23034593280}`` (``name`` and
    ``memory_bytes`` optional). ValueError for anything else, a duplicate id included."""
    text = value.strip()
    if text.lower() == "auto":
        return None
    if text.lower() in ("", "none"):
        return ()
    if text.startswith("["):
        gpus = tuple(_from_json(entry) for entry in _json_list(text))
    else:
        gpus = tuple(Gpu(_checked_id(part.strip())) for part in text.split(","))
    ids = [g.id for g in gpus]
    if len(set(ids)) != len(ids):
        raise ValueError(f"EMBER_GPUS names a device twice: {ids}")
    return gpus


def _json_list(text: str) -> list[Any]:
    try:
        entries = json.loads(text)
    except ValueError:
        raise ValueError("EMBER_GPUS: not a JSON list of devices") from None
    if not isinstance(entries, list):
        raise ValueError("EMBER_GPUS: not a JSON list of devices")
    return entries


def _from_json(entry: Any) -> Gpu:
    if not isinstance(entry, dict) or set(entry) - {"id", "name", "memory_bytes"}:
        raise ValueError('EMBER_GPUS: each device is {"id": ..., "name": ..., "memory_bytes": ...}')
    name, memory = entry.get("name", ""), entry.get("memory_bytes", 0)
    if not isinstance(name, str) or len(name) > 256:
        raise ValueError("EMBER_GPUS: a device's name is a string")
    if not isinstance(memory, int) or isinstance(memory, bool) or memory < 0:
        raise ValueError("EMBER_GPUS: a device's memory_bytes is a whole number of bytes")
    return Gpu(_checked_id(str(entry.get("id", ""))), name, memory)


def _checked_id(text: str) -> str:
    if not _ID.match(text) or len(text) > 128:
        raise ValueError(f"EMBER_GPUS: {text[:40]!r} is not a device index or GPU-/MIG- UUID")
    return text
