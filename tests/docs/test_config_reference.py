"""docs/configuration.md is the settings as the code has them (tests/docs/config_reference.py
makes it): a setting added, removed, renamed or redescribed without the page fails here,
with the command that brings the page up to date. Every setting has a description, which
the page shows. Oracle: the page rendered from ``Settings`` now, against the file."""

from __future__ import annotations

from app.settings import Settings
from tests.docs.config_reference import PAGE, render


def test_the_page_is_the_settings() -> None:
    assert PAGE.read_text() == render(), "docs/configuration.md is stale: run python -m tests.docs.config_reference"


def test_every_setting_is_described_on_the_page() -> None:
    page = PAGE.read_text()
    for name, field in Settings.model_fields.items():
        assert field.description, f"setting {name} has no description"
        assert f"| `{name}` | `STREAMSESS_{name.upper()}`" in page, name
