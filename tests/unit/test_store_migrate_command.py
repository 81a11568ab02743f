"""``python -m app.store migrate``: the schema brought to the newest version by a step of
its own (the Kubernetes migration Job), in a fresh process as the Job runs it.
Oracle: the database's own alembic_version row against the newest migration file."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from pathlib import Path

from app.store.sql import MIGRATIONS_DIR

REPO = Path(__file__).resolve().parents[2]


def newest_revision() -> str:
    revisions, parents = set(), set()
    for path in (MIGRATIONS_DIR / "versions").glob("*.py"):
        text = path.read_text()
        revisions.add(re.search(r'^revision\s*(?::\s*str\s*)?=\s*"([^"]+)"', text, re.M).group(1))  # type: ignore[union-attr]
        parent = re.search(r'^down_revision[^=]*=\s*"([^"]+)"', text, re.M)
        if parent:
            parents.add(parent.group(1))
    (head,) = revisions - parents
    return head


def test_migrate_brings_a_new_database_to_the_newest_schema(tmp_path: Path) -> None:
    database = tmp_path / "sessions.db"
    done = subprocess.run(
        [sys.executable, "-m", "app.store", "migrate", f"sqlite:///{database}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(database) as connection:
        (version,) = connection.execute("SELECT version_num FROM alembic_version").fetchone()
    assert version == newest_revision()


def test_migrate_without_a_url_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.store", "migrate"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2 and "STREAMSESS_STORE_URL" in done.stderr
