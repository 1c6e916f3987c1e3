"""The API process: ``ember serve`` freezes its start-up objects out of the cyclic GC."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.api.app import create_app
from ember.cli import server as cli
from ember.config import SWITCH_INTERVAL_S, Settings
from tests import services
from tests.api.conftest import ADMIN_KEY


@pytest.mark.parametrize("freeze", [True, False])
def test_a_served_api_freezes_its_start_up_objects(data_dir: Path, freeze: bool) -> None:
    # A full collection walked ~140k start-up objects: 50-190 ms with the event loop stopped.
    settings = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, pools_enabled=False)  # type: ignore[arg-type]
    gc.unfreeze()
    try:
        with services.serve_app(create_app(settings, freeze_gc=freeze)) as url:
            assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
            assert (gc.get_freeze_count() > 0) is freeze
    finally:
        gc.unfreeze()


def test_ember_serve_asks_for_the_freeze_and_a_short_switch_interval(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    import ember.api.app

    made: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        made.append(kwargs)
        return create_app(*args, **kwargs)

    serving_with: list[float] = []
    monkeypatch.setattr(ember.api.app, "create_app", recording)
    monkeypatch.setattr(
        uvicorn, "run", lambda *a, **k: serving_with.append(sys.getswitchinterval())
    )
    default = sys.getswitchinterval()
    try:
        cli._run_api(Settings(data_dir=data_dir, admin_key=ADMIN_KEY), reload=False)  # type: ignore[arg-type]
    finally:
        sys.setswitchinterval(default)
    assert made == [{"freeze_gc": True}]
    # the event loop waits at most 1 ms for the GIL behind the API's threads, not 5
    assert serving_with == [pytest.approx(SWITCH_INTERVAL_S)]
    assert default > SWITCH_INTERVAL_S
