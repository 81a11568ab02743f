"""Where each request's prompt tokens came from: device prefix cache, CPU tier or compute.

vLLM's scheduler measures this per request (``PrefillStats``: local and external
cached tokens) but ``RequestOutput`` carries only the sum. The recorder taps the
engine's output processor, which sees every ``EngineCoreOutput``, and keeps the
split by request id until the serving code claims it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from app.protocol import ChunkUsage, PromptTokensDetails
from connectors import DISK_TIER_TOKENS_UTILITY


@dataclass(frozen=True)
class PrefillSources:
    """Prompt tokens of one request's first prefill, by where their KV came from."""

    device_tokens: int
    cpu_tier_tokens: int
    disk_tier_tokens: int = 0
    # vLLM's own id of the request, to ask the engine core for its disk-tier share.
    engine_request_id: str | None = None


def resume_source(sources: PrefillSources) -> str:
    """Where most of a resumed request's prefix came from: disk_tier, cpu_tier, device or
    recompute."""
    tiers = {
        "device": sources.device_tokens,
        "cpu_tier": sources.cpu_tier_tokens,
        "disk_tier": sources.disk_tier_tokens,
    }
    source = max(reversed(tiers), key=tiers.__getitem__)  # a tie goes to the farther tier
    return source if tiers[source] else "recompute"


class ProvenanceRecorder:
    """Bounded map from external request id to its prefill sources."""

    def __init__(self, capacity: int = 4096, disk_tier: bool = False):
        self._capacity = capacity
        # With a disk tier, the scheduler's external hits are CPU tier and disk tier
        # together; the engine core tells each request's disk share on request.
        self._disk_tier = disk_tier
        self._engine: Any = None
        self._records: OrderedDict[str, PrefillSources] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, request_id: str, sources: PrefillSources) -> None:
        with self._lock:
            self._records[request_id] = sources
            self._records.move_to_end(request_id)
            while len(self._records) > self._capacity:
                # Unclaimed records (a client that never read usage) age out.
                self._records.popitem(last=False)

    def pop(self, request_id: str) -> PrefillSources | None:
        with self._lock:
            return self._records.pop(request_id, None)

    async def pop_prefix(self, prefix: str) -> PrefillSources | None:
        """Sum and remove every record whose id starts with ``prefix`` (vLLM
        suffixes one id per prompt of a batched completion), each split by tier."""
        with self._lock:
            keys = [key for key in self._records if key.startswith(prefix)]
            if not keys:
                return None
            found = [self._records.pop(key) for key in keys]
        found = [await self.split_disk_tier(sources) for sources in found]
        return PrefillSources(
            device_tokens=sum(s.device_tokens for s in found),
            cpu_tier_tokens=sum(s.cpu_tier_tokens for s in found),
            disk_tier_tokens=sum(s.disk_tier_tokens for s in found),
        )

    async def split_disk_tier(self, sources: PrefillSources) -> PrefillSources:
        """``sources`` with their external hits split into CPU tier and disk tier (an
        engine-core round trip, only for a request with external hits on a server with
        a disk tier)."""
        if not (self._disk_tier and sources.cpu_tier_tokens and sources.engine_request_id and self._engine):
            return sources
        shares = await self._engine.engine_core.call_utility_async(
            DISK_TIER_TOKENS_UTILITY, [sources.engine_request_id]
        )
        disk = min(int(shares.get(sources.engine_request_id, 0)), sources.cpu_tier_tokens)
        return replace(sources, cpu_tier_tokens=sources.cpu_tier_tokens - disk, disk_tier_tokens=disk)

    def attach(self, engine: Any) -> None:
        """Wrap the engine's ``output_processor.process_outputs`` to record sources."""
        self._engine = engine
        processor = engine.output_processor
        original = processor.process_outputs
        if getattr(original, "_provenance_recorder", None) is self:
            return

        def process_outputs(engine_core_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
            for output in engine_core_outputs:
                stats = getattr(output, "prefill_stats", None)
                if stats is None:
                    continue
                state = processor.request_states.get(output.request_id)
                request_id = getattr(state, "external_req_id", None) or output.request_id
                self.record(
                    request_id,
                    PrefillSources(
                        device_tokens=int(stats.num_local_cached_tokens),
                        cpu_tier_tokens=int(stats.num_external_cached_tokens),
                        engine_request_id=output.request_id,
                    ),
                )
            return original(engine_core_outputs, *args, **kwargs)

        process_outputs._provenance_recorder = self  # type: ignore[attr-defined]
        processor.process_outputs = process_outputs


def chunk_usage(prompt_tokens: int, completion_tokens: int, sources: PrefillSources) -> ChunkUsage:
    """A chunk's usage: its prompt is the whole context it attends over."""
    cached = sources.device_tokens + sources.cpu_tier_tokens + sources.disk_tier_tokens
    return ChunkUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=cached,
            device_tokens=sources.device_tokens,
            cpu_tier_tokens=sources.cpu_tier_tokens,
            disk_tier_tokens=sources.disk_tier_tokens,
            computed_tokens=max(prompt_tokens - cached, 0),
        ),
    )
