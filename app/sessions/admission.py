"""How much of the engine's device the server's requests hold, estimated in the API process.

vLLM does not preempt a streaming session that waits for its next chunk: it keeps
its KV blocks and its slot of ``max_num_seqs``. Idle sessions alone can so fill
the device, and a new request then waits with no answer and no error. The service
parks idle sessions before that happens, and this module tells it when: it adds
up what every live request holds or will hold, from state the API process has
(our sessions' reservations, vLLM's own request states for everything else), and
compares it with the engine's slots and KV blocks.

The estimate is conservative: sessions that share a prefix share blocks on the
device, and a request rarely reaches its ``max_tokens``; both are counted in full.
So the service may park a session earlier than needed (its resume is then a CPU
tier hit), never later.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any, Protocol


class HoldsDevice(Protocol):
    """What the estimate needs of a session."""

    device_tokens: int


class DeviceTokens:
    """A session's ``device_tokens``: what its engine request holds on the device, or will
    once the chunk being admitted runs (0 without a request). Setting it keeps the session
    in its ``device_holders`` set while it is not 0, so that the estimate walks the few
    sessions on the device, not every open session (thousands may be parked)."""

    def __get__(self, session: Any, owner: type | None = None) -> Any:
        if session is None:
            return self  # read on the class
        return session.__dict__.get("_device_tokens", 0)

    def __set__(self, session: Any, tokens: int) -> None:
        session.__dict__["_device_tokens"] = tokens
        if tokens:
            session.device_holders.add(session)
        else:
            session.device_holders.discard(session)


@dataclass(frozen=True)
class DeviceLoad:
    slots: int
    blocks: int


@dataclass(frozen=True)
class DeviceCapacity:
    slots: int
    blocks: int
    block_size: int

    @classmethod
    def of(cls, engine: Any) -> DeviceCapacity:
        config = engine.vllm_config
        return cls(
            slots=int(config.scheduler_config.max_num_seqs),
            # vLLM's block pool keeps one block aside (its null block).
            blocks=max(int(config.cache_config.num_gpu_blocks or 0) - 1, 0),
            block_size=int(config.cache_config.block_size),
        )

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def load(
        self,
        engine: Any,
        holders: Iterable[HoldsDevice],
        session_request_ids: Container[str],
        exclude: HoldsDevice | None = None,
    ) -> DeviceLoad:
        """Slots and blocks held by every live request but ``exclude``'s: our sessions'
        reservations (``holders``: the sessions whose device_tokens are not 0, so the
        walk is bounded by the device, not by how many sessions are open), and vLLM's
        own request states for every request that is not a session's (any request id
        in ``session_request_ids``)."""
        slots = blocks = 0
        for session in holders:
            if session is not exclude:
                slots += 1
                blocks += self.blocks_for(session.device_tokens)
        for state in list(engine.output_processor.request_states.values()):
            if (state.external_req_id or state.request_id) in session_request_ids:
                continue  # counted above, from the session's own reservation
            slots += 1
            blocks += self.blocks_for(int(state.prompt_len or 0) + int(state.max_tokens_param or 0))
        return DeviceLoad(slots, blocks)

    def fits(self, load: DeviceLoad, tokens: int) -> bool:
        """Whether one more request of ``tokens`` fits beside ``load``."""
        return load.slots + 1 <= self.slots and load.blocks + self.blocks_for(tokens) <= self.blocks

    def over(self, load: DeviceLoad) -> bool:
        return load.slots > self.slots or load.blocks > self.blocks
