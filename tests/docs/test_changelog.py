"""The version in pyproject.toml is the changelog's latest release (Keep a Changelog)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def latest_release(changelog: str) -> str:
    """The first ``## [X.Y.Z] - date`` heading: the one below ``[Unreleased]``."""
    match = re.search(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, flags=re.MULTILINE)
    assert match, "CHANGELOG.md has no release heading"
    return match[1]


def test_the_package_version_is_the_changelogs_latest_release() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert version == latest_release((REPO / "CHANGELOG.md").read_text())


def test_a_release_heading_is_found_below_unreleased() -> None:
    assert latest_release("## [Unreleased]\n\n## [1.2.3] - 2026-01-02\n\n## [1.2.2] - 2026-01-01\n") == "1.2.3"
