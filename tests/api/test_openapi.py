"""Property-based run of the OpenAPI document against the live API (schemathesis CLI):
no 5xx and no response that violates the documented schema, whatever the input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ember.api.app import create_app
from ember.config import Settings
from tests import services
from tests.api.conftest import ADMIN_KEY
from tests.artifacts import write_valid

CONFIG = Path(__file__).with_name("schemathesis.toml")
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "response_headers_conformance",
    ]
)


def test_schemathesis_finds_no_server_errors_or_schema_violations(tmp_path: Path) -> None:
    # The pools controller runs (no standby process): predict is exercised too.
    settings = Settings(data_dir=tmp_path, admin_key=ADMIN_KEY, standby_replicas=0)  # type: ignore[arg-type]
    write_valid(tmp_path / "objects" / "w.safetensors")
    exe = Path(sys.executable).with_name("schemathesis")
    with services.serve_app(create_app(settings)) as url:
        result = subprocess.run(
            [str(exe), "--config-file", str(CONFIG), "run", f"{url}/openapi.json",
             "--checks", CHECKS, "--generation-with-security-parameters", "false",
             "-H", f"Authorization: Bearer {ADMIN_KEY}", "--max-examples", "30",
             "--seed", "1", "--generation-database", "none", "--no-color"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    assert result.returncode == 0, result.stdout[-12000:] + result.stderr[-3000:]
    print(result.stdout[-3000:])


def test_openapi_document_is_served(tmp_path: Path) -> None:
    doc = create_app(Settings(data_dir=tmp_path)).openapi()
    assert doc["info"]["title"] == "Ember"
    assert "/v1/deployments/{name}:promote" in doc["paths"]
