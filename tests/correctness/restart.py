"""The harness's restart configuration: sessions resumed from the disk tier after a restart.

Phase 1, on one engine (a SQLite store, a disk tier and the cache-salt secret all in
one state directory, per-key salts on): each session runs every chunk but its last,
each answer checked against a salted recompute, and is then parked, so the CPU tier
stores its whole context and the disk tier writes it through. The service stops and
the disk tier is flushed, as a graceful stop does.

Phase 2, on a new engine over the same directory: each session's last chunk is sent
by its id. The session comes back from the store, parked, and resumes from its
transcript; the device cache and the CPU tier of a new engine are empty (and the CPU
tier is too small to have kept phase 1's sessions anyway), so whatever KV the prompt
did not compute came from the disk tier.

Oracle: float32, the resumed chunk's answer token for token against a recompute on
the new engine, salted and with prefix-cache reads off, so it can read none of the
files under test; a mismatch is measured for its top-2 margin as in ``run_workload``.
A run passes with no such mismatch and with most of the resumable tokens (whole
blocks of each transcript's computed KV) read from disk: a run that recomputed
everything would match its oracle trivially. The negative control for the files
themselves (another session's file served in place of one's own) is
tests/engine/test_disk_tier.py.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tests.correctness.harness import (
    SESSION_TOKENS,
    InProcessBackend,
    InProcessHarness,
    Mismatch,
    Mismatches,
    SessionPlan,
    harness_settings,
    make_workload,
    measure_margin,
)

CONFIG = "bpc1"
DISK_TIER_GIB = 1.0  # more than 200 sessions write (at most 512 tokens of 4 KiB each): nothing evicted
API_KEY = "harness-restart-key"  # turns per-key cache salts on: they must survive the restart too
# The share of resumable tokens a run must read from disk. Below 1: a chunk the
# writer's bounded backlog dropped is a miss, by design, not a wrong answer.
MIN_DISK_SHARE = 0.95


@dataclass
class RestartReport(Mismatches):
    seed: int
    sessions: int = 0
    chunks_checked: int = 0  # phase 1's chunks and the resumed ones, each against a recompute
    resumed: int = 0
    resumable: int = 0  # resumed sessions with a whole block of computed KV (shorter ones have nothing to read)
    resumed_from_disk: int = 0  # resumed chunks with any disk-tier tokens
    resumable_tokens: int = 0  # whole blocks of each transcript's computed KV
    disk_tier_tokens: int = 0
    cpu_tier_tokens: int = 0
    device_tokens: int = 0
    computed_tokens: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def disk_share(self) -> float:
        return self.disk_tier_tokens / self.resumable_tokens if self.resumable_tokens else 0.0

    @property
    def passed(self) -> bool:
        return not self.failures and self.disk_share >= MIN_DISK_SHARE

    def summary(self) -> dict[str, Any]:
        data = asdict(self)
        data["mismatches"] = len(self.mismatches)
        data["near_ties"] = [asdict(m) for m in self.near_ties]
        data["first_mismatches"] = [asdict(m) for m in self.failures[:3]]
        data["disk_share"] = round(self.disk_share, 4)
        data["passed"] = self.passed
        return data


def restart_settings(state_dir: str) -> Any:
    return harness_settings(
        CONFIG,
        state_dir=state_dir,
        disk_tier_gib=DISK_TIER_GIB,
        api_keys=[API_KEY],
        max_sessions=1024,
        served_model_name="harness-restart",
    )


def restart_sessions(seed: int, num_sessions: int, block_size: int, blocks_per_chunk: int) -> list[SessionPlan]:
    """Sessions of two chunks or more (one to resume with after the restart)."""
    plans: list[SessionPlan] = []
    round_seed = seed
    while len(plans) < num_sessions:
        workload = make_workload(
            round_seed,
            num_sessions,
            block_size=block_size,
            blocks_per_chunk=blocks_per_chunk,
            max_session_tokens=SESSION_TOKENS,
        )
        plans += [plan for plan in workload.sessions if len(plan.chunks) >= 2]
        round_seed += 1_000_003
    return plans[:num_sessions]


async def checked_chunk(
    backend: InProcessBackend,
    report: RestartReport,
    index: int,
    chunk_index: int,
    session_id: str,
    context: list[int],
    token_ids: list[int],
    max_tokens: int,
) -> Any:
    """A session's chunk, its answer compared with a salted recompute."""
    result = await backend.session_chunk_result(session_id, token_ids, max_tokens)
    got = list(result.token_ids)
    expected = (await backend.generate(context + token_ids, max_tokens, recompute=True)).token_ids
    report.chunks_checked += 1
    if got != expected:
        mismatch = Mismatch("chunk", index, chunk_index, len(context) + len(token_ids), expected, got)
        report.mismatches.append(await measure_margin(backend, mismatch, context + token_ids))
    return result


async def run_restart(
    seed: int, num_sessions: int, state_dir: str | None = None, concurrency: int = 4
) -> RestartReport:
    with tempfile.TemporaryDirectory(prefix="harness-restart-") as scratch:
        settings = restart_settings(state_dir or scratch)
        plans = restart_sessions(seed, num_sessions, settings.block_size, settings.blocks_per_chunk)
        report = RestartReport(seed=seed, sessions=len(plans))
        limit = asyncio.Semaphore(concurrency)
        started = time.monotonic()
        ids: dict[int, str] = {}
        contexts: dict[int, list[int]] = {}

        async def before_restart(backend: InProcessBackend, index: int, plan: SessionPlan) -> None:
            async with limit:
                session_id = await backend.open_session()
                context: list[int] = []
                for chunk_index, chunk in enumerate(plan.chunks[:-1]):
                    result = await checked_chunk(
                        backend, report, index, chunk_index, session_id, context, chunk.token_ids, chunk.max_tokens
                    )
                    context += chunk.token_ids + list(result.token_ids)
                await backend.park_session(session_id)
                ids[index], contexts[index] = session_id, context

        async def after_restart(backend: InProcessBackend, index: int, plan: SessionPlan) -> None:
            async with limit:
                chunk, context = plan.chunks[-1], contexts[index]
                result = await checked_chunk(
                    backend, report, index, len(plan.chunks) - 1, ids[index], context, chunk.token_ids, chunk.max_tokens
                )
                await backend.close_session(ids[index])
                details = result.usage.prompt_tokens_details
                # The last output token was sampled, never computed: its KV is not in the transcript's.
                resumable = (len(context) - 1) // settings.block_size * settings.block_size
                report.resumed += 1
                report.resumable += resumable > 0
                report.resumed_from_disk += details.disk_tier_tokens > 0
                report.resumable_tokens += resumable
                report.disk_tier_tokens += details.disk_tier_tokens
                report.cpu_tier_tokens += details.cpu_tier_tokens
                report.device_tokens += details.device_tokens
                report.computed_tokens += details.computed_tokens

        async with InProcessHarness(settings) as backend:
            await asyncio.gather(*(before_restart(backend, i, plan) for i, plan in enumerate(plans)))
        async with InProcessHarness(settings) as backend:
            await asyncio.gather(*(after_restart(backend, i, plan) for i, plan in enumerate(plans)))
        report.seconds = round(time.monotonic() - started, 2)
        return report
