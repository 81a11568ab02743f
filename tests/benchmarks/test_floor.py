"""The transport benchmarks' floor (benchmarks/floor.py) feeds the engine what a session
feeds it: every chunk after the first starts with the token the previous chunk sampled,
which vLLM's streaming input drops (no KV yet) and our session sends again. A floor that
left it out ran one token less of prefill per chunk than a session, and on the EPYC its
engine step was 0.35 to 0.48 ms shorter (benchmarks.chunk_timeline): counted as the
transports' cost. Oracle: the fake engine's context for the floor's request against the
session's transcript for the same chunks, every input and every answer (tests/fake_engine.py
keeps vLLM's rule: a chunk's last sampled token is dropped when the next chunk comes, so a
floor that does not send it again holds a shorter context and samples other tokens). The
engine's numerics are not the claim: fake engine.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.floor import EngineSession
from tests.fast.test_service import GREEDY, OWNER, chunk, running_service

CHUNKS = [[5], [17], [300], [42], [7]]


async def test_the_floor_feeds_the_engine_what_a_session_feeds_it(tmp_path: Path) -> None:
    async with running_service(tmp_path) as (service, engine):
        session = await service.create(OWNER, GREEDY)
        for ids in CHUNKS:
            await chunk(service, session.id, ids, max_tokens=1)
        floor = EngineSession(engine, request_id="floor")
        await floor.run(CHUNKS)
        # The floor's last answer is still in its context (dropped when a next chunk comes).
        assert engine.requests["floor"] == session.token_ids
        assert len(session.token_ids) == 2 * len(CHUNKS)
        await floor.close()
