"""The repo's HAProxy configuration, run for real on loopback (tests/harness/haproxy.py),
and the skip where Debian's haproxy is missing."""

from __future__ import annotations

import shutil

import pytest

from tests.harness.haproxy import haproxy as running

needs_haproxy = pytest.mark.skipif(
    shutil.which("haproxy") is None,
    reason="haproxy (Debian package haproxy) is not installed; scripts/test installs it when run as root",
)

__all__ = ["needs_haproxy", "running"]
