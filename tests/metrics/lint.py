"""Prometheus naming rules as code (what ``promtool check metrics`` and the Prometheus
naming guide say, no lint library for them being on PyPI), plus Ember's own: the
``ember_`` prefix and the tenant / deployment / model / version labels.

``lint(text)`` parses an exposition with ``prometheus_client``'s parser and returns one
line per problem (empty: clean)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

NAME = re.compile(r"^ember_[a-z][a-z0-9]*(_[a-z0-9]+)*$")
LABEL = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
NON_BASE_UNITS = re.compile(
    r"_(milliseconds|microseconds|nanoseconds|ms|us|ns|minutes|hours|days|"
    r"kilobytes|megabytes|gigabytes|kb|mb|gb|kib|mib|gib|bits|percent)(_|$)"
)
"""Units Prometheus wants in their base unit (seconds, bytes, ratios)."""
TIME_WORDS = re.compile(r"(latency|duration|delay|elapsed|wait|uptime|_(time|age)(_|$))")
"""A series named for time must say its unit: ``_seconds``."""
RESERVED_SUFFIXES = ("_count", "_sum", "_bucket", "_info")
TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)$", re.MULTILINE)
SCOPE = {"deployment": ("tenant", "model"), "version": ("model",)}
"""A series labelled with the key also carries these labels."""


def _base(name: str) -> str:
    for suffix in ("_total", "_created", "_count", "_sum", "_bucket"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def lint(text: str) -> list[str]:
    problems: list[str] = []
    types = dict(TYPE_LINE.findall(text))
    """The names as written in the ``# TYPE`` lines (the parser strips a counter's
    ``_total`` and adds it to samples that lack it)."""
    families = list(text_string_to_metric_families(text))
    by_name = {f.name: f for f in families}
    for family in families:
        name, kind = family.name, family.type
        where = f"{name} ({kind})"
        if not NAME.match(name):
            problems.append(f"{where}: not snake_case with the ember_ prefix")
        if not family.documentation:
            problems.append(f"{where}: no HELP")
        if NON_BASE_UNITS.search(name):
            problems.append(f"{where}: a unit other than the base unit")
        if TIME_WORDS.search(name) and "_seconds" not in name:
            problems.append(f"{where}: a duration without _seconds")
        if kind == "counter":
            declared = types.get(f"{name}_total") == "counter" or types.get(name) == "counter"
            if types.get(name) == "counter" and not name.endswith("_total"):
                # the parser adds _total to counter samples itself: the text must have it
                problems.append(f"{where}: counter sample {name} without _total")
            elif not declared:
                problems.append(f"{where}: no TYPE line")
        elif kind in ("gauge", "untyped", "unknown"):
            created_of = name.endswith("_created") and _base(name) in by_name
            if created_of:
                continue  # a counter's or histogram's creation time (prometheus_client)
            if name.endswith("_total"):
                problems.append(f"{where}: a running total that is not a counter")
            if name.endswith(RESERVED_SUFFIXES):
                problems.append(f"{where}: a reserved suffix on a gauge")
            if kind != "gauge":
                problems.append(f"{where}: untyped")
        elif kind == "histogram":
            names = {s.name for s in family.samples}
            if family.samples and not {f"{name}_bucket", f"{name}_count", f"{name}_sum"} <= names:
                problems.append(f"{where}: not a whole histogram ({sorted(names)})")
        for sample in family.samples:
            labels = set(sample.labels) - {"le", "quantile"}
            for label in labels:
                if not LABEL.match(label) or label.startswith("__"):
                    problems.append(f"{where}: label {label!r} is not snake_case")
            for key, needs in SCOPE.items():
                if key in labels and not set(needs) <= labels:
                    problems.append(f"{where}: has {key} but not {needs}: {sample.labels}")
    return sorted(set(problems))


REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md"
_ROW = re.compile(r"^\| `(ember_[a-z0-9_]+)` \| (counter|gauge|histogram) \|", re.MULTILINE)


def documented() -> dict[str, str]:
    """The series docs/reference/metrics.md describes: exposition name -> type (a
    counter's name with its ``_total``)."""
    return dict(_ROW.findall(REFERENCE.read_text()))


def undocumented(text: str) -> list[str]:
    """The families of an exposition the reference does not describe (or as another type);
    the ``_created`` series prometheus_client adds are described once, in the preamble."""
    types = dict(TYPE_LINE.findall(text))
    known = documented()
    out = []
    for name, kind in types.items():
        if (
            kind == "gauge"
            and name.endswith("_created")
            and _base(name) in {_base(n) for n, k in types.items() if k in ("counter", "histogram")}
        ):
            continue
        if known.get(name) != kind:
            out.append(f"{name} ({kind})")
    return sorted(out)
