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
    # After the device reset, the prefix requests of sessions whose blocks reached the tier
    # must be served from it: 10 of 31 on seed 7 (one hit would show little).
    assert report.device_resets == 1, summary
    assert report.prefix_requests_with_tier_hits >= report.prefix_requests // 5, summary
    assert report.leftover_requests == [], summary
