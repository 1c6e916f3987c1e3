"""The README is what a first visit needs: what Ember is, the two commands, a first
request, and links into the manual. What it used to hold lives in docs/ now, where
tests/docs/test_docs.py checks it (the settings reference is generated from
``Settings`` and checked against it there)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs.test_docs import nav_pages

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"


def test_the_two_commands_are_on_the_first_screen() -> None:
    first = "\n".join(README.read_text().splitlines()[:30])
    assert "make up" in first and "make test" in first


def test_it_stays_a_first_visit() -> None:
    assert len(README.read_text().splitlines()) <= 150


def test_every_link_into_the_manual_is_a_page_of_the_site() -> None:
    links = re.findall(r"\]\((docs/[^)#\s]+)", README.read_text())
    pages = set(nav_pages())
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).is_file(), link
        assert link.removeprefix("docs/") in pages, link
    assert {"quickstart.md", "reference/settings.md", "security.md"} <= {
        link.removeprefix("docs/") for link in links
    }
