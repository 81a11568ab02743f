"""A small fake of what the session service uses of vLLM's AsyncLLM, for the fast tier.

It runs streaming-input requests as vLLM does in shape (one request fed chunks by an
async generator, each chunk answered with up to its ``max_tokens`` deltas, the request
ending when the generator does), with deterministic tokens and no model. Tests of
session logic that is not about the engine use it; claims about the engine (KV,
tiers, numerics) keep the real one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

VOCAB = 1000


class FakeTokenizer:
    """One token per byte (ids 1..256), decoded back the same way."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [byte + 1 for byte in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes((i - 1) % 256 for i in ids).decode(errors="replace")


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None


@dataclass
class FakeOutput:
    outputs: list[Completion]
    num_cached_tokens: int = 0
    finished: bool = False


@dataclass
class FakeEngine:
    """Tokens flow freely until a test calls ``hold()``; then each token waits for one
    ``allow()``, so a test can keep a chunk in flight at a token of its choosing."""

    max_num_seqs: int = 8
    num_gpu_blocks: int = 1000
    block_size: int = 32
    max_model_len: int = 4096
    held: bool = False
    _tokens: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(0))
    fail_next: BaseException | None = None
    # How long an aborted request takes to end (vLLM's generate awaits its abort).
    abort_delay_s: float = 0.0
    # Requests the engine ends on its own: once their current chunk is answered, or when
    # their next chunk comes, before answering it.
    end_after_chunk: set[str] = field(default_factory=set)
    end_on_next_chunk: set[str] = field(default_factory=set)
    requests: dict[str, list[int]] = field(default_factory=dict)  # live request id -> context

    def __post_init__(self) -> None:
        self.model_config = SimpleNamespace(get_vocab_size=lambda: VOCAB, max_model_len=self.max_model_len)
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=self.max_num_seqs),
            cache_config=SimpleNamespace(num_gpu_blocks=self.num_gpu_blocks, block_size=self.block_size),
        )
        self.output_processor = SimpleNamespace(request_states={})
        self.tokenizer = FakeTokenizer()

    def hold(self) -> None:
        self.held = True

    def allow(self, tokens: int = 1) -> None:
        for _ in range(tokens):
            self._tokens.release()

    def flow(self) -> None:
        self.held = False
        self.allow(10_000)  # wakes every token that waits

    def get_tokenizer(self) -> FakeTokenizer:
        return self.tokenizer

    @staticmethod
    def next_token(context: list[int]) -> int:
        return (sum(context) * 31 + len(context)) % (VOCAB - 1) + 1

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, trace_headers: Any = None) -> Any:
        if isinstance(prompt, dict):  # one plain request (the tier barrier)
            yield FakeOutput([Completion([1], "", "length")], finished=True)
            return
        context = self.requests[request_id] = []
        try:
            async for chunk in prompt:
                if request_id in self.end_on_next_chunk:
                    self.end_on_next_chunk.discard(request_id)
                    return
                if self.fail_next is not None:
                    error, self.fail_next = self.fail_next, None
                    raise error
                context.extend(chunk.prompt["prompt_token_ids"])
                wanted = chunk.sampling_params.max_tokens
                for produced in range(1, wanted + 1):
                    if self.held:
                        await self._tokens.acquire()
                    token = self.next_token(context)
                    context.append(token)
                    yield FakeOutput(
                        [Completion([token], self.tokenizer.decode([token]), "length" if produced == wanted else None)]
                    )
                context.pop()  # vLLM drops each chunk's last sampled token on resume
                if request_id in self.end_after_chunk:
                    self.end_after_chunk.discard(request_id)
                    return
        except asyncio.CancelledError:
            if self.abort_delay_s:
                await asyncio.sleep(self.abort_delay_s)
            raise
        finally:
            del self.requests[request_id]
