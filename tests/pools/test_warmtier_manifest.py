"""The shared warm tier holds a directory version's shards, and counts the version held
only when every shard is."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ember.config import Settings
from ember.domain.spec import DeploymentKey, VersionSpec
from ember.loader.cache import WeightCache, tenant_cache_dir
from ember.loader.load import WeightLoader
from ember.loader.warmset import WarmSet
from ember.pools.warmtier import SharedWarmTier
from ember.registry import validation

pytest.importorskip("torch")


def _controller(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The controller's deployments (one, serving ``spec``) and replicas (none)."""
    view = SimpleNamespace(model="mlp", traffic={"1": 100}, specs={"1": VersionSpec(**spec)})
    return {DeploymentKey(1, "mlp"): view}, {}


def test_a_directory_version_is_held_shard_by_shard(data_dir: Path) -> None:
    from ember.engine.examples.mlp import build_mlp_directory

    folder = build_mlp_directory(data_dir / "objects" / "mlp", shards=3, layers=5)
    settings = Settings(data_dir=data_dir)
    uri = folder.as_uri() + "/"
    facts = validation.inspect_artifact(uri, settings, None)
    spec = {"model": "mlp", "version": "1", "artifact_uri": uri, "sha256": facts.sha256,
            "files": facts.files, "engine": "torch"}  # fmt: skip
    # A replica of tenant 1 loaded it: its entries are in that tenant's cache directory.
    replica = Settings(data_dir=data_dir, cache_dir=tenant_cache_dir(settings.weight_cache_dir, 1))
    WeightLoader(replica).warm_version(VersionSpec(**spec))

    shards = [f for f in facts.files or () if f["path"].endswith(".safetensors")]
    cache = WeightCache.from_settings(settings)
    tier = SharedWarmTier(WarmSet(cache, 10 * 1024**3, lock=False))
    wanted = tier.wanted(*_controller(spec))
    assert sorted(k.sha256 for k in wanted) == sorted(f["sha256"] for f in shards)
    assert {k.manifest for k in wanted} == {facts.sha256} and {k.tenant for k in wanted} == {1}
    tier.record(tier.warm_set.sync(wanted))
    assert tier.holds("mlp", "1", facts.sha256)
    assert tier.warm_set.bytes_held == sum(f["size"] for f in shards)

    # A budget that fits some shards but not all: the version is not held warm.
    small = SharedWarmTier(WarmSet(cache, max(f["size"] for f in shards), lock=False))
    tier.warm_set.close()
    wanted = small.wanted(*_controller(spec))
    small.record(small.warm_set.sync(wanted))
    assert small.warm_set.held and not small.holds("mlp", "1", facts.sha256)
    small.warm_set.close()
