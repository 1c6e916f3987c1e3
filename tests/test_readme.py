"""The README stays true: every setting is documented with its default."""

from __future__ import annotations

from pathlib import Path

from ember.config import settings_table

README = Path(__file__).parents[1] / "README.md"


def test_configuration_table_matches_the_code() -> None:
    text = README.read_text()
    assert settings_table() in text, "regenerate the table: python -m ember.config"


def test_the_two_commands_are_on_the_first_screen() -> None:
    first = "\n".join(README.read_text().splitlines()[:30])
    assert "make up" in first and "make test" in first
