"""A replica's heap and Python's cyclic GC.

What a replica imports and loads lives as long as the process: the runtime (torch), then
the engine's model and the modules its load imports. Left in the GC's generations, every
full collection walks it while requests wait (minilm on one core: 130-160 ms a collection
with the model loaded), and the collections that run *while* it is being made walk it
again and again (a CPU replica's start spent ~0.85 s in them). So each of those phases
runs with the cyclic GC off, ends with one collection (what it left as garbage is freed,
not kept) and freezes what stays (``gc.freeze``: out of every later collection's view).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def frozen_after() -> Iterator[None]:
    """The block with the cyclic GC off; then one collection, a freeze, the GC back on
    (also when the block raises)."""
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


def gc_state() -> dict[str, Any]:
    """What ``/info`` says of the GC: whether it runs and how many objects are frozen."""
    return {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
