"""Every error code the server's own code answers is in the session API's table of codes
(docs/sessions.md, "Every error code"): a code added without its row fails here."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "sessions.md"


def codes_in_the_code() -> set[str]:
    return {
        code for path in (REPO / "app").rglob("*.py") for code in re.findall(r'\bcode="([a-z_]+)"', path.read_text())
    }


def codes_in_the_table(page: str) -> set[str]:
    table = page.split("### Every error code", 1)[1].split("\n## ", 1)[0]
    return {
        code
        for row in table.splitlines()
        if row.startswith("| `")
        for code in re.findall(r"`([a-z_]+)`", row.split("|")[1])
    }


def test_every_error_code_has_its_row() -> None:
    missing = codes_in_the_code() - codes_in_the_table(PAGE.read_text())
    assert not missing, f"error codes without a row in docs/sessions.md: {sorted(missing)}"


def test_a_code_without_its_row_is_found() -> None:
    """The negative control: the table read without one row misses that code."""
    page = PAGE.read_text()
    trimmed = "\n".join(line for line in page.splitlines() if not line.startswith("| `engine_dead`"))
    assert "engine_dead" in codes_in_the_code() - codes_in_the_table(trimmed)
