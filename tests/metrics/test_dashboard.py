"""deploy/grafana/ember.json is built from the series Ember serves: every name its queries
use is one docs/reference/metrics.md describes (and the live tests check the reference
against every ``/metrics``), as the type it is used as; the queries are well-formed and
name the dashboard's data source variable, not a data source of one installation."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.metrics.lint import documented

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ember.json"
SERIES = re.compile(r"\b(ember_[a-z0-9_]+)")
PAIRS = {"(": ")", "{": "}", "[": "]"}


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _balanced(expr: str) -> bool:
    stack: list[str] = []
    quoted = False
    for ch in expr:
        if ch == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif ch in PAIRS:
            stack.append(PAIRS[ch])
        elif ch in PAIRS.values() and (not stack or stack.pop() != ch):
            return False
    return not stack and not quoted


def _used_as(name: str, known: dict[str, str]) -> str | None:
    """The documented type of the series a query names (``_bucket`` of a histogram)."""
    if name in known:
        return known[name]
    if name.endswith("_bucket") and known.get(name[: -len("_bucket")]) == "histogram":
        return "histogram"
    return None


def test_every_query_names_documented_series_the_way_they_are_typed() -> None:
    known = documented()
    board = _dashboard()
    assert board["uid"] and board["panels"]
    used: set[str] = set()
    for panel in board["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert _balanced(expr), expr
            for name in SERIES.findall(expr):
                kind = _used_as(name, known)
                assert kind is not None, f"{panel['title']}: {name} is no documented series"
                if "rate(" in expr and name in known:  # rate/increase of counters only
                    assert kind == "counter" or f"{name}_bucket" in expr, (name, expr)
                if name.endswith("_bucket"):
                    assert "histogram_quantile(" in expr
                used.add(name)
    # the dashboard shows what issue 23 asks for: tiers, latency, errors, cost per version
    for needed in ("ember_replicas", "ember_gateway_latency_seconds_bucket",
                   "ember_gateway_requests_total", "ember_cost_per_success_replica_seconds",
                   "ember_queue_depth"):  # fmt: skip
        assert needed in used, needed


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = _dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        mine = {(x, y) for x in xs for y in ys}
        assert not cells & mine, p["title"]
        cells |= mine
    names = {v["name"] for v in _dashboard()["templating"]["list"]}
    assert {"datasource", "tenant", "deployment"} <= names


def test_the_lint_of_queries_catches_a_typo() -> None:
    known = documented()
    assert _used_as("ember_gateway_requets_total", known) is None
    assert not _balanced('sum(rate(ember_replicas{tenant="a"}[5m])')
