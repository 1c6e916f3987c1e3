"""The `ember` command against a live API: push (file:// and s3:// multipart), deploy."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest

from ember.api.app import create_app
from ember.config import Settings
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.artifacts import write_valid

EMBER = str(Path(sys.executable).with_name("ember"))
TORCH = ("--engine", "torch", "--engine-config", '{"factory": "ember.engine.examples.mlp:mlp"}')


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")} | env
    full["COLUMNS"] = "200"
    full.setdefault("XDG_CACHE_HOME", str(Path(tempfile.gettempdir()) / "ember-test-cache"))
    return subprocess.run([EMBER, *args], env=full, capture_output=True, text=True, timeout=120)


def start(settings: Settings, env: dict[str, str]) -> Iterator[dict[str, str]]:
    with services.serve_app(create_app(settings)) as url:
        yield env | {"EMBER_URL": url, "EMBER_API_KEY": ADMIN_KEY}


@pytest.fixture
def file_env(data_dir: Path) -> Iterator[dict[str, str]]:
    settings = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, pools_enabled=False)  # type: ignore[arg-type]
    yield from start(settings, {"EMBER_DATA_DIR": str(data_dir)})


def test_push_deploy_promote_from_the_command_line(
    file_env: dict[str, str], tmp_path: Path
) -> None:
    artifact = tmp_path / "minilm"
    write_valid(artifact / "model.safetensors")
    (artifact / "config.json").write_text('{"hidden_size": 8}')
    pushed = run(
        file_env,
        "models",
        "push",
        str(artifact),
        "--name",
        "minilm",
        "--version",
        "1",
        "--engine",
        "transformers",
    )
    assert pushed.returncode == 0, pushed.stderr
    assert '"status": "ready"' in pushed.stdout
    digest = hashlib.sha256((artifact / "model.safetensors").read_bytes()).hexdigest()
    assert digest in pushed.stdout
    stored = Path(file_env["EMBER_DATA_DIR"]) / "objects" / "artifacts" / "default" / "minilm" / "1"
    assert (stored / "config.json").read_text() == '{"hidden_size": 8}'

    again = run(file_env, "models", "push", str(artifact), "--name", "minilm", "--version", "1")
    assert again.returncode == 1 and "already exists" in again.stderr

    assert (
        run(
            file_env,
            "models",
            "push",
            str(artifact / "model.safetensors"),
            "-n",
            "minilm",
            "-v",
            "2",
            *TORCH,
        ).returncode
        == 0
    )
    listed = run(file_env, "models", "ls")
    assert listed.returncode == 0 and "minilm" in listed.stdout
    created = run(file_env, "deployments", "create", "minilm", "-v", "1", "--set", "min_hot=2")
    assert created.returncode == 0, created.stderr
    assert run(file_env, "deployments", "canary", "minilm", "-v", "2").returncode == 0
    promoted = run(file_env, "deployments", "promote", "minilm")
    assert promoted.returncode == 0 and '"production": "2"' in promoted.stdout
    bad = run(file_env, "deployments", "update", "minilm", "--set", "min_hot=0")
    assert bad.returncode == 1 and "scale_to_zero" in bad.stderr


def test_errors_are_one_clear_line(file_env: dict[str, str]) -> None:
    result = run(file_env, "models", "get", "nope")
    assert result.returncode == 1
    assert "Not found: model 'nope' does not exist" in " ".join(result.stderr.split())
    unauth = run(file_env | {"EMBER_API_KEY": "ek_wrong"}, "models", "ls")
    assert unauth.returncode == 1 and "not valid" in unauth.stderr
    typo = run(file_env | {"EMBER_PROT": "1"}, "models", "push", "x", "-n", "a", "-v", "1")
    assert typo.returncode != 0


@pytest.mark.s3
def test_push_to_s3_uses_multipart_and_validates_over_http(
    moto_endpoint: str, data_dir: Path, tmp_path: Path
) -> None:
    bucket = "ember-artifacts"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket
    )
    env = {
        "EMBER_DATA_DIR": str(data_dir),
        "EMBER_OBJECT_STORE_URL": f"s3://{bucket}/team",
        "EMBER_S3_ENDPOINT_URL": moto_endpoint,
        "EMBER_S3_PART_SIZE_BYTES": str(5 * 1024 * 1024),
    }
    settings = Settings(
        data_dir=data_dir,
        admin_key=ADMIN_KEY,
        object_store_url=f"s3://{bucket}/team",  # type: ignore[arg-type]
        s3_endpoint_url=moto_endpoint,
        pools_enabled=False,
    )
    artifact = write_valid(tmp_path / "big.safetensors", tensors=3, rows=128 * 1024)  # 12 MiB
    for cli_env in start(settings, env):
        pushed = run(cli_env, "models", "push", str(artifact), "-n", "big", "-v", "1", *TORCH)
        assert pushed.returncode == 0, pushed.stderr
        version = httpx.get(
            f"{cli_env['EMBER_URL']}/v1/models/big/versions/1",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        ).json()
    assert version["artifact_uri"] == f"s3://{bucket}/team/artifacts/default/big/1/big.safetensors"
    assert version["status"] == "ready"
    assert version["sha256"] == hashlib.sha256(artifact.read_bytes()).hexdigest()
    head = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").head_object(
        Bucket=bucket, Key="team/artifacts/default/big/1/big.safetensors"
    )
    assert head["ETag"].strip('"').endswith("-3")  # three 5 MiB parts: a multipart upload


def test_calibrate_stores_a_cost_model_for_this_hardware(
    file_env: dict[str, str], tmp_path: Path
) -> None:
    import json

    from ember.engine.examples.mlp import ENGINE_CONFIG, INPUT_SCHEMA, build_mlp_artifact

    artifact = build_mlp_artifact(tmp_path / "mlp.safetensors")
    pushed = run(
        file_env,
        "models",
        "push",
        str(artifact),
        "-n",
        "mlp",
        "-v",
        "1",
        "--engine",
        "torch",
        "--engine-config",
        json.dumps(ENGINE_CONFIG),
        "--input-schema",
        json.dumps(INPUT_SCHEMA),
    )
    assert pushed.returncode == 0, pushed.stderr
    result = run(file_env, "calibrate", "mlp:1", "--repeats", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout)
    assert measured["hardware"].startswith("cpu-") and measured["capacity_units_per_s"] > 0
    version = httpx.get(
        f"{file_env['EMBER_URL']}/v1/models/mlp/versions/1",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ).json()
    assert version["cost_models"][measured["hardware"]]["gamma"] == measured["gamma"] > 0


def test_cache_warm_ls_evict_through_the_registry(file_env: dict[str, str], tmp_path: Path) -> None:
    artifact = write_valid(tmp_path / "w.safetensors")
    assert (
        run(file_env, "models", "push", str(artifact), "-n", "cached", "-v", "3", *TORCH).returncode
        == 0
    )
    warmed = run(file_env, "cache", "warm", "cached:3")
    assert warmed.returncode == 0, warmed.stderr
    listed = run(file_env, "cache", "ls")
    assert "cached:3" in listed.stdout
    assert run(file_env, "cache", "evict", "cached:3").returncode == 0
    assert "cached:3" not in run(file_env, "cache", "ls").stdout
    missing = run(file_env, "cache", "warm", "cached:9")
    assert missing.returncode == 1 and "does not exist" in missing.stderr


def test_a_version_that_can_never_serve_is_refused(
    file_env: dict[str, str], tmp_path: Path
) -> None:
    artifact = write_valid(tmp_path / "w.safetensors")
    refused = run(
        file_env, "models", "push", str(artifact), "-n", "m", "-v", "1", "--engine", "torch"
    )
    assert refused.returncode == 1 and "engine_config.factory" in refused.stderr
