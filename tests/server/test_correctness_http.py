"""The correctness harness through the real HTTP server and our client."""

from __future__ import annotations

import pytest

from tests.conftest import API_KEYS
from tests.correctness.harness import HttpBackend, make_workload, run_workload

pytestmark = pytest.mark.server


async def test_harness_over_http(server: str) -> None:
    backend = HttpBackend(server, API_KEYS[1], "embedded-tiny")
    try:
        workload = make_workload(7, 8, block_size=32, blocks_per_chunk=1, max_session_tokens=512)
        report = await run_workload(backend, workload)
    finally:
        await backend.aclose()
    summary = report.summary()
    assert report.sessions == 8 and report.passed, summary
    assert report.device_resets == 1 and report.prefix_requests_with_tier_hits > 0, summary
    assert report.leftover_requests == [], summary
