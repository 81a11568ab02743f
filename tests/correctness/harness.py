"""Randomized correctness harness: streaming sessions and prefix reuse, token-exact
against a full recompute.

The seed bug corrupted the CPU tier silently: sessions' own answers stayed right and
only later cache hits went wrong. So the harness checks both:

- every session chunk's answer equals the equivalent one-shot request (the whole
  context so far plus the chunk, computed from scratch);
- every prefix-reuse request (random prefix of a session's context, during the
  sessions and after they closed and the device cache was reset) equals a recompute,
  and counts the tokens it got from the CPU tier, so that a run without tier hits
  cannot pass for a success.

All decoding is greedy. A recompute is a request that can hit no cache and leaves
nothing under the session's block hashes: a fresh ``cache_salt`` (in process with
``skip_reading_prefix_cache`` too). vLLM 0.32 stores a request's blocks even when it
reads none, so an unsalted recompute could put its own KV in the tier under the
session's hashes before the session's outputs got there, and a later probe would
compare the recompute with itself.
At a mismatch against a recompute, the harness measures the recompute's top-2 logit
margin where the outputs part (``NEAR_TIE_MARGIN``, ``Report.passed``).
Comparisons with a recompute are sound only in float32: in bf16 a session's KV,
computed chunk by chunk, differs in its low bits from a one-pass prefill, and
greedy decoding on random weights turns that into other tokens.

So the harness has two oracles (``Workload.oracle``):

- ``recompute`` (run the engine in float32): both checks above.
- ``device`` (bf16): a tier hit must equal a device hit on the same KV. After each
  wave, every probe prefix (ending mid-block; see test_tier_vs_device.py for the
  block-boundary case) is served once from the device prefix cache, then, after a
  device-cache reset, from the CPU tier; only probes that each path served in full
  are compared. No recomputes and no forced preemptions run in this mode: both
  would put KV of another computation under the session's block hashes.
Sessions can be parked between chunks (``Workload.park_rate``): the next chunk then
resumes from the transcript, its prefix from the device prefix cache or the CPU
tier, and must still equal the recompute (in fp32: the answer of a session never
parked). The harness runs against the engine in process (through our ``SessionService``) or
against a server over HTTP (through our client), behind one ``Backend`` interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from app.provenance import ProvenanceRecorder

# -- workload --------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkPlan:
    token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class SessionPlan:
    chunks: list[ChunkPlan]


@dataclass(frozen=True)
class Workload:
    seed: int
    sessions: list[SessionPlan]
    concurrency: int
    # Probability of a prefix probe after each chunk, while sessions run.
    interleaved_probe_rate: float
    probes_after_close: int
    # Mean seconds between forced preemptions while sessions run; None: none.
    preempt_every_s: float | None = None
    # Sessions per wave; the device cache is reset and probed after each wave.
    wave_size: int = 8
    # "recompute" (float32 engines) or "device" (bf16: tier hit against device hit).
    oracle: str = "recompute"
    block_size: int = 32
    # Probability of parking a session after each of its chunks (1.0: always), so
    # the next chunk resumes from the device prefix cache or the CPU tier.
    park_rate: float = 0.0


def make_workload(
    seed: int,
    num_sessions: int,
    *,
    block_size: int,
    blocks_per_chunk: int,
    max_session_tokens: int,
    concurrency: int = 4,
    vocab_size: int = 700,
    max_chunks: int = 8,
    max_output_tokens: int = 12,
    interleaved_probe_rate: float = 0.5,
    probes_after_close: int = 2,
    preempt_every_s: float | None = None,
    oracle: str = "recompute",
    park_rate: float = 0.0,
) -> Workload:
    """Sessions with 1..max_chunks chunks of 1 token to several blocks; half the
    chunks make the context end exactly on, or one token off, a block or an
    offload-chunk boundary."""
    rng = random.Random(seed)
    offload_tokens = block_size * blocks_per_chunk
    sessions = []
    for _ in range(num_sessions):
        chunks: list[ChunkPlan] = []
        length = 0
        for _ in range(rng.randint(1, max_chunks)):
            if rng.random() < 0.5:
                unit = rng.choice((block_size, offload_tokens))
                boundary = (length // unit + rng.randint(1, 3)) * unit
                size = max(1, boundary - length + rng.choice((-1, 0, 1)))
            else:
                size = rng.choice((1, 2, rng.randint(1, 4 * offload_tokens)))
            max_tokens = rng.randint(1, max_output_tokens)
            if length + size + max_tokens > max_session_tokens:
                break
            chunks.append(ChunkPlan([rng.randrange(1, vocab_size) for _ in range(size)], max_tokens))
            length += size + max_tokens - 1
        if chunks:
            sessions.append(SessionPlan(chunks))
    if oracle == "device":
        interleaved_probe_rate, preempt_every_s = 0.0, None
    return Workload(
        seed,
        sessions,
        concurrency,
        interleaved_probe_rate,
        probes_after_close,
        preempt_every_s,
        2 * concurrency,
        oracle,
        block_size,
        park_rate,
    )


# -- backends ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    cpu_tier_tokens: int
    cached_tokens: int  # device and CPU tier


class Backend(Protocol):
    async def open_session(self) -> str: ...

    async def session_chunk(self, session_id: str, token_ids: list[int], max_tokens: int) -> list[int]: ...

    async def close_session(self, session_id: str) -> None: ...

    async def park_session(self, session_id: str) -> None: ...

    async def generate(self, prompt_ids: list[int], max_tokens: int, recompute: bool) -> Generation: ...

    async def top2_margin(self, prompt_ids: list[int]) -> float:
        """A salted recompute's logit margin between its two likeliest next tokens."""
        ...

    async def reset_device_cache(self) -> bool: ...

    async def leftover_requests(self) -> list[str]: ...

    async def engine_counter(self, name: str) -> float:
        """A vLLM Prometheus counter of this backend's engine (e.g. preemptions)."""
        ...

    async def preempt_running(self) -> None:
        """Preempt every running request through vLLM's own preemption path."""
        ...


class InProcessBackend:
    """Sessions through our SessionService on a real AsyncLLM; probes straight to the engine."""

    def __init__(self, engine: Any, service: Any, recorder: ProvenanceRecorder):
        self._engine = engine
        self._service = service
        self._recorder = recorder
        self._ids = itertools.count()

    async def open_session(self) -> str:
        from app.protocol import SessionCreateRequest, SessionDefaults

        defaults = SessionDefaults(temperature=0.0, ignore_eos=True)
        return (await self._service.create("harness", SessionCreateRequest(defaults=defaults))).id

    async def session_chunk(self, session_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        return list((await self.session_chunk_result(session_id, token_ids, max_tokens)).token_ids)

    async def session_chunk_result(self, session_id: str, token_ids: list[int], max_tokens: int) -> Any:
        """The service's ``ChunkResult``: the answer, and where its prompt's KV came from."""
        from app.protocol import SamplingOptions

        run = await self._service.start_chunk(
            "harness", session_id, token_ids, SamplingOptions(max_tokens=max_tokens), transport="harness", wait=True
        )
        return await run.result()

    async def close_session(self, session_id: str) -> None:
        await self._service.close("harness", session_id)

    async def park_session(self, session_id: str) -> None:
        await self._service.park("harness", session_id)

    async def generate(self, prompt_ids: list[int], max_tokens: int, recompute: bool) -> Generation:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        request_id = f"harness-{next(self._ids)}"
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            skip_reading_prefix_cache=True if recompute else None,
        )
        final = None
        salt = uuid.uuid4().hex if recompute else None  # see the module's docstring
        async for output in self._engine.generate(
            prompt=tokens_input(list(prompt_ids), cache_salt=salt), sampling_params=params, request_id=request_id
        ):
            final = output
        assert final is not None
        sources = self._recorder.pop(request_id)
        return Generation(
            list(final.outputs[0].token_ids), sources.cpu_tier_tokens if sources else 0, final.num_cached_tokens or 0
        )

    async def top2_margin(self, prompt_ids: list[int]) -> float:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, skip_reading_prefix_cache=True)
        final = None
        async for output in self._engine.generate(
            prompt=tokens_input(list(prompt_ids), cache_salt=uuid.uuid4().hex),
            sampling_params=params,
            request_id=f"harness-{next(self._ids)}",
        ):
            final = output
        assert final is not None and final.outputs[0].logprobs
        return _margin([entry.logprob for entry in final.outputs[0].logprobs[0].values()])

    async def reset_device_cache(self) -> bool:
        return bool(await self._engine.reset_prefix_cache())

    async def leftover_requests(self) -> list[str]:
        from tests.helpers import live_request_ids

        return sorted(live_request_ids(self._engine))

    async def preempt_running(self) -> None:
        # vLLM 0.32 admits a request only when all of it fits, so a small device
        # cache alone never preempts; a reset with reset_running_requests does,
        # through the scheduler's own _preempt_request. While idle sessions hold
        # blocks the reset itself then fails (and says so), after the preemption.
        with contextlib.suppress(Exception):
            await self._engine.reset_prefix_cache(reset_running_requests=True)

    async def engine_counter(self, name: str) -> float:
        from prometheus_client import REGISTRY

        model = self._engine.model_config.served_model_name
        return sum(
            sample.value
            for metric in REGISTRY.collect()
            for sample in metric.samples
            if sample.name == name and sample.labels.get("model_name") == model
        )


class HttpBackend:
    """Sessions through our async client (REST); probes through vLLM's /v1/completions."""

    def __init__(self, base_url: str, api_key: str | None, model: str):
        import httpx

        from clients import AsyncSessionsClient

        self._client = AsyncSessionsClient(base_url, api_key, max_retries=0)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300)
        self._model = model
        self._sessions: dict[str, Any] = {}
        self._opened: set[str] = set()

    async def open_session(self) -> str:
        session = await self._client.sessions.create(defaults={"temperature": 0, "ignore_eos": True})
        self._sessions[session.id] = session
        self._opened.add(session.id)
        return session.id

    async def session_chunk(self, session_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        return (await self._sessions[session_id].send(token_ids, max_tokens=max_tokens)).token_ids

    async def close_session(self, session_id: str) -> None:
        await self._sessions.pop(session_id).close()

    async def park_session(self, session_id: str) -> None:
        response = await self._http.post(f"/v1/sessions/{session_id}/park")
        response.raise_for_status()

    async def generate(self, prompt_ids: list[int], max_tokens: int, recompute: bool) -> Generation:
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if recompute:
            body["cache_salt"] = uuid.uuid4().hex  # new block hashes: no cache can serve it
        response = await self._http.post("/v1/completions", json=body)
        response.raise_for_status()
        payload = response.json()
        details = payload["usage"]["prompt_tokens_details"] or {}
        return Generation(
            list(payload["choices"][0]["token_ids"]),
            int(details.get("cpu_tier_tokens") or 0),
            int(details.get("cached_tokens") or 0),
        )

    async def top2_margin(self, prompt_ids: list[int]) -> float:
        body = {
            "model": self._model,
            "prompt": prompt_ids,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 2,
            "cache_salt": uuid.uuid4().hex,
        }
        response = await self._http.post("/v1/completions", json=body)
        response.raise_for_status()
        return _margin(list(response.json()["choices"][0]["logprobs"]["top_logprobs"][0].values()))

    async def reset_device_cache(self) -> bool:
        return (await self._http.post("/v1/admin/reset_device_cache")).status_code == 200

    async def leftover_requests(self) -> list[str]:
        # Only the harness's own: the shared server also holds other modules' sessions
        # for this key (a stored Response is a session), in whatever order xdist ran them.
        return [s.id for s in await self._client.sessions.list() if s.id in self._opened]

    async def preempt_running(self) -> None:
        return  # no operator route preempts; the server is exercised as it runs

    async def engine_counter(self, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = (await self._http.get("/metrics")).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and sample.labels.get("model_name") == self._model
        )

    async def aclose(self) -> None:
        await self._client.aclose()
        await self._http.aclose()


# -- the run ---------------------------------------------------------------------------


# A float32 recompute is exact in practice, not by construction: a chunked prefill and
# a one-pass prefill sum in other orders, so their logits differ in low bits. Where the
# oracle's two likeliest tokens are closer than this threshold, such a difference can
# flip greedy decoding: a mismatch there is a near-tie, reported with its numbers. The
# seed bug's mismatches had margins of 0.0026 to 1.39 (docs/correctness.md). A run
# fails on any other mismatch, or on near-ties above the rate.
NEAR_TIE_MARGIN = 1e-3
MAX_NEAR_TIE_RATE = 0.01


def _margin(logprobs: list[float]) -> float:
    top = sorted(logprobs, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


@dataclass
class Mismatch:
    kind: str  # "chunk" or "prefix"
    session: int
    chunk: int
    prompt_tokens: int
    expected: list[int]
    got: list[int]
    # Recompute oracle: the first differing output position, and the oracle's top-2
    # logit margin there (None: not measured, as for the device oracle).
    position: int | None = None
    margin: float | None = None

    @property
    def near_tie(self) -> bool:
        return self.margin is not None and self.margin < NEAR_TIE_MARGIN


class Mismatches:
    """A run's mismatches, told apart: near-ties, and failures (the others)."""

    mismatches: list[Mismatch]

    @property
    def failures(self) -> list[Mismatch]:
        return [m for m in self.mismatches if not m.near_tie]

    @property
    def near_ties(self) -> list[Mismatch]:
        return [m for m in self.mismatches if m.near_tie]


@dataclass
class Report(Mismatches):
    seed: int
    oracle: str = "recompute"
    sessions: int = 0
    chunks: int = 0
    parks: int = 0
    # Chunk answers compared with a recompute (recompute oracle only).
    chunks_checked: int = 0
    prefix_requests: int = 0
    # Device oracle: probes served in full by both paths, and so compared.
    prefix_requests_compared: int = 0
    prefix_requests_with_tier_hits: int = 0
    tier_tokens: int = 0
    device_resets: int = 0
    preemptions: int = 0
    leftover_requests: list[str] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        compared = self.chunks_checked + self.prefix_requests_compared
        return not self.failures and len(self.near_ties) <= MAX_NEAR_TIE_RATE * max(compared, 1)

    def summary(self) -> dict[str, Any]:
        data = asdict(self)
        data["mismatches"] = len(self.mismatches)
        data["near_ties"] = [asdict(m) for m in self.near_ties]
        data["first_mismatches"] = [asdict(m) for m in self.failures[:3]]
        data["mismatch_margins"] = sorted(round(m.margin, 6) for m in self.mismatches if m.margin is not None)
        data["passed"] = self.passed
        return data


async def measure_margin(backend: Backend, mismatch: Mismatch, prompt: list[int]) -> Mismatch:
    """The recompute's top-2 margin where the two outputs first part."""
    position = next(i for i, (a, b) in enumerate(itertools.zip_longest(mismatch.expected, mismatch.got)) if a != b)
    mismatch.position = position
    mismatch.margin = await backend.top2_margin(prompt + mismatch.expected[:position])
    return mismatch


async def run_workload(backend: Backend, workload: Workload) -> Report:
    report = Report(seed=workload.seed, oracle=workload.oracle)
    against_recompute = workload.oracle == "recompute"
    rng = random.Random(workload.seed + 1)
    limit = asyncio.Semaphore(workload.concurrency)
    contexts: dict[int, list[int]] = {}
    started = time.monotonic()
    preemptions_before = await backend.engine_counter("vllm:num_preemptions_total")

    async def measured(mismatch: Mismatch, prompt: list[int]) -> Mismatch:
        return await measure_margin(backend, mismatch, prompt)

    async def probe(session_index: int, chunk_index: int, context: list[int]) -> None:
        length = rng.randint(1, len(context))
        max_tokens = rng.randint(1, 8)
        served = await backend.generate(context[:length], max_tokens, recompute=False)
        expected = await backend.generate(context[:length], max_tokens, recompute=True)
        report.prefix_requests += 1
        report.prefix_requests_compared += 1
        if served.cpu_tier_tokens:
            report.prefix_requests_with_tier_hits += 1
            report.tier_tokens += served.cpu_tier_tokens
        if served.token_ids != expected.token_ids:
            report.mismatches.append(
                await measured(
                    Mismatch("prefix", session_index, chunk_index, length, expected.token_ids, served.token_ids),
                    context[:length],
                )
            )

    async def probe_tier_against_device(indices: list[int]) -> None:
        block = workload.block_size
        probes = []
        for index in indices:
            context = contexts[index]
            for _ in range(workload.probes_after_close):
                length = rng.randint(1, len(context))
                if length % block == 0:
                    length -= 1  # mid-block: see the module docstring
                if length > block:
                    probes.append((index, length, rng.randint(1, 8)))
        # Device hits first, while the wave's blocks are in the device prefix cache.
        device = [await backend.generate(contexts[i][:n], m, recompute=False) for i, n, m in probes]
        for (index, length, max_tokens), on_device in zip(probes, device):
            full = length // block * block
            if await backend.reset_device_cache():
                report.device_resets += 1
            from_tier = await backend.generate(contexts[index][:length], max_tokens, recompute=False)
            report.prefix_requests += 1
            if from_tier.cpu_tier_tokens:
                report.prefix_requests_with_tier_hits += 1
                report.tier_tokens += from_tier.cpu_tier_tokens
            if on_device.cached_tokens != full or from_tier.cpu_tier_tokens != full:
                continue  # one path lost blocks (evicted): the two are not the same KV
            report.prefix_requests_compared += 1
            if from_tier.token_ids != on_device.token_ids:
                report.mismatches.append(
                    Mismatch("prefix", index, -1, length, on_device.token_ids, from_tier.token_ids)
                )

    async def run_session(index: int, plan: SessionPlan) -> None:
        async with limit:
            session_id = await backend.open_session()
            context: list[int] = []
            try:
                for chunk_index, chunk in enumerate(plan.chunks):
                    got = await backend.session_chunk(session_id, chunk.token_ids, chunk.max_tokens)
                    report.chunks += 1
                    if against_recompute:
                        expected = await backend.generate(context + chunk.token_ids, chunk.max_tokens, recompute=True)
                        report.chunks_checked += 1
                        if got != expected.token_ids:
                            report.mismatches.append(
                                await measured(
                                    Mismatch(
                                        "chunk",
                                        index,
                                        chunk_index,
                                        len(context) + len(chunk.token_ids),
                                        expected.token_ids,
                                        got,
                                    ),
                                    context + chunk.token_ids,
                                )
                            )
                    # The session's context holds every output token (the last one is
                    # sent to the engine again with the next chunk).
                    context += chunk.token_ids + got
                    if rng.random() < workload.interleaved_probe_rate:
                        await probe(index, chunk_index, context)
                    if chunk_index + 1 < len(plan.chunks) and rng.random() < workload.park_rate:
                        await backend.park_session(session_id)
                        report.parks += 1
            finally:
                await backend.close_session(session_id)
            contexts[index] = context
            report.sessions += 1

    async def preempt_now_and_then() -> None:
        assert workload.preempt_every_s is not None
        while True:
            await asyncio.sleep(rng.expovariate(1 / workload.preempt_every_s))
            await backend.preempt_running()

    # Sessions run in waves (concurrency sessions at a time within a wave). When a
    # wave's sessions have all closed, nothing holds device blocks: the device cache
    # is dropped and their prefixes probed, so they come from the CPU tier (or are
    # recomputed where the small tier already evicted them).
    indexed = list(enumerate(workload.sessions))
    for start in range(0, len(indexed), workload.wave_size):
        wave = indexed[start : start + workload.wave_size]
        preemptor = asyncio.create_task(preempt_now_and_then()) if workload.preempt_every_s else None
        try:
            await asyncio.gather(*(run_session(i, plan) for i, plan in wave))
        finally:
            if preemptor is not None:
                preemptor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await preemptor
        if not against_recompute:
            await probe_tier_against_device([index for index, _ in wave])
            continue
        if await backend.reset_device_cache():
            report.device_resets += 1
        for index, _ in wave:
            for _ in range(workload.probes_after_close):
                await probe(index, -1, contexts[index])
    report.leftover_requests = await backend.leftover_requests()
    report.preemptions = int(await backend.engine_counter("vllm:num_preemptions_total") - preemptions_before)
    report.seconds = round(time.monotonic() - started, 2)
    return report


# -- configurations -----------------------------------------------------------------------

MIB = 1 << 20
SESSION_TOKENS = 512
CONCURRENCY = 4
PREEMPT_EVERY_S = 0.3

# The recompute oracle runs the engine in float32 (see the module docstring); the
# tiny model then holds 4 KiB of KV per token (2 KiB in bf16, for the device oracle).
# Device cache: 2,560 tokens = room for the 4 sessions' contexts (up to 512 tokens
# each, held while they wait for their next chunk) plus one more request, so there
# is always progress but cached blocks are evicted all the time. vLLM 0.32 admits
# a request only when all of it fits, so memory pressure alone never preempts:
# the harness preempts running requests itself (see preempt_running).
# CPU tier: 5,632 tokens, less than a run stores, so it evicts too.
BASE_CONFIG: dict[str, Any] = {
    # The embedded tiny model, whatever the server's default (the sizes below are its).
    "model_preset": "tiny",
    "kv_cache_gib": 10 * MIB / (1 << 30),
    "cpu_tier_gib": 22 * MIB / (1 << 30),
    "block_size": 32,
    "max_model_len": 1024,
    "max_num_seqs": 16,
    "max_sessions": 16,
    "max_chunk_tokens": 1024,
    "max_chunk_output_tokens": 64,
    "session_idle_timeout_s": 3600.0,
    # Small prefill steps: long prompts run over several steps, so the forced
    # preemptions often land mid-prefill.
    "engine_args": {"max_num_batched_tokens": 64, "worker_extension_cls": "tests.kv_inspector.KVInspector"},
}

# One config copies tier pages on the host tier's copy thread (the default; the
# harness leaves it a CPU, see InProcessHarness), loads of every size included (the
# tiny model's are all under the default size for the thread); the other keeps the
# inline copies (tier_copy_thread=false) covered. There is no async-scheduling config:
# vLLM's CPU platform turns async scheduling off whatever the engine arguments say
# (CpuPlatform.check_and_update_config), so one would run the synchronous scheduler
# again (the test checks that this still holds). Async scheduling is covered on
# vLLM's real Scheduler in tests/unit/test_connector_streaming_fix.py.
ON_THE_COPY_THREAD = {"tier_copy_thread_min_load_bytes": 0}
HARNESS_CONFIGS: dict[str, dict[str, Any]] = {
    "bpc1": {"blocks_per_chunk": 1, **ON_THE_COPY_THREAD},
    "bpc2-inline": {"blocks_per_chunk": 2, "tier_copy_thread": False},
}


# The seed of the suite's harness runs (tests/engine): the same workloads every run.
SUITE_SEED = 20261130

# The dtype each oracle is sound in.
ORACLE_DTYPES = {"recompute": "float32", "device": "bfloat16"}


def harness_settings(name: str, oracle: str = "recompute", **overrides: Any) -> Any:
    from app.settings import Settings

    values = {
        **BASE_CONFIG,
        **HARNESS_CONFIGS[name],
        "dtype": ORACLE_DTYPES[oracle],
        "served_model_name": f"harness-{name}",
        **overrides,
    }
    return Settings(_env_file=None, **values)


def workload_for(settings: Any, seed: int, num_sessions: int, park_rate: float = 0.0) -> Workload:
    oracle = next(o for o, dtype in ORACLE_DTYPES.items() if dtype == settings.dtype)
    return make_workload(
        seed,
        num_sessions,
        block_size=settings.block_size,
        blocks_per_chunk=settings.blocks_per_chunk,
        max_session_tokens=SESSION_TOKENS,
        concurrency=CONCURRENCY,
        preempt_every_s=PREEMPT_EVERY_S,
        oracle=oracle,
        park_rate=park_rate,
    )


class InProcessHarness:
    """An engine, a session service and the in-process backend, started and stopped together."""

    def __init__(self, settings: Any, attention: str = "auto"):
        self.settings = settings
        self.attention = attention  # STREAMSESS_CPU_ATTENTION (connectors/cpu_platform.py)

    async def __aenter__(self) -> InProcessBackend:
        from app.engine import build_engine
        from app.wiring import session_service
        from connectors.cpu_platform import ATTENTION_ENV
        from tests.helpers import environment, record_attention_kernels

        # One CPU left to the engine core, as in the benchmarks: the host tier then
        # copies on its copy thread there (with no CPU to spare it copies inline).
        with environment(**{ATTENTION_ENV: self.attention, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}):
            self.engine = build_engine(self.settings)
        self.kernels = await record_attention_kernels(self.engine)
        self.service = session_service(self.engine, self.settings)
        await self.service.start()
        assert self.service.recorder is not None
        return InProcessBackend(self.engine, self.service, self.service.recorder)

    async def __aexit__(self, *exc: object) -> None:
        from app.engine import flush_disk_tier, shutdown_engine

        await self.service.stop()
        await flush_disk_tier(self.engine)  # as the server's stop does (a no-op without a disk tier)
        shutdown_engine(self.engine)
