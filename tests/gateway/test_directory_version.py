"""A directory version (sharded checkpoint, index, config) end to end on a live platform:
registered over the API, deployed, served by a replica the controller started, its
manifest digest in the prediction log records."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ember.engine.examples.mlp import INPUT_SCHEMA, build_mlp_directory, mlp
from tests.gateway.conftest import Live, X, deploy


def test_a_sharded_version_is_registered_deployed_and_served(live: Live) -> None:
    import torch

    folder = build_mlp_directory(live.store / "mlp-dir" / "3", seed=3, shards=3, layers=5)
    live.client.post("/v1/models", json={"name": "mlp-dir"})
    body = {"version": "3", "artifact_uri": folder.as_uri() + "/", "engine": "torch",
            "engine_config": {"factory": "ember.engine.examples.mlp:mlp",
                              "kwargs": {"layers": 5}},
            "input_schema": INPUT_SCHEMA}  # fmt: skip
    created = live.client.post("/v1/models/mlp-dir/versions", json=body)
    assert created.status_code in (201, 202), created.text
    live.wait(
        lambda: live.client.get("/v1/models/mlp-dir/versions/3").json()["status"] == "ready",
        "the directory version to validate",
    )
    version = live.client.get("/v1/models/mlp-dir/versions/3").json()
    assert len(version["files"]) == len(list(Path(folder).iterdir()))
    deploy(live, "mlp-dir", "3")
    answer = live.predict("mlp-dir", 2)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-ember-version"] == "3"
    torch.manual_seed(3)
    want = mlp(layers=5).eval()(torch.tensor([X, X])).detach().numpy()
    np.testing.assert_allclose(answer.json()["predictions"], want, atol=1e-5)
    # The replica's weights are the manifest's: per-file entries under its digest.
    cached = list(live.store.parent.glob(f"cache/t*/v1/mlp-dir/3/{version['sha256']}/f/*"))
    assert len(cached) == len(version["files"])
