"""PostgreSQL for the tests: the server helper, and the skip where it is missing."""

import pytest

from tests.harness.postgres import PostgresServer, postgres_bin_dir, postgres_server

needs_postgres = pytest.mark.skipif(
    postgres_bin_dir() is None,
    reason="PostgreSQL's server binaries (Debian package postgresql) are not installed; "
    "scripts/test installs them when run as root",
)

__all__ = ["PostgresServer", "needs_postgres", "postgres_server"]
