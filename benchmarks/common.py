"""Shared parts of the benchmarks: servers under test, engine settings, timing, results.

Every comparison runs both sides in the same run with the same engine settings and
compile mode, one server at a time, and pins vLLM's CPU thread count with
VLLM_CPU_NUM_OF_RESERVED_CPU: setting a kv_transfer_config otherwise stops vLLM from
reserving a core, and "offload on vs off" would really be 2 threads against 1.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from app.engine import uses_packed_linear
from app.settings import Settings
from connectors.cpu_linear import packed_config

# The server harness is the tests' (tests/harness); re-exported for the benchmark scripts.
from tests.harness.servers import REPO as REPO
from tests.harness.servers import RESERVED_CPUS as RESERVED_CPUS
from tests.harness.servers import RunningServer as RunningServer
from tests.harness.servers import app_server as app_server
from tests.harness.servers import current_pool, serve, stop_engine
from tests.harness.servers import engine_env as engine_env
from tests.harness.servers import enter_together as enter_together
from tests.harness.servers import free_port as free_port
from tests.harness.servers import pooled as pooled

RESULTS = REPO / "benchmarks" / "results"
API_KEY = "bench-key"
# Two engines side by side have their model workers bound to the same CPU, and where a
# worker has a process of its own (vLLM's server; ours with cpu_worker_in_engine_core
# off) its shared-memory readers keep spinning for 1 s after their last read
# (SpinCondition.busy_loop_s): an engine that has just worked takes CPU from the other
# for a second. A benchmark switching between them waits this long first.
SWITCH_SETTLE_S = 1.5
API_HEADERS = {"Authorization": f"Bearer {API_KEY}"}
T = TypeVar("T")


@dataclass(frozen=True)
class EngineSetup:
    """The engine settings both sides of a comparison share."""

    preset: str = "bench"
    kv_cache_gib: float = 1.0
    cpu_tier_gib: float = 4.0
    block_size: int = 32
    max_model_len: int = 4096
    max_num_seqs: int = 64
    enforce_eager: bool = True
    # bf16 is the embedded models' own dtype; float32 runs far faster on CPUs
    # without native bf16 (AVX2 only), where bf16 matmuls are emulated.
    dtype: str = "bfloat16"

    def model_dir(self) -> str:
        from app.models.builder import ensure_model

        return str(ensure_model(self.preset))

    def describe(self) -> dict[str, Any]:
        return {
            "model_preset": self.preset,
            "kv_cache_gib": self.kv_cache_gib,
            "cpu_tier_gib": self.cpu_tier_gib,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "dtype": self.dtype,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": RESERVED_CPUS,
        }


def in_process_engine(
    setup: EngineSetup, served_model_name: str, shareable: bool = True, **settings: Any
) -> tuple[Any, Any, Any]:
    """(engine, provenance recorder, settings) for a benchmark that drives AsyncLLM in
    process, with ``setup``'s engine settings and the same thread count as the servers.
    Hand the engine back with ``release_engine``. ``shareable`` False: never a pool's (two
    engines of the same settings that must be two, as two replicas)."""
    from app.engine import build_engine, build_engine_args
    from app.provenance import ProvenanceRecorder
    from app.settings import Settings

    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = RESERVED_CPUS
    engine_settings = Settings(
        _env_file=None,
        model_preset=setup.preset,
        kv_cache_gib=setup.kv_cache_gib,
        cpu_tier_gib=setup.cpu_tier_gib,
        block_size=setup.block_size,
        max_model_len=setup.max_model_len,
        enforce_eager=setup.enforce_eager,
        dtype=setup.dtype,
        served_model_name=served_model_name,
        **settings,
    )
    if (pool := current_pool()) is None or not shareable:
        engine = build_engine(engine_settings)
    else:
        # What the engine is made of: its vLLM arguments, less the name it serves under
        # and the connector's engine id (random per call).
        args = repr(build_engine_args(engine_settings.model_copy(update={"served_model_name": "pooled"})))
        key = re.sub(r"engine_id='[^']*'", "", args)
        engine = pool.engine(key, lambda: build_engine(engine_settings))
    recorder = ProvenanceRecorder(disk_tier=engine_settings.disk_tier_gib > 0)
    recorder.attach(engine)
    return engine, recorder, engine_settings


def release_engine(engine: Any) -> None:
    """The benchmark is done with ``engine``: stopped, unless a pool keeps it."""
    if (pool := current_pool()) is None or engine not in pool.engines.values():
        stop_engine(engine)


def our_server(
    setup: EngineSetup, log_dir: Path, connector: str = "offloading", name: str = "ours", **settings: str
) -> contextlib.AbstractContextManager[RunningServer]:
    """Our server on ``setup``; ``settings`` are more STREAMSESS_* values (name=value);
    ``name`` names its log (two of ours side by side need two)."""
    return app_server(
        name, log_dir / f"{name}.log", {**our_settings(setup, connector), **settings}, model=f"embedded-{setup.preset}"
    )


def our_settings(setup: EngineSetup, connector: str = "offloading") -> dict[str, str]:
    """The STREAMSESS_* values (name: value) of our server on ``setup``."""
    return {
        "model_preset": setup.preset,
        "api_keys": API_KEY,
        "kv_cache_gib": str(setup.kv_cache_gib),
        "cpu_tier_gib": str(setup.cpu_tier_gib),
        "block_size": str(setup.block_size),
        "max_model_len": str(setup.max_model_len),
        "max_num_seqs": str(setup.max_num_seqs),
        "max_sessions": "4096",
        "enforce_eager": str(setup.enforce_eager).lower(),
        "dtype": setup.dtype,
        "connector": connector,
        "log_level": "warning",
    }


def vllm_server(
    setup: EngineSetup,
    log_dir: Path,
    prefix_caching: bool,
    extra_args: list[str] | None = None,
    label: str | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> contextlib.AbstractContextManager[RunningServer]:
    """vLLM's own OpenAI server, as a user would run it, with the same engine settings
    (``extra_args``: more of its flags, e.g. a --kv-transfer-config; ``env``: more of
    its environment, e.g. VLLM_ENABLE_RESPONSES_API_STORE). Where ours computes with vLLM's
    packed linear kernel by default (connectors/cpu_linear.py), this one is asked to as well:
    the plugin is installed in the same environment, and a comparison of servers must not be
    one of matmul kernels."""
    port = port or free_port()
    name = f"embedded-{setup.preset}"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        setup.model_dir(),
        "--served-model-name",
        name,
        "--block-size",
        str(setup.block_size),
        "--kv-cache-memory-bytes",
        str(int(setup.kv_cache_gib * (1 << 30))),
        "--max-model-len",
        str(setup.max_model_len),
        "--max-num-seqs",
        str(setup.max_num_seqs),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--enforce-eager" if setup.enforce_eager else "--no-enforce-eager",
        "--dtype",
        setup.dtype,
        "--disable-log-stats",
        *(["--additional-config", json.dumps(packed_config())] if uses_packed_linear(Settings(_env_file=None)) else []),
        *(extra_args or []),
    ]
    label = label or f"vllm-prefix-{'on' if prefix_caching else 'off'}"
    key = ("vllm", label, tuple(command), tuple(sorted((env or {}).items())))  # what it is, less where it listens
    command += ["--host", "127.0.0.1", "--port", str(port)]
    return serve(label, command, {**engine_env(), **(env or {})}, port, name, log_dir / f"{label}.log", key)


@contextlib.contextmanager
def py_spy_sampled(pid: int, out: Path, rate_hz: int, subprocesses: bool = False) -> Iterator[dict[str, Any]]:
    """py-spy samples ``pid`` (and its children, with ``subprocesses``) while the block
    runs; collapsed stacks into ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    profile: dict[str, Any] = {"path": out, "rate_hz": rate_hz}
    command = [
        "py-spy",
        "record",
        "--pid",
        str(pid),
        "--rate",
        str(rate_hz),
        "--nonblocking",
        "--format",
        "raw",
        "--output",
        str(out),
        *(["--subprocesses"] if subprocesses else []),
    ]
    sampler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # let py-spy attach before the work starts
    start = time.perf_counter()
    try:
        yield profile
    finally:
        profile["seconds"] = time.perf_counter() - start
        sampler.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        sampler.wait(timeout=60)


def summarize_profile(
    profile: dict[str, Any], per: int, top: int = 15, functions: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Non-idle milliseconds per unit of work (``per`` units sampled), the frames with
    the most self time, and the inclusive time of the named ``functions`` (a frame's
    function name, e.g. ``HostTierWorker._copy``; ``execute_model`` matches any class's)."""
    self_samples: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(profile["path"]).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        self_samples[frames[-1]] += int(count)
        total += int(count)
        names = {frame.split(" (")[0] for frame in frames}
        for function in functions:
            if any(name == function or name.endswith("." + function) for name in names):
                inclusive[function] += int(count)
    ms_per_sample = 1000 / profile["rate_hz"]
    return {
        "seconds": profile["seconds"],
        "busy_ms_per_unit": total * ms_per_sample / per,
        "top_self_ms_per_unit": {frame: count * ms_per_sample / per for frame, count in self_samples.most_common(top)},
        **({"inclusive_ms_per_unit": {f: inclusive[f] * ms_per_sample / per for f in functions}} if functions else {}),
    }


def benchmark_parser(doc: str | None, kv_cache_gib: float) -> argparse.ArgumentParser:
    """The options every benchmark takes; each adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, tiny size: the test suite's smoke run")
    parser.add_argument("--preset", default="bench", help="embedded model preset")
    parser.add_argument("--kv-cache-gib", type=float, default=kv_cache_gib)
    parser.add_argument("--cpu-tier-gib", type=float, default=4.0)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="model dtype on every side (float32 on CPUs without native bf16)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS), help="where the JSON and PNG results go")
    parser.add_argument(
        "--tag", default="", help="appended to the result's name, e.g. the CPU kind: cpu_decode-amx.json"
    )
    return parser


def tagged(name: str, args: argparse.Namespace) -> str:
    """A result's name with the run's --tag, so runs on different CPUs sit side by side."""
    return f"{name}-{args.tag}" if args.tag else name


def quick_engine(args: argparse.Namespace) -> None:
    """--quick engine settings, shared by every benchmark."""
    args.preset, args.kv_cache_gib, args.cpu_tier_gib = "tiny", 0.25, 0.5


def finish(name: str, result: dict[str, Any], out: str, plot: Callable[[dict[str, Any]], Any]) -> Path:
    """Write the JSON and the plot's PNG, and print the JSON's path (the smoke test reads
    it), then the summary, if the result has one."""
    path = write_result(name, result, Path(out))
    figure = plot(result)
    figure.tight_layout()
    figure.savefig(path.with_suffix(".png"), dpi=110)
    pyplot().close(figure)
    print(path)
    for key, value in result.get("summary", {}).items():
        print(f"{key}: {value}")
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Random words for filler text: the embedded models' tokenizer spends about 4.4 tokens on each.
WORDS = (
    "amber",
    "basalt",
    "cobalt",
    "dune",
    "ember",
    "fjord",
    "glacier",
    "harbor",
    "island",
    "jade",
    "kelp",
    "lagoon",
    "meadow",
    "nebula",
    "orchid",
    "prairie",
    "quartz",
    "river",
    "summit",
    "tundra",
)
PerTurn = list[dict[str, float]]
TOKENS_PER_WORD = 4.44  # the embedded models' tokenizer on WORDS


def word_text(rng: random.Random, tokens: int) -> str:
    """Filler text of about ``tokens`` tokens (at least one word)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens / TOKENS_PER_WORD))))


def median_per_turn(runs: list[PerTurn]) -> PerTurn:
    """Each turn's median over runs of the same turns, key by key."""
    return [{key: statistics.median(run[i][key] for run in runs) for key in runs[0][i]} for i in range(len(runs[0]))]


def plot_decode_rounds(axis: Any, rounds: dict[str, list[dict[str, float]]]) -> None:
    """Each side's decode tokens/s: its rounds as points over a bar at their median."""
    for position, side in enumerate(rounds):
        values = [r["decode_tokens_per_s"] for r in rounds[side]]
        axis.scatter([position] * len(values), values, alpha=0.6)
        axis.bar(position, statistics.median(values), alpha=0.3)
    axis.set_xticks(range(len(rounds)), list(rounds))
    axis.set_ylabel("decode tokens/s (one stream)")


def cpu_caption(result: dict[str, Any]) -> str:
    """The machine a result was measured on, for a plot's title."""
    cpu = result["machine"]
    return f"{cpu['cpus']} CPUs: {', '.join(cpu['cpu_flags'])}"


def plot_ttft_per_turn(per_turn: dict[str, list[dict[str, float]]], title: str) -> Any:
    """Each side's time to first token by turn, on a log scale."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    figure, axis = plt.subplots(figsize=(8, 5))
    for side, turns in per_turn.items():
        axis.plot(range(1, len(turns) + 1), [t["ttft_s"] * 1000 for t in turns], marker="o", label=side)
    axis.set_xlabel("turn")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_ylabel("time to first token (ms)")
    axis.set_yscale("log")
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    return figure


def random_tokens(rng: random.Random, count: int, vocab: int = 700) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# The CPU features every figure depends on (machines differ: AMX, AVX-512 without it, AVX2).
CPU_FLAGS = ("amx_tile", "amx_bf16", "avx512f", "avx512_bf16", "avx512_vnni", "avx2")


def machine() -> dict[str, Any]:
    cpu: dict[str, Any] = {"cpu_model": None, "cpu_flags": []}
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text()
        fields = {
            key.strip(): value.strip()
            for key, value in (line.split(":", 1) for line in info.splitlines() if ":" in line)
        }  # the last CPU's (all alike)
        flags = set(fields.get("flags", "").split())
        cpu = {
            "cpu_model": fields.get("model name") or None,
            "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
        }
    return {
        "cpus": os.cpu_count(),
        **cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "event_loop": _event_loop(),
    }


def _event_loop() -> str | None:
    """The benchmark's own event loop (its clients', and an in-process floor's)."""
    try:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]
    except RuntimeError:
        return None


# The latency benchmarks' loop: what the floor's AsyncLLM and the clients run on.
EVENT_LOOPS = ("asyncio", "uvloop")


def add_loop_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--loop",
        choices=EVENT_LOOPS,
        default="asyncio",
        help="the event loop of this process (the clients, and an in-process floor): asyncio's own, as every "
        "figure before 2026-12-05 (commit aad6f92); or uvloop, which our server and vLLM's own run AsyncLLM on (on the EPYC, "
        "10 to 20 us off a loopback hop and no difference in the transport gaps beyond the runs' spread)",
    )


def run_on_loop(main: Coroutine[Any, Any, T], loop: str) -> T:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def write_result(name: str, payload: dict[str, Any], out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "run": run_record(), "machine": machine(), **payload}, indent=2))
    return path


def run_record() -> dict[str, Any]:
    """When, at which commit and by which command a result was made: what the benchmarks
    page shows above each table (``benchmarks.report``)."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)

    commit = git("rev-parse", "--short", "HEAD").stdout.strip() or None
    if (
        commit
        and git("diff", "--quiet", "HEAD", "--", "app", "connectors", "tests", ":(glob)benchmarks/*.py").returncode
    ):
        commit += "+changes"  # measured on uncommitted code
    command = " ".join(["python", "-m", f"benchmarks.{Path(sys.argv[0]).stem}", *sys.argv[1:]])
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit, "command": command}


def served_model(server: RunningServer) -> str:
    """The model a server serves, by the name it answers to (its /v1/models)."""
    return str(httpx.get(f"{server.base_url}/v1/models", headers=API_HEADERS).json()["data"][0]["id"])


def event_text(event: dict[str, Any]) -> str:
    """The generated text a streamed event carries: an OpenAI completion chunk's, our
    session delta's, or a llama.cpp ``/completion`` chunk's."""
    if choices := event.get("choices"):
        return str(choices[0].get("text") or "")
    if event.get("object") == "session.chunk.delta":
        return str(event["delta"]["text"])
    return "" if event.get("stop") else str(event.get("content") or "")


def streamed(server: RunningServer, path: str, body: dict[str, Any]) -> tuple[list[float], str, dict[str, Any]]:
    """POST a streamed request (synchronously): when each event with generated text
    arrived, the text, and the last event (the usage, or llama.cpp's timings)."""
    stamps: list[float] = []
    texts: list[str] = []
    last: dict[str, Any] = {}
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, headers=API_HEADERS, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            last = json.loads(line[len("data: ") :])
            if text := event_text(last):
                stamps.append(time.perf_counter())
                texts.append(text)
    return stamps, "".join(texts), last


def decode_speed(server: RunningServer, model: str, prompt: str | list[int], tokens: int) -> dict[str, float]:
    """One stream on /v1/completions, greedy, ``ignore_eos``: seconds to its first token,
    and decode tokens/s from the first token to the last. The tokens are the usage's (or,
    where a server reports none, the ``tokens`` that ``ignore_eos`` makes it generate): a
    streamed event is not a token, since a token that ends inside a character carries no
    text and its event may be left out."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps, _, last = streamed(server, "/v1/completions", body)
    generated = int((last.get("usage") or {}).get("completion_tokens") or tokens)
    return {
        "ttft_s": stamps[0] - start,
        "tokens": generated,
        "decode_tokens_per_s": (generated - 1) / (stamps[-1] - stamps[0]),
    }


def alternated(sides: list[T], index: int) -> list[T]:
    """The sides in order on even rounds, reversed on odd ones: no side always goes first."""
    return sides if index % 2 == 0 else sides[::-1]


async def sse_completion(
    http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, float, list[int]]:
    """One streamed /v1/completions request: (time to first token, total time, token ids)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: ") :])
            for choice in payload.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - start
                tokens.extend(ids)
    total = time.perf_counter() - start
    return (first if first is not None else total), total, tokens
