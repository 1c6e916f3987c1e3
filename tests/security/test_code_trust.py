"""Code trust (issue 20 §1): a tenant names only the code the operator allowed.

Against a real API (uvicorn on loopback, a real SQLite registry and file store) and, for
the replica's own check, a live API with real ``ember engine`` replicas.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.api.app import create_app
from ember.config import Settings
from ember.domain.spec import VersionSpec
from ember.errors import InvalidInput
from tests import services
from tests.api.conftest import ADMIN_KEY, Api
from tests.artifacts import write_valid

EMBER = str(Path(sys.executable).with_name("ember"))
MLP = {"factory": "ember.engine.examples.mlp:mlp"}


@contextlib.contextmanager
def serve(data_dir: Path, **settings: Any) -> Iterator[Api]:
    config = Settings(
        data_dir=data_dir,
        admin_key=ADMIN_KEY,  # type: ignore[arg-type]
        pools_enabled=False,
        validate_inline_max_bytes=1024 * 1024,
        **settings,
    )
    with (
        services.serve_app(create_app(config)) as url,
        httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        ) as admin,  # fmt: skip
    ):
        yield Api(url, admin, config)


@pytest.fixture
def api(data_dir: Path) -> Iterator[Api]:
    with serve(data_dir) as running:
        yield running


def artifact(api: Api, tenant: str, model: str, version: str) -> str:
    """A valid artifact under the tenant's own prefix of the store; its URI."""
    path = api.settings.data_dir / "objects" / "artifacts" / tenant / model / version
    return write_valid(path / "model.safetensors").as_uri()


def version_body(uri: str, engine: str = "torch", **config: Any) -> dict[str, Any]:
    return {"version": "1", "artifact_uri": uri, "engine": engine, "engine_config": config}


def refused(response: httpx.Response, named: str, location: str | None = None) -> None:
    """A 422 invalid-input problem that names ``named`` (not an artifact problem: the
    code was refused before the artifact was looked at)."""
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["type"].endswith("/invalid-input"), body
    assert named in body["detail"], body
    if location is not None:
        assert any(e["location"] == location for e in body.get("errors", [])), body


def versions(client: httpx.Client, model: str) -> list[dict[str, Any]]:
    listed = client.get(f"/v1/models/{model}/versions")
    assert listed.status_code == 200, listed.text
    return list(listed.json()["items"])


# --- torch factories --------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory",
    [
        "os:system",
        "subprocess:Popen",
        "builtins:exec",
        "shutil:rmtree",
        "mycorp.evil:build",  # a module outside the allowlist
        "ember.engine.examples.mlp:build_mlp_artifact",  # Ember's, but writes files
        "ember.engine.examples.mlp:os.system",  # an attribute path out of an allowed module
        "ember.engine.examples.mlp:mlp.__globals__",
    ],
)
def test_a_tenant_cannot_name_a_factory_outside_the_allowlist(api: Api, factory: str) -> None:
    alice = api.tenant_client("alice")
    assert alice.post("/v1/models", json={"name": "m"}).status_code == 201
    uri = artifact(api, "alice", "m", "1")
    refused(alice.post("/v1/models/m/versions", json=version_body(uri, factory=factory)),
            factory, "engine_config.factory")  # fmt: skip
    assert versions(alice, "m") == []
    # before any I/O on the artifact: a missing one is not what the answer is about
    missing = uri.replace("/1/model.safetensors", "/9/none.safetensors")
    refused(alice.post("/v1/models/m/versions", json=version_body(missing, factory=factory)),
            factory)  # fmt: skip
    assert versions(alice, "m") == []
    # the example factory itself is fine
    created = alice.post("/v1/models/m/versions", json=version_body(uri, **MLP))
    assert created.status_code == 201, created.text


def test_factory_kwargs_and_unknown_engine_config_keys_are_refused(api: Api) -> None:
    alice = api.tenant_client("alice")
    alice.post("/v1/models", json={"name": "m"})
    uri = artifact(api, "alice", "m", "1")
    for engine, config in [
        ("torch", {**MLP, "kwargs": [1, 2]}),
        ("torch", {**MLP, "kwargs": {"not a name": 1}}),
        ("torch", {**MLP, "trust_remote_code": True}),
        ("transformers", {"task": "embedding", "trust_remote_code": True}),
        ("transformers", {"task": "embedding", "revision": "main"}),
        ("vllm", {"trust_remote_code": True}),
        ("vllm", {"dtype": "--trust-remote-code"}),
    ]:
        response = alice.post("/v1/models/m/versions", json=version_body(uri, engine, **config))
        assert response.status_code == 422, (engine, config, response.text)
        assert "engine_config" in response.json()["detail"], response.text
    assert versions(alice, "m") == []


# --- vLLM flags -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("trust-remote-code", True),
        ("trust_remote_code", True),
        ("load-format", "auto"),
        ("worker-extension-cls", "mycorp.evil.Worker"),
        ("model", "/etc"),
        ("tokenizer", "/etc"),
        ("download-dir", "/tmp"),
        ("served-model-name", "other-tenants-model"),
        ("model-loader-extra-config", '{"path": "/etc/shadow"}'),
        ("max-model-len", 4096),  # Ember's own (engine_config.max_model_len)
        ("hf-overrides", '{"architectures": ["X"]}'),
        ("chat-template", "/etc/passwd"),
        ("config", "/etc/ember.yaml"),
        ("no-enable-prefix-caching", True),
    ],
)
def test_vllm_args_outside_the_allowlist_are_refused(api: Api, key: str, value: Any) -> None:
    alice = api.tenant_client("alice")
    alice.post("/v1/models", json={"name": "llm"})
    uri = artifact(api, "alice", "llm", "1")
    body = version_body(uri, "vllm", vllm_args={"max-num-batched-tokens": 2048, key: value})
    refused(alice.post("/v1/models/llm/versions", json=body), key,
            f"engine_config.vllm_args.{key}")  # fmt: skip
    assert versions(alice, "llm") == []


def test_vllm_args_values_are_bounded_scalars(api: Api) -> None:
    alice = api.tenant_client("alice")
    alice.post("/v1/models", json={"name": "llm"})
    uri = artifact(api, "alice", "llm", "1")
    for args in [
        {"max-num-batched-tokens": "--trust-remote-code"},
        {"max-num-batched-tokens": 10**400},
        {"seed": [1, 2]},
        {"gpu-memory-utilization": 5},
        {"kv-cache-dtype": "fp8 --trust-remote-code"},
        {"enable-prefix-caching": "yes"},
        {"quantization": None},
    ]:
        response = alice.post(
            "/v1/models/llm/versions", json=version_body(uri, "vllm", vllm_args=args)
        )
        refused(response, next(iter(args)))
    assert versions(alice, "llm") == []
    tuned = {"max-num-batched-tokens": 2048, "enable-prefix-caching": False, "seed": 7,
             "gpu-memory-utilization": 0.5, "kv-cache-dtype": "auto"}  # fmt: skip
    created = alice.post("/v1/models/llm/versions", json=version_body(uri, "vllm", vllm_args=tuned))
    assert created.status_code == 201, created.text


# --- trust and the settings that widen it -----------------------------------------------


def test_a_tenant_an_admin_marks_trusted_may_name_other_code(api: Api) -> None:
    alice = api.tenant_client("alice")
    alice.post("/v1/models", json={"name": "m"})
    uri = artifact(api, "alice", "m", "1")
    custom = version_body(uri, factory="mycorp.models.tiny:build", kwargs={"width": 8})
    refused(alice.post("/v1/models/m/versions", json=custom), "mycorp.models.tiny:build")
    # a tenant cannot trust itself
    assert alice.patch("/v1/tenants/alice", json={"trusted": True}).status_code == 403

    assert api.admin.patch("/v1/tenants/alice", json={"trusted": True}).status_code == 200
    created = alice.post("/v1/models/m/versions", json=custom)
    assert created.status_code == 201, created.text
    assert created.json()["engine_config"]["factory"] == "mycorp.models.tiny:build"
    llm = version_body(uri, "vllm", vllm_args={"trust-remote-code": True}) | {"version": "2"}
    assert alice.post("/v1/models/m/versions", json=llm).status_code == 201
    # even a trusted tenant never overrides what Ember sets itself
    own = version_body(uri, "vllm", vllm_args={"load-format": "auto"}) | {"version": "3"}
    refused(alice.post("/v1/models/m/versions", json=own), "load-format")

    # trust withdrawn: refused again
    api.admin.patch("/v1/tenants/alice", json={"trusted": False})
    again = custom | {"version": "4"}
    refused(alice.post("/v1/models/m/versions", json=again), "mycorp.models.tiny:build")
    # another tenant was never trusted
    bob = api.tenant_client("bob")
    bob.post("/v1/models", json={"name": "m"})
    bob_custom = custom | {"artifact_uri": artifact(api, "bob", "m", "1")}
    refused(bob.post("/v1/models/m/versions", json=bob_custom), "mycorp.models.tiny:build")
    assert versions(bob, "m") == []


def test_the_settings_widen_and_narrow_what_every_tenant_may_name(data_dir: Path) -> None:
    widened = {
        "engine_factories": ["ember.engine.examples.mlp:mlp", "mycorp.models.*"],
        "vllm_args_allowed": ["max-seq-len-to-capture", "load-format"],
    }
    with serve(data_dir, **widened) as api:
        alice = api.tenant_client("alice")
        alice.post("/v1/models", json={"name": "m"})
        uri = artifact(api, "alice", "m", "1")

        def post(version: str, engine: str = "torch", **config: Any) -> httpx.Response:
            body = version_body(uri, engine, **config) | {"version": version}
            return alice.post("/v1/models/m/versions", json=body)

        assert post("1", factory="mycorp.models.tiny:build").status_code == 201
        refused(post("2", factory="mycorp.modelsx:build"), "mycorp.modelsx:build")
        refused(post("2", factory="mycorp.models.tiny:_private"), "mycorp.models.tiny:_private")
        refused(post("2", factory="mycorp.models.tiny:os.system"), "mycorp.models.tiny:os.system")
        # the setting replaces the default: slow_mlp is no longer listed
        refused(post("2", factory="ember.engine.examples.mlp:slow_mlp"), "slow_mlp")
        assert post("2", "vllm", vllm_args={"max-seq-len-to-capture": 512}).status_code == 201
        # an operator cannot allow a flag Ember sets itself
        refused(post("3", "vllm", vllm_args={"load-format": "auto"}), "load-format")


def test_the_cli_shows_the_refusal(api: Api) -> None:
    alice = api.tenant_client("alice")
    alice.post("/v1/models", json={"name": "m"})
    key = alice.headers["Authorization"].removeprefix("Bearer ")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env |= {"EMBER_URL": api.url, "EMBER_API_KEY": key, "COLUMNS": "200"}
    uri = artifact(api, "alice", "m", "1")
    done = subprocess.run(
        [EMBER, "models", "register", "m", "-v", "1", "--uri", uri,
         "--engine-config", '{"factory": "os:system"}'],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout
    assert "os:system" in done.stderr and "not allowed" in done.stderr, done.stderr
    assert versions(alice, "m") == []


# --- the replica's own check ------------------------------------------------------------


def spec(factory: str, trusted: bool = False, **config: Any) -> VersionSpec:
    return VersionSpec(model="m", version="1", artifact_uri="file:///nowhere/model.safetensors",
                       sha256="", engine="torch", engine_config={"factory": factory, **config},
                       trusted=trusted)  # fmt: skip


def test_a_replica_refuses_a_factory_outside_its_allowlist_before_importing_it(
    settings: Settings,
) -> None:
    from ember.engine.torch_engine import TorchEngine

    for factory in ("os:system", "ember_no_such_module:build", "subprocess:Popen"):
        with pytest.raises(InvalidInput, match="not allowed") as caught:
            TorchEngine(spec(factory), settings)
        assert factory in caught.value.detail
    assert "ember_no_such_module" not in sys.modules
    # a module an operator allowed whole may still not lend what it imported
    wide = Settings(data_dir=settings.data_dir, engine_factories=["ember.engine.examples.mlp"])
    for factory in ("ember.engine.examples.mlp:save_file", "ember.engine.examples.mlp:torch"):
        with pytest.raises(InvalidInput, match="not a callable defined in module"):
            TorchEngine(spec(factory), wide)
    with pytest.raises(InvalidInput, match="keyword argument"):
        TorchEngine(spec("ember.engine.examples.mlp:mlp", kwargs={"a b": 1}), settings)
    # what the registry approved for a trusted tenant, and the allowlist, load
    assert TorchEngine(spec("ember.engine.examples.mlp:SlowMLP", trusted=True), settings).factory
    assert TorchEngine(spec("ember.engine.examples.mlp:SlowMLP"), wide).factory
    assert TorchEngine(spec("ember.engine.examples.mlp:mlp"), settings).factory


def test_a_replica_builds_vllm_argv_from_allowed_flags_only(settings: Settings) -> None:
    from ember.domain.spec import VllmOptions
    from ember.engine.vllm_engine import vllm_argv

    def argv(
        args: dict[str, Any], trusted: bool = False, allowed: tuple[str, ...] = ()
    ) -> list[str]:
        config = {"vllm_args": args}
        llm = VersionSpec(model="llm", version="1", artifact_uri="file:///x", sha256="",
                          engine="vllm", engine_config=config, trusted=trusted)  # fmt: skip
        opts = VllmOptions.model_validate(llm.engine_config)
        return vllm_argv(llm, opts, Path("/cache/llm"), "cpu", "{}", allowed)

    for key in ("trust-remote-code", "load-format", "worker-extension-cls", "model", "tokenizer"):
        with pytest.raises(InvalidInput, match=key):
            argv({key: True})
    built = argv({"max_num_batched_tokens": 2048, "enable-prefix-caching": False, "seed": 3})
    assert built.count("--load-format") == 1 and built[built.index("--load-format") + 1] == "ember"
    assert "--max-num-batched-tokens=2048" in built and "--seed=3" in built
    assert "--no-enable-prefix-caching" in built
    assert "--trust-remote-code" in argv({"trust-remote-code": True}, trusted=True)
    assert "--foo-bar=x" in argv({"foo-bar": "x"}, allowed=("foo-bar",))
    with pytest.raises(InvalidInput, match="load-format"):
        argv({"load-format": "auto"}, trusted=True, allowed=("load-format",))


def test_a_live_replica_refuses_what_only_the_api_allowed_and_loads_a_trusted_tenants(
    data_dir: Path,
) -> None:
    """The API allows every factory of the MLP module; its replicas run with the default
    list (their environment has no EMBER_ENGINE_FACTORIES): an untrusted tenant's version
    naming ``SlowMLP`` (as one registered before the check would) fails to load with the
    reason, a trusted tenant's same version serves."""
    from ember.engine.examples.mlp import INPUT_SCHEMA, build_slow_mlp_artifact
    from tests.gateway.conftest import live_api

    wide = ["ember.engine.examples.mlp:*"]
    with live_api(data_dir, standby_replicas=0, engine_factories=wide,
                  probe_idle_s=0.5, probe_timeout_s=1.0) as live:  # fmt: skip
        admin = live.client
        assert admin.post("/v1/tenants", json={"name": "carol", "trusted": True}).status_code == 201
        clients: dict[str, httpx.Client] = {}
        for tenant in ("carol", "dave"):
            admin.post("/v1/tenants", json={"name": tenant})
            key = admin.post("/v1/keys", json={"name": "k", "tenant": tenant}).json()["key"]
            client = httpx.Client(base_url=live.url, timeout=60,
                                  headers={"Authorization": f"Bearer {key}"})  # fmt: skip
            clients[tenant] = client
            model = f"{tenant}-slow"
            assert client.post("/v1/models", json={"name": model}).status_code == 201
            path = live.store / "artifacts" / tenant / model / "1" / "model.safetensors"
            build_slow_mlp_artifact(path)
            body = {"version": "1", "artifact_uri": path.as_uri(), "engine": "torch",
                    "engine_config": {"factory": "ember.engine.examples.mlp:SlowMLP",
                                      "kwargs": {"delay_s": 0.0}},
                    "input_schema": INPUT_SCHEMA}  # fmt: skip
            created = client.post(f"/v1/models/{model}/versions", json=body)
            assert created.status_code == 201, created.text
            deployed = client.post("/v1/deployments", json={"model": model, "version": "1"})
            assert deployed.status_code == 201, deployed.text
        try:

            def dave_failed() -> bool:
                got = clients["dave"].get("/v1/deployments/dave-slow/replicas").json()
                return any(
                    "ember.engine.examples.mlp:SlowMLP" in (e.get("reason") or "")
                    and "not allowed" in (e.get("reason") or "")
                    for e in got["events"]
                    if e["event"] == "failed"
                )

            def carol_ready() -> bool:
                got = clients["carol"].get("/v1/deployments/carol-slow/replicas").json()
                return any(r["state"] == "ready" for r in got["replicas"])

            live.wait(dave_failed, "dave's replica refusing SlowMLP")
            live.wait(carol_ready, "carol's trusted replica ready")
            answer = clients["carol"].post("/v1/models/carol-slow:predict",
                                           json={"instances": [[0.5] * 256]})  # fmt: skip
            assert answer.status_code == 200, answer.text
            dave = clients["dave"].get("/v1/deployments/dave-slow/replicas").json()
            assert not any(r["state"] == "ready" for r in dave["replicas"])
        finally:
            for client in clients.values():
                client.close()
