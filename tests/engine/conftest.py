"""Engines that more than one module of this tier needs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio

from tests.conftest import make_settings
from tests.helpers import started_engine


@pytest_asyncio.fixture(scope="package")
async def unfixed_engine() -> AsyncIterator[Any]:
    """An engine running vLLM's unfixed connector code (otherwise the shared engine's
    settings: float32), for the negative controls of test_parking and test_seed_e2e:
    one engine for both, shut down when this tier ends."""
    async with started_engine(make_settings(disable_streaming_session_fix=True)) as engine:
        yield engine
