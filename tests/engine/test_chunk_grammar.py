"""A grammar set for one chunk of a session applies to that chunk's answer and to no
other (connectors/streaming_grammar.py, the vLLM general plugin this project installs).

Oracle: a ``choice`` grammar admits exactly one text, which the random-weight model
would never write unconstrained; so the constrained chunk's answer is that text, and
the free chunks around it are not. Negative control (run when written, with the plugin
left out by ``VLLM_PLUGINS=streamsess_cpu_platform``): vLLM 0.32 drops a later chunk's
grammar, so the first session's middle chunk answered free text to its token limit and
this test failed.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.sampling_params import StructuredOutputsParams

from app.protocol import SamplingOptions, SessionCreateRequest
from app.sessions.chat import ChatState
from app.sessions.inputs import Turn
from app.sessions.service import SessionService
from app.wiring import session_service
from tests.conftest import make_settings

pytestmark = pytest.mark.engine

FORCED = "zebra crossing"


def constrained(text: str) -> Any:
    def plan(context_ids: list[int], conversation: ChatState | None) -> Turn:
        ids = list(range(40, 40 + len(text)))  # any ids: the grammar decides the answer
        return Turn(ids, structured_outputs=StructuredOutputsParams(choice=[FORCED]))

    return plan


async def answer(service: SessionService, session_id: str, chunk: Any) -> str:
    run = await service.start_chunk(
        "owner", session_id, chunk, SamplingOptions(max_tokens=32, temperature=0), transport="test", wait=False
    )
    result = await run.result()
    # The forced text ends the answer (the grammar then admits only end-of-sequence).
    return result.text if result.finish_reason == "stop" else f"{result.text}[{result.finish_reason}]"


async def test_a_chunks_grammar_applies_to_that_chunk_alone(engine: Any) -> None:
    service = session_service(engine, make_settings())
    await service.start()
    try:
        later = await service.create("owner", SessionCreateRequest())
        answers = [await answer(service, later.id, chunk) for chunk in ("hello there", constrained("a"), "and then")]
        assert answers[1] == FORCED, answers  # a later chunk's grammar applies
        assert FORCED not in (answers[0], answers[2]), answers  # and only there

        first = await service.create("owner", SessionCreateRequest())
        answers = [await answer(service, first.id, chunk) for chunk in (constrained("b"), "free again", "and on")]
        assert answers[0] == FORCED, answers
        # The first chunk's grammar ends with it: the next answers are the model's own
        # (with it kept, a finished grammar admits only end-of-sequence: empty answers).
        assert all(text not in ("", FORCED) for text in answers[1:]), answers
    finally:
        await service.stop()
